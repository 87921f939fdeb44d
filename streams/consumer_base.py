"""What every events consumer does, whichever Kafka client reads the records: turn records
into validated micro-batches for a :class:`~streams.sink.BatchSink` and bad records into
dead letters, map the group's rebalances to the sink's calls, keep partitions the sink
restores paused until their restore is done, checkpoint and then commit.

:class:`BaseConsumer` holds that logic once; a subclass supplies the client: how to poll,
pause, seek, resume, commit, read lag and write dead letters (kafka-python in
streams/consumer.py, the default; librdkafka through confluent-kafka in
streams/confluent.py). ``streams.clients.make_consumer`` picks one by ``kafka.client``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType

from streams.batch import EventBatch
from streams.columns import decode_records
from streams.config import KafkaConfig
from streams.dead_letters import (
    DeadLetterError,
    DeadLetterRecord,
    dead_letter_record,
    minimal_dead_letter,
)
from streams.group import GroupView, Member
from streams.metrics import IngestMetrics
from streams.positions import PositionError, as_resume, decide, fingerprint, judge, probe
from streams.sink import RESTORING, BatchSink, SourceMarks
from streams.validate import DeadLetter, Limits, ValidEvent, validate_record

log = logging.getLogger(__name__)

LAG_INTERVAL_S = 1.0
"""How often consumer lag is recomputed."""
DLQ_FLUSH_TIMEOUT_S = 30.0
"""Longest wait for dead letters to be acknowledged before the batch is given up."""

RawRecord = tuple[int, bytes | None, bytes | None]
"""(offset, key, value) of one consumed record, whichever client read it."""
Seek = int | str
"""Where a partition resumes: an offset, "earliest" or "latest"."""


def stop_on_signals(stop: Callable[[], None], what: str) -> None:
    """SIGTERM and SIGINT log ``what`` and call ``stop`` (main thread only)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: %s", signum, what)
        stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


