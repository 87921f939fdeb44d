"""Consumer processes (``kafka.consumer_processes`` > 0): N group members, each in a child
process of its own, feed ONE sink in this process.

Why: in one process the consumer's Python (the client's fetch parsing, protobuf decoding,
validation) and the engine's Python take turns on the GIL, so ingest uses one core however
many the machine has (bench/results/ingest_cpu_2026-12-02.json: 1.0 CPU-s per wall-s).
A child process decodes and validates on a core of its own; this process only applies.

How: each child runs the ``kafka.client`` consumer (streams/clients.py) over a
:class:`PipeSink`, which turns every :class:`~streams.sink.BatchSink` call into a message on
a pipe and waits for the answer. :class:`ConsumerProcesses` (here, in the engine's process)
answers the children's calls one at a time on the thread that runs :meth:`run`, against the
real sink, so the sink sees exactly the calls one consumer would make, never two at once
(the BatchSink contract). Each child is an ordinary group member: the group spreads the
partitions over the children (and over other instances), rebalances call the sink as
always, and the sink's checkpoint holds state and offsets together as before; a child
commits to the group only the offsets of its own partitions.

Batches cross the pipe as columns (:class:`streams.batch.EventBatch`), not as pickled event
objects, with each event's duplicate key hashed in the child: a sink that says
``takes_columns = True`` (recmem's KafkaIngest: the engine groups columns directly) gets
them as they are, any other sink a list of ValidEvent. Columns unpickle as a few lists and
arrays, and the engine's process builds no per-event objects.

Failure (nothing half-written, nothing skipped):

- the sink raises in this process: the child that called gets the error and closes without
  calling the sink again; every later call of any child gets an error too (the state may be
  half-applied, so nothing is checkpointed), and :meth:`run` raises the sink's error;
- a child fails (a dead-letter write, a position policy, its client) or exits: the others
  are stopped the normal way (their final checkpoint included: the sink's state is whole),
  and :meth:`run` raises the child's error;
- this process dies: each child notices (its pipe closes, or its parent changes) and
  closes without a checkpoint; a restart replays from the last one.

Figures: each child sends its consumer's metrics about once a second; this process's
:class:`~streams.metrics.IngestMetrics` shows their sums (events, records, dead letters,
batch and checkpoint times, lag, partitions assigned) next to the sink's own gauges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from prometheus_client.metrics_core import Metric

from streams.batch import EventBatch
from streams.config import KafkaConfig
from streams.consumer_base import stop_on_signals
from streams.group import Member
from streams.metrics import IngestMetrics
from streams.sink import BatchSink, Restoring, Resume, SourceMarks
from streams.validate import ValidEvent

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0
"""How often a child sends its figures."""
PARENT_CHECK_S = 0.5
"""How often a child checks that its parent is alive."""
STOP_GRACE_S = 60.0
"""After stop (or a failure), how long the children have to checkpoint and leave before
they are killed."""
LEADER_FIRST_S = 10.0
"""At a stop, how long the other children wait for the group's leader to stop first."""

# ---- the child's side ----------------------------------------------------------------------


class SinkError(RuntimeError):
    """The sink (in the engine's process) raised; carries its message when the error itself
    could not cross the pipe."""


class EngineGone(RuntimeError):
    """The engine's process ended (its pipe closed)."""