class BaseConsumer(ABC):
    """Consumes ``cfg.topic`` in group ``cfg.group_id`` and feeds ``sink``.

    ``metrics``: where figures go (a fresh :class:`IngestMetrics` when None); its HTTP
    endpoint is started on ``cfg.metrics_port`` unless that is 0. ``clock`` gives the
    current time in seconds (the validation time window is measured against it).
    ``member``: what this member publishes to the group, where the client can publish it
    (streams/group.py).
    """

    client_name = ""
    """The ``kafka.client`` value of the subclass."""

    def __init__(
        self,
        cfg: KafkaConfig,
        sink: BatchSink,
        metrics: IngestMetrics | None = None,
        *,
        client_id: str = "recmem-ingest",
        clock: Callable[[], float] = time.time,
        member: Member | None = None,
    ) -> None:
        self.cfg = cfg
        self.member = member or Member()
        self.sink = sink
        self.metrics = metrics if metrics is not None else IngestMetrics()
        self.client_id = client_id
        self.clock = clock
        self.limits = Limits.from_config(cfg)
        self._stop = threading.Event()
        self._failed = False
        self._sink_lock = threading.RLock()
        self._assigned: list[int] = []
        self._last_lag = 0.0
        self._own_endpoint = False
        self._topic_id = ""
        """The broker's id of the topic (from the last assignment's check; "" unknown)."""
        self._position_error: PositionError | None = None
        self._restoring: set[int] = set()
        """Assigned partitions the sink restores in the background (paused until done)."""
        self.view: GroupView | None = None
        """The group as of the latest assignment (generation, partition owners)."""

    # ----------------------------------------------------------------- control
    def stop(self) -> None:
        """Ask :meth:`run` to finish the current batch, checkpoint, commit and return."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def assignment(self) -> list[int]:
        """Partitions this consumer owns now."""
        return list(self._assigned)

    @property
    def restoring(self) -> list[int]:
        """Owned partitions the sink is still restoring (paused)."""
        return sorted(self._restoring)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call :meth:`stop` (main thread only)."""
        stop_on_signals(self.stop, "finishing the current batch, then stopping")

    # --------------------------------------------------------------------- run
    def run(self) -> None:
        """Consume until :meth:`stop`; then checkpoint, commit and leave the group.

        An error from the sink or from the dead-letter producer ends the loop without a
        checkpoint (state may be half-applied); the exception propagates, and a restart
        replays from the last checkpoint."""
        cfg = self.cfg
        # the endpoint is ours to stop only if this run started it
        self._own_endpoint = self.metrics.port == 0 and cfg.metrics_port > 0
        try:
            self.metrics.serve(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
            self._open()
            log.info(
                "consuming %s as group %s (%s, %s)",
                cfg.topic, cfg.group_id, cfg.assignor, self.client_name,
            )  # fmt: skip
            while not self._stop.is_set():
                records = self._poll()
                if records:
                    self._process(records)
                if self._restoring:
                    self._resume_restored()
                with self._sink_lock:
                    due = bool(self._assigned) and self.sink.checkpoint_due()
                if due:
                    self._checkpoint_and_commit()
                self._update_lag()
            self._checkpoint_and_commit()
        except BaseException:
            self._failed = True
            raise
        finally:
            self._close()
            if self._own_endpoint:
                self.metrics.close()
            self._assigned = []
            self.metrics.assigned.set(0)
            log.info("consumer of %s stopped", self.cfg.topic)

    # ------------------------------------------------------------ the client
    @abstractmethod
    def _open(self) -> None:
        """Create the client(s) and subscribe; rebalances then reach ``_on_assigned`` and
        ``_on_revoked``."""

    @abstractmethod
    def _poll(self) -> Mapping[int, Sequence[RawRecord]]:
        """One poll: partition -> its records in offset order (empty when none arrived).
        An offset the log no longer holds goes through ``kafka.on_offset_out_of_range``."""

    @abstractmethod
    def _close(self) -> None:
        """Leave the group (the revoke callback checkpoints) and close the client(s)."""

    @abstractmethod
    def _start(self, seeks: dict[int, Seek], committed: list[int], paused: list[int]) -> None:
        """Start consuming newly assigned partitions: ``seeks`` at their resume points,
        ``committed`` at the group's committed offset (else the earliest), ``paused`` not
        at all until :meth:`_resume` (their position is set then)."""

    @abstractmethod
    def _resume(self, seeks: dict[int, Seek]) -> None:
        """Seek paused partitions to their resume points and resume them."""

    @abstractmethod
    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        """Commit these next offsets to the group (synchronously; errors are logged)."""

    @abstractmethod
    def _lag(self, partitions: list[int]) -> dict[int, int]:
        """Partition -> records behind the end of the log, where known."""

    @abstractmethod
    def _send_and_flush(
        self, records: list[tuple[DeadLetter, DeadLetterRecord]]
    ) -> list[tuple[DeadLetter, BaseException]]:
        """Send each dead letter, flush, and return those that failed with their error."""

    @abstractmethod
    def _too_large(self, error: BaseException) -> bool:
        """Whether a dead letter failed because the producer or broker found it too large."""

    # ------------------------------------------------------------------ batches
    def _process(self, records: Mapping[int, Sequence[RawRecord]]) -> None:
        """Validate a poll's records, write the dead letters, hand the events to the sink:
        as columns (``streams.columns.decode_records``) to a sink that says
        ``takes_columns``, else as a list of ValidEvent."""
        start = time.perf_counter()
        now_ms = int(self.clock() * 1000)
        next_offsets: dict[int, int] = {}
        n = 0
        last_records: dict[int, str] = {}
        for p in sorted(records):
            batch = records[p]
            if not batch:
                continue
            _, last_key, last_value = batch[-1]
            last_records[p] = fingerprint(last_key, last_value)
            n += len(batch)
            next_offsets[p] = batch[-1][0] + 1
        events: list[ValidEvent] | EventBatch
        if getattr(self.sink, "takes_columns", False):
            events, dead = decode_records(self.cfg.topic, records, now_ms, self.limits)
        else:
            events, dead = self._validate(records, now_ms)
        if dead:
            self._send_dead_letters(dead)
        with self._sink_lock:
            self.sink.apply_batch(
                events,  # type: ignore[arg-type]  # a takes_columns sink takes both
                next_offsets,
                SourceMarks(self._topic_id, last_records),
            )
        self.metrics.records.inc(n)
        self.metrics.events.inc(len(events))
        self.metrics.batch_seconds.observe(time.perf_counter() - start)

    def _validate(
        self, records: Mapping[int, Sequence[RawRecord]], now_ms: int
    ) -> tuple[list[ValidEvent], list[DeadLetter]]:
        """Each record through ``validate_record``: the events and the dead letters, in
        partition order, each partition's records in offset order."""
        events: list[ValidEvent] = []
        dead: list[DeadLetter] = []
        topic = self.cfg.topic
        for p in sorted(records):
            for offset, key, value in records[p]:
                out = validate_record(topic, p, offset, key, value, now_ms, self.limits)
                if isinstance(out, ValidEvent):
                    events.append(out)
                else:
                    dead.append(out)
        return events, dead

    def _send_dead_letters(self, dead: list[DeadLetter]) -> None:
        """Send and flush; a dead letter the broker refuses as too large is sent again as
        headers only. Raises DeadLetterError, naming the first record, when the dead-letter
        topic did not take them all."""
        for d in dead:
            log.debug(
                "dead letter %s at %s/%d@%d: %s",
                d.reason,
                d.topic,
                d.partition,
                d.offset,
                d.message,
            )
        failed = self._send_and_flush([(d, dead_letter_record(d)) for d in dead])
        retry = [d for d, e in failed if self._too_large(e)]
        if retry:
            log.warning(
                "%d dead letters refused as too large by %s; written again as headers only",
                len(retry),
                self.cfg.dead_letter_topic,
            )
            failed = [(d, e) for d, e in failed if not self._too_large(e)]
            failed += self._send_and_flush([(d, minimal_dead_letter(d)) for d in retry])
        if failed:
            d, e = failed[0]
            raise DeadLetterError(
                f"{len(failed)} of {len(dead)} dead letters were not written to "
                f"{self.cfg.dead_letter_topic}; the first is record {d.topic}/{d.partition}"
                f"@{d.offset} (reason {d.reason}): {e!r}"
            )
        for d in dead:
            self.metrics.dead_letters.labels(reason=d.reason).inc()
        log.info("%d records sent to %s", len(dead), self.cfg.dead_letter_topic)

    def _checkpoint_and_commit(self) -> None:
        if not self._assigned or not self._open_now():
            return
        start = time.perf_counter()
        with self._sink_lock:
            offsets = self.sink.checkpoint()
        owned = set(self._assigned)
        to_commit = {p: off for p, off in offsets.items() if p in owned}
        if to_commit:
            self._commit_offsets(to_commit)
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - start)

    @abstractmethod
    def _open_now(self) -> bool:
        """Whether the group consumer is open (between ``_open`` and ``_close``)."""

    def _update_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag < LAG_INTERVAL_S or not self._open_now():
            return
        self._last_lag = now
        live = [p for p in self._assigned if p not in self._restoring]
        for p, lag in self._lag(live).items():
            self.metrics.lag.labels(partition=str(p)).set(max(0, lag))

    # --------------------------------------------------------------- rebalance
    def _on_view(self, view: GroupView) -> None:
        """A new generation's view (before its revoke and assign callbacks)."""
        self.view = view
        on_group = getattr(self.sink, "on_group", None)
        if on_group is not None and not self._failed:
            with self._sink_lock:
                on_group(view)

    def _on_revoked(self, partitions: list[int], lost: bool) -> None:
        for p in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(str(p))
        self._restoring -= set(partitions)
        self._assigned = [p for p in self._assigned if p not in partitions]
        self.metrics.assigned.set(len(self._assigned))
        if not partitions or self._failed:
            return
        log.info("partitions %s %s", partitions, "lost" if lost else "revoked")
        with self._sink_lock:
            on_lost = getattr(self.sink, "on_lost", None)
            if lost and on_lost is not None:
                on_lost(partitions)
            else:
                self.sink.on_revoked(partitions)

    def _refusing(self) -> bool:
        """Whether this member was refused by the group (it consumes nothing)."""
        return False

    def _on_assigned(self, partitions: list[int]) -> None:
        self._assigned = sorted(set(self._assigned) | set(partitions))
        self.metrics.assigned.set(len(self._assigned))
        if not partitions or self._failed or self._refusing():
            return
        with self._sink_lock:
            answers = self.sink.on_assigned(partitions)
        later = sorted(p for p, r in answers.items() if r is RESTORING and p in partitions)
        now = [p for p in partitions if p not in later]
        resumes = {p: as_resume(r) for p, r in answers.items() if p in now}
        try:
            # partitions restored in the background are checked when they resume: opening
            # the probe's client here would only hold up this callback (and, through the
            # GIL, the restore threads) while the moved users wait
            seeks = self._checked_seeks(now, resumes) if now else {}
        except PositionError as e:
            self._position_error = e  # a client may wrap what a rebalance callback raises
            raise
        self._start(seeks, [p for p in now if p not in seeks], later)
        self._restoring |= set(later)
        if later:
            log.info("partitions %s assigned; restoring in the background", later)
        if now:
            log.info("partitions %s assigned; resuming from %s", now, seeks)

    def _resume_restored(self) -> None:
        """Seek and resume the partitions whose background restore finished."""
        restored = getattr(self.sink, "restored", None)
        if restored is None or not self._open_now():
            return
        with self._sink_lock:
            done = {p: as_resume(r) for p, r in restored().items() if p in self._restoring}
        if not done:
            return
        seeks = self._checked_seeks(sorted(done), done)
        self._resume(seeks)
        self._restoring -= set(done)
        log.info("partitions %s restored; resuming from %s", sorted(done), seeks)

    def _checked_seeks(self, partitions: Iterable[int], resumes: dict) -> dict[int, Seek]:
        """Partition -> offset, "earliest" or "latest": each checkpoint's resume point after
        the checks of streams/positions.py (and their policies); partitions without one
        are left out (they resume from the group's committed offset, else the earliest)."""
        cfg = self.cfg
        wanted = {p: r.next_offset for p, r in resumes.items() if p in set(partitions)}
        self._topic_id, facts = probe(cfg, {p: n for p, n in wanted.items() if n > 0})
        seeks: dict[int, Seek] = {}
        for p in partitions:
            if p not in wanted:
                continue
            if wanted[p] == 0:
                seeks[p] = "earliest"
                continue
            problem = judge(cfg, p, resumes[p], self._topic_id, facts[p])
            seeks[p] = wanted[p] if problem is None else decide(cfg, problem)
        return seeks

    def _out_of_range(self, partition: int, offset: int | None) -> str:
        """The policy ("earliest" | "latest") for a partition whose next offset the log no
        longer holds; raises PositionError under ``fail``."""
        at = "" if offset is None else f"offset {offset} "
        reason = (
            f"{self.cfg.topic}/{partition}: {at}is no longer in the log "
            "(retention removed records before they were applied)"
        )
        return decide(self.cfg, ("on_offset_out_of_range", reason))