class PipeSink:
    """A BatchSink in a child process: each call goes to the parent's sink and waits for its
    answer. ``metrics``: the child consumer's figures, sent along about once a second."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.metrics: IngestMetrics | None = None
        self._sent_metrics = 0.0

    def _call(self, name: str, *args: Any) -> Any:
        try:
            self.conn.send(("call", name, args))
            kind, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise EngineGone("the engine process is gone: leaving without a checkpoint") from e
        if kind == "err":
            raise value
        return value

    def send_metrics(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.metrics is None or (not force and now - self._sent_metrics < METRICS_INTERVAL_S):
            return
        self._sent_metrics = now
        self.conn.send(("metrics", snapshot(self.metrics)))

    # BatchSink, and its optional calls
    def on_rebalancing(self) -> None:
        self._call("on_rebalancing")

    def on_group(self, view: Any) -> None:
        self._call("on_group", view)

    def on_assigned(self, partitions: list[int]) -> Mapping[int, Resume | int | Restoring]:
        return self._call("on_assigned", partitions)  # type: ignore[no-any-return]

    def restored(self) -> dict[int, Any]:
        return self._call("restored")  # type: ignore[no-any-return]

    def on_revoked(self, partitions: list[int]) -> None:
        self._call("on_revoked", partitions)

    def on_lost(self, partitions: list[int]) -> None:
        self._call("on_lost", partitions)

    takes_columns = True
    """The consumer hands columns (``streams.columns.decode_records``): they cross the pipe
    as they are."""

    def apply_batch(
        self,
        events: list[ValidEvent] | EventBatch,
        next_offsets: dict[int, int],
        source: SourceMarks | None = None,
    ) -> None:
        batch = events if isinstance(events, EventBatch) else EventBatch.of(events)
        self._call("apply_batch", batch, next_offsets, source)

    def checkpoint_due(self) -> bool:
        self.send_metrics()
        return bool(self._call("checkpoint_due"))

    def checkpoint(self) -> dict[int, int]:
        return self._call("checkpoint")  # type: ignore[no-any-return]


def snapshot(metrics: IngestMetrics) -> list[tuple[str, str, str, list[Any]]]:
    """The registry's figures as plain data: (name, documentation, type, samples)."""
    return [
        (m.name, m.documentation, m.type, [(s.name, dict(s.labels), s.value) for s in m.samples])
        for m in metrics.registry.collect()
    ]


def _child_main(
    cfg: KafkaConfig,
    index: int,
    conn: Connection,
    member: Member,
    client_id: str,
    levels: dict[str, int],
) -> None:
    """A consumer process: the ``kafka.client`` consumer over a PipeSink until stopped
    (SIGTERM / SIGINT), its parent is gone, or it fails."""
    from streams.clients import make_consumer

    logging.basicConfig(
        level=levels.get("", logging.WARNING),
        format=f"%(asctime)s %(levelname)s consumer-{index} %(name)s: %(message)s",
    )
    for name, level in levels.items():
        if name:
            logging.getLogger(name).setLevel(level)
    parent = os.getppid()
    sink = PipeSink(conn)
    consumer = make_consumer(cfg, sink, member=member, client_id=f"{client_id}-{index}")
    sink.metrics = consumer.metrics
    consumer.install_signal_handlers()

    def watch_parent() -> None:
        while not consumer.stopping:
            if os.getppid() != parent:
                log.warning("the engine process is gone: stopping")
                consumer.stop()
                return
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch_parent, name="watch-parent", daemon=True).start()
    try:
        consumer.run()
        sink.send_metrics(force=True)
        conn.send(("done", None))
    except EngineGone as e:
        log.warning("%s", e)
        raise SystemExit(1) from None
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit 1
        text = "".join(traceback.format_exception(e))
        with contextlib.suppress(OSError):  # the parent is gone
            conn.send(("died", (text, _portable(e))))
        raise SystemExit(1) from None


# ---- the engine's side ---------------------------------------------------------------------


class _ChildFigures:
    """Prometheus collector: the sum over the children of their latest figures."""

    def __init__(self) -> None:
        self.latest: dict[int, list[tuple[str, str, str, list[Any]]]] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for figures in list(self.latest.values()):
            for name, doc, typ, samples in figures:
                if name not in families:
                    families[name] = Metric(name, doc, typ)
                    sums[name] = {}
                for sample, labels, value in samples:
                    key = (sample, tuple(sorted(labels.items())))
                    sums[name][key] = sums[name].get(key, 0.0) + value
        for name, metric in families.items():
            for (sample, labels), value in sums[name].items():
                metric.add_sample(sample, dict(labels), value)
            yield metric


@dataclasses.dataclass
class _Child:
    index: int
    process: Any
    conn: Connection
    partitions: set[int] = dataclasses.field(default_factory=set)
    finished: bool = False
    """Said "done" or "died", or its pipe closed."""


class ConsumerProcesses:
    """``n`` consumer processes on ``cfg.topic`` / ``cfg.group_id`` feeding ``sink``; the
    interface of :class:`~streams.consumer_base.BaseConsumer` (run, stop, metrics).

    ``metrics``: where the children's figures are shown (a fresh IngestMetrics when None),
    served on ``cfg.metrics_port`` by :meth:`run` unless that is 0 or it is served already;
    the children serve none.
    """

    def __init__(
        self,
        cfg: KafkaConfig,
        sink: BatchSink,
        n: int,
        metrics: IngestMetrics | None = None,
        *,
        client_id: str = "recmem-ingest",
        member: Member | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"consumer processes must be >= 1, got {n}")
        self.cfg = cfg
        self.sink = sink
        self.n = n
        self.client_id = client_id
        self.member = member or Member()
        self.metrics = metrics if metrics is not None else IngestMetrics()
        m = self.metrics
        for own in (
            m.events,
            m.records,
            m.dead_letters,
            m.batch_seconds,
            m.checkpoint_seconds,
            m.lag,
            m.assigned,
        ):  # the children count these; shown as their sums instead
            m.registry.unregister(own)
        self._figures = _ChildFigures()
        m.registry.register(self._figures)
        self._stop = threading.Event()
        self._children: list[_Child] = []
        self._sink_error: BaseException | None = None
        self._child_error: BaseException | None = None
        self._restored: dict[int, Any] = {}
        """Restores the sink reported done, kept for the child that owns the partition."""
        self._leader: int | None = None
        """The child that led the group's latest generation it reported (None: none, or not
        known)."""

    # ----------------------------------------------------------------- control
    def stop(self) -> None:
        """Ask :meth:`run` to stop the children (each finishes its batch, checkpoints,
        commits and leaves the group) and return."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def assignment(self) -> list[int]:
        """Partitions the children own now."""
        return sorted(p for c in self._children for p in c.partitions)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call :meth:`stop` (main thread only)."""
        stop_on_signals(self.stop, "stopping the consumer processes")

    # --------------------------------------------------------------------- run
    def run(self) -> None:
        """Start the children, answer their sink calls until they have all stopped; raise
        the sink's error, else the first child's."""
        cfg = self.cfg
        own_endpoint = self.metrics.port == 0 and cfg.metrics_port > 0
        child_cfg = dataclasses.replace(cfg, metrics_port=0, consumer_processes=0)
        ctx = mp.get_context("spawn")  # no fork of a process with CUDA and torch threads
        levels = {n: logging.getLogger(n).getEffectiveLevel() for n in ("", "streams", "kafka")}
        try:
            self.metrics.serve(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
            for i in range(self.n):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_child_main,
                    args=(child_cfg, i, theirs, self.member, self.client_id, levels),
                    name=f"recmem-consumer-{i}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._children.append(_Child(i, proc, ours))
            log.info(
                "consuming %s as group %s in %d processes (%s)",
                cfg.topic, cfg.group_id, self.n, cfg.client,
            )  # fmt: skip
            self._serve()
        finally:
            self._reap()
            if own_endpoint:
                self.metrics.close()
        if self._sink_error is not None:
            raise self._sink_error
        if self._child_error is not None:
            raise self._child_error

    def _serve(self) -> None:
        by_conn = {c.conn: c for c in self._children}
        signalled: set[int] = set()
        deadline: float | None = None
        while any(not c.finished for c in self._children):
            if self._stop.is_set():
                if deadline is None:
                    deadline = time.monotonic() + STOP_GRACE_S
                self._signal_stop(signalled, deadline - STOP_GRACE_S)
            if deadline is not None and time.monotonic() > deadline:
                log.error("consumer processes did not stop within %.0f s", STOP_GRACE_S)
                return
            live = [c.conn for c in self._children if not c.finished]
            sentinels = {c.process.sentinel: c for c in self._children if not c.finished}
            for ready in wait(live + list(sentinels), timeout=0.2):
                if ready in sentinels:
                    self._exited(sentinels[ready])
                else:
                    self._answer(by_conn[ready])  # type: ignore[index]

    def _signal_stop(self, signalled: set[int], since: float) -> None:
        """SIGTERM the children not signalled yet (their indexes go in ``signalled``): the
        group's leader alone first, the others once it has finished or LEADER_FIRST_S after
        ``since``. On tansu a leader that leaves after another member has left stays the
        group's leader for good, and every later member waits for its assignment forever
        (streams/broker.py); a leader that leaves first hands the role on."""
        leader = self._leader
        first = (
            leader is not None
            and not self._children[leader].finished
            and time.monotonic() - since < LEADER_FIRST_S
        )
        for c in self._children:
            if c.index in signalled or (first and c.index != leader):
                continue
            signalled.add(c.index)
            if first:
                log.info("stopping consumer process %d, the group's leader, first", c.index)
            if not c.finished and c.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.kill(c.process.pid, signal.SIGTERM)

    def _answer(self, child: _Child) -> None:
        try:
            message = child.conn.recv()
        except (EOFError, OSError):
            self._exited(child)
            return
        except Exception as e:  # noqa: BLE001 - a message that does not unpickle here
            if self._child_error is None:
                self._child_error = RuntimeError(
                    f"consumer process {child.index} sent what cannot be read: {e!r}"
                )
            self.stop()
            with contextlib.suppress(OSError):
                child.conn.send(("err", SinkError(repr(e))))
            return
        self._handle(child, message)

    def _handle(self, child: _Child, message: tuple[Any, ...]) -> None:
        kind, *rest = message
        if kind == "call":
            name, args = rest
            answer = self._call(child, name, args)
            with contextlib.suppress(OSError):  # a child that died meanwhile
                child.conn.send(answer)
        elif kind == "metrics":
            self._figures.latest[child.index] = rest[0]
        elif kind == "done":
            child.finished = True
        elif kind == "died":
            text, error = rest[0]
            child.finished = True
            log.error("consumer process %d failed:\n%s", child.index, text)
            if self._child_error is None:
                self._child_error = error or RuntimeError(
                    f"consumer process {child.index} failed: {text.strip().splitlines()[-1]}"
                )
            self.stop()

    def _call(self, child: _Child, name: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        if name == "on_group":  # who leads (see _signal_stop)
            if args[0].leads:
                self._leader = child.index
            elif self._leader == child.index:
                self._leader = None
        if self._sink_error is not None:
            return "err", SinkError(f"ingest stopped: the sink failed: {self._sink_error!r}")
        try:
            if name == "apply_batch" and not getattr(self.sink, "takes_columns", False):
                batch, next_offsets, source = args
                args = (batch.events(), next_offsets, source)
            fn = getattr(self.sink, name, None)
            if fn is None:  # an optional call the sink does not make
                if name == "on_lost":
                    fn = self.sink.on_revoked
                else:
                    return "ok", ({} if name == "restored" else None)
            result: Any = fn(*args)
            if name == "restored":  # the sink's answer covers every child's partitions
                self._restored.update(result)
                mine = [p for p in self._restored if p in child.partitions]
                result = {p: self._restored.pop(p) for p in mine}
        except BaseException as e:  # noqa: BLE001 - every later call is refused
            self._sink_error = e
            log.error("the sink failed on %s from consumer process %d: %r", name, child.index, e)
            self.stop()
            return "err", _portable(e)
        if name == "on_assigned":
            child.partitions |= set(args[0])
        elif name in ("on_revoked", "on_lost"):
            child.partitions -= set(args[0])
            for p in args[0]:
                self._restored.pop(p, None)
        return "ok", result

    def _exited(self, child: _Child) -> None:
        """The child's process ended or its pipe closed: read what it said before."""
        try:
            while not child.finished and child.conn.poll():
                self._handle(child, child.conn.recv())
        except (EOFError, OSError):
            pass
        if child.finished:
            return
        child.finished = True
        child.process.join(5)
        code = child.process.exitcode
        child.partitions.clear()
        if self._child_error is None and not (self._stop.is_set() and code == 0):
            self._child_error = RuntimeError(
                f"consumer process {child.index} exited with code {code} without a report"
            )
            log.error("%s", self._child_error)
        self.stop()

    def _reap(self) -> None:
        """Wait for the children to exit; kill those that do not."""
        end = time.monotonic() + 10.0
        for c in self._children:
            c.process.join(max(0.0, end - time.monotonic()))
            if c.process.is_alive():
                log.error("consumer process %d did not exit: killing it", c.index)
                c.process.kill()
                c.process.join(5)
            c.conn.close()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a SinkError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any reason it cannot cross
        return SinkError(repr(error))
    return error
