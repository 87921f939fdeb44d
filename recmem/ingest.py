"""The Kafka adapter of the engine loop, and ``recmem ingest``.

:class:`KafkaIngest` is the :class:`streams.sink.BatchSink` of the consumer: it hands each
batch to the engine loop, and keeps each assigned partition as one checkpoint unit (like a
Kafka Streams task): the states of its users, their notes and latest events and the
partition's next offset are written together, so after a crash the service restores the
newest complete checkpoint, the consumer seeks to its offset, and every event is applied
exactly once. ``recmem ingest`` (``run_ingest``) is ``recmem serve`` without gRPC: the same
builder, the same engine, the same checkpoint contents.

A partition given to this member is claimed with the member's group generation (the
fence, recmem/checkpoint/fencing.py) and restored by a restore thread, off the consumer's thread
and off the rank path: the consumer keeps the partition paused meanwhile, the engine loop
installs the restored users in slices with rank batches in between, and the partition
serves rank calls only once it is complete (until then they fail with
PartitionUnavailable: UNAVAILABLE with a retry hint, never a cold start). Every checkpoint
carries the generation; one refused because a newer generation claimed the partition
(``Fenced``) makes this member drop the partition.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from prometheus_client.core import CounterMetricFamily

from models.state import MemoryState
from recmem.checkpoint import (
    NO_GENERATION,
    CheckpointStore,
    Fenced,
    PartitionCheckpoint,
    data_settings,
)
from recmem.config import CheckpointConfig, Config
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.engine.engine import Engine
from recmem.engine.loop import EngineLoop, LoopStopped
from recmem.state_store import UserStateStore
from streams.batch import EventBatch
from streams.group import GroupView, Member
from streams.metrics import IngestMetrics
from streams.sink import RESTORING, Restoring, Resume, SourceMarks
from streams.validate import ValidEvent

log = logging.getLogger(__name__)

CAPTURE_SLICE_USERS = 1024
"""Users copied per loop iteration while capturing a checkpoint (rank batches run between
slices)."""


@dataclass
class IngestTotals:
    """Running figures of one adapter: batches handed over, checkpoints written, partitions
    restored (and the bytes read and seconds taken), writes refused by a fence."""

    batches: int = 0
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    restores: int = 0
    restore_seconds: float = 0.0
    restore_bytes: int = 0
    restores_prefetched: int = 0
    """Restores that used a checkpoint read while the member rejoined."""
    fenced: int = 0


@dataclass
class _Restore:
    """One partition being restored by a restore thread."""

    partition: int
    generation: int
    future: Future[PartitionCheckpoint | None] | None = None
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    """When the partition began to serve (its install on the loop done)."""
    prefetched: Future[PartitionCheckpoint | None] | None = None
    """Its checkpoint, read while the member rejoined (``KafkaIngest.on_rebalancing``)."""
    from_prefetch: bool = False
    """Restored from ``prefetched`` (its files not read again)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds of each step: claim, read (read and verify the chain), install (on the
    loop, waiting for it included)."""


@dataclass
class Captured:
    """One partition's checkpoint contents, copied on the loop at a consistent point."""

    partition: int
    users: list[str]
    state: MemoryState
    arrays: dict
    full: bool


def capture(engine: Engine, partition: int, full: bool) -> Generator[None, None, Captured]:
    """Loop task: copy the partition's users (all of them for a full checkpoint, or when
    most changed; else those changed since the last capture) in slices, yielding between
    slices."""
    changed = engine.dirty_users(partition)
    every = engine.users_of(partition)
    full = full or 2 * len(changed) > len(every)
    users = every if full else changed
    state = engine.store.layout.empty(len(users))
    for start in range(0, len(users), CAPTURE_SLICE_USERS):
        engine.store.read_into(users[start : start + CAPTURE_SLICE_USERS], state, start)
        yield
    arrays = engine.export_arrays(users)
    engine.clear_dirty(partition)
    return Captured(partition, users, state, arrays, full)


def _install(
    engine: Engine, partition: int, ckpt: PartitionCheckpoint | None
) -> Generator[None, None, None]:
    """Loop task: forget what an earlier ownership left, adopt the restored users in slices
    (rank batches run in between, and answer this partition's users UNAVAILABLE), then
    serve the partition."""
    engine.drop_partition(partition)
    if ckpt is not None:
        yield from engine.adopt_steps(partition, ckpt.user_ids, ckpt.state, ckpt.notes_parts)
    engine.serving.add(partition)


def _drop(engine: Engine, partition: int) -> None:
    engine.drop_partition(partition)


class KafkaIngest:
    """BatchSink over an engine loop: batches go to the loop; checkpoints per partition."""

    def __init__(
        self,
        loop: EngineLoop,
        checkpoints: CheckpointStore,
        cfg: Config,
        *,
        on_ready: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owner: str = "",
        on_view: Callable[[GroupView], None] | None = None,
    ) -> None:
        if loop.engine is None:
            raise ValueError("KafkaIngest needs a loop with an engine")
        self.loop = loop
        self.engine = loop.engine
        self.checkpoints = checkpoints
        ck: CheckpointConfig = cfg.checkpoint
        self.interval_s = ck.interval_s
        self.full_every = ck.full_every
        """Every this many checkpoints of a partition one is full; 0 or 1: always full."""
        self.settings = data_settings(cfg)
        self.clock = clock
        self.owner = owner
        """Who this member is, recorded with its claims (its rank address)."""
        self._on_ready = on_ready
        self._on_view = on_view
        self.generation = NO_GENERATION
        """The group generation of the latest assignment (what claims and writes carry)."""
        self.assigned: set[int] = set()
        """Partitions restored here and consuming."""
        self._restoring: dict[int, _Restore] = {}
        self._fenced: set[int] = set()
        """Partitions whose checkpoint a newer generation refused (dropped at the next
        sink call)."""
        self._restorer = ThreadPoolExecutor(
            cfg.checkpoint.restore_threads, thread_name_prefix="checkpoint-restore"
        )
        self.prefetch_bytes = int(cfg.checkpoint.prefetch_mb * 1e6)
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-prefetch")
        self._prefetched: dict[int, Future[PartitionCheckpoint | None]] = {}
        """Partition -> its checkpoint being read (or read) during a rejoin."""
        self._prefetch_held = 0
        """Bytes the finished prefetches hold."""
        self._view: GroupView | None = None
        self.next_offsets: dict[int, int] = {}
        """Per partition: the offset after the last record handed to the loop."""
        self.written: dict[int, int] = {}
        """Per partition: the next offset of its newest checkpoint."""
        self.source: dict[int, dict[str, str]] = {}
        """Per partition: what identifies the records behind ``next_offsets`` (the topic's
        id, a fingerprint of the last record), stored with the offset."""
        self.topic = cfg.kafka.topic
        self._head: dict[int, tuple[str, int]] = {}
        """Per partition: (name of the checkpoint the state continues, deltas since a full)."""
        self._last_checkpoint = clock()
        self.totals = IngestTotals()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._writing: Future[None] | None = None
        """The checkpoint being written by the writer thread, if any."""
        self._submit_lock = threading.Lock()
        """Held while a batch is handed to the loop with its offsets, and while a capture
        task is queued with the offsets it records."""

    # ---- BatchSink ---------------------------------------------------------------------

    def on_group(self, view: GroupView) -> None:
        """A new generation: what the next claims and writes carry. A member given no
        partition at all is ready at once (it answers by forwarding)."""
        self.generation = view.generation
        self._view = view
        # keep the prefetches of partitions given to this member (``on_assigned`` takes
        # them); the others went elsewhere
        self._drop_prefetched(
            [p for p in self._prefetched if (o := view.owner(p)) is None or o.address != self.owner]
        )
        if self._on_view is not None:
            self._on_view(view)
        mine = any(m.address == self.owner for m in view.owners.values())
        if self._on_ready is not None and not mine and not self.assigned and not self._restoring:
            self._on_ready()
            self._on_ready = None

    def on_assigned(self, partitions: list[int]) -> dict[int, Resume | int | Restoring]:
        """Claim and restore each partition on a restore thread; the consumer keeps them
        paused until ``restored`` hands out their resume points."""
        self._drop_fenced()
        for p in partitions:
            job = _Restore(p, self.generation, prefetched=self._prefetched.pop(p, None))
            self._restoring[p] = job
            job.future = self._restorer.submit(self._restore, job)
        self._drop_prefetched(list(self._prefetched))
        return dict.fromkeys(partitions, RESTORING)

    def on_rebalancing(self) -> None:
        """The member is rejoining its group (its consumer waits for the join): read the
        newest checkpoints of the partitions it does not own, in partition order, until
        ``checkpoint.prefetch_mb`` are held, so that one the group then gives it restores
        from memory. Nothing is claimed or installed: a prefetched checkpoint is used only
        by that partition's restore, after its claim, if the manifest still names it."""
        view = self._view
        if self.prefetch_bytes <= 0 or view is None or not view.complete:
            return
        for p in range(view.partitions):
            if p in self.assigned or p in self._restoring or p in self._prefetched:
                continue
            self._prefetched[p] = self._prefetcher.submit(self._prefetch, p)

    def _prefetch(self, p: int) -> PartitionCheckpoint | None:
        """Prefetch thread: the partition's newest usable checkpoint, or None (nothing to
        read, over the budget, or any error: its restore reads it again and reports)."""
        with self._lock:
            if self._prefetch_held >= self.prefetch_bytes:
                return None
        try:
            ckpt = self.checkpoints.restore(
                p, settings=self.settings, model_version=self.engine.model_version
            )
        except Exception as e:  # noqa: BLE001 - the restore itself reads again and raises
            log.debug("partition %d: prefetch failed: %s", p, e)
            return None
        if ckpt is not None:
            with self._lock:
                self._prefetch_held += ckpt.bytes_read
        return ckpt

    def _drop_prefetched(self, partitions: list[int]) -> None:
        for p in partitions:
            fut = self._prefetched.pop(p, None)
            if fut is not None and not fut.cancel():
                fut.add_done_callback(self._release_prefetch)  # at once when done

    def _release_prefetch(self, fut: Future[PartitionCheckpoint | None]) -> None:
        ckpt = None if fut.cancelled() or fut.exception() is not None else fut.result()
        if ckpt is not None:
            with self._lock:
                self._prefetch_held = max(0, self._prefetch_held - ckpt.bytes_read)

    def _restore(self, job: _Restore) -> PartitionCheckpoint | None:
        """Restore thread: claim the partition (the fence), read and verify its newest
        checkpoint, have the loop install it."""
        p = job.partition
        t0 = time.monotonic()
        self.checkpoints.claim(p, job.generation, self.owner)
        t1 = time.monotonic()
        prefetched = self._take_prefetched(job)
        ckpt = self.checkpoints.restore(
            p,
            settings=self.settings,
            model_version=self.engine.model_version,
            prefetched=prefetched,
        )
        t2 = time.monotonic()
        job.from_prefetch = prefetched is not None and ckpt is prefetched
        with self._lock:
            if job.cancelled:
                return None
            install = self.loop.run_task(partial(_install, partition=p, ckpt=ckpt))
        install.result()
        job.finished = time.monotonic()
        job.steps = {"claim": t1 - t0, "read": t2 - t1, "install": job.finished - t2}
        return ckpt

    def _take_prefetched(self, job: _Restore) -> PartitionCheckpoint | None:
        """The job's prefetched checkpoint: waited for when its read is under way (it ends
        sooner than a new read), not used when it has not started (cancelled)."""
        fut, job.prefetched = job.prefetched, None
        if fut is None or fut.cancel():
            return None
        try:
            ckpt = fut.result()
        except Exception:  # noqa: BLE001 - _prefetch returns None on errors
            return None
        self._release_prefetch(fut)
        return ckpt

    def restored(self) -> dict[int, Resume]:
        """The partitions whose restore finished since the last call, with where each
        resumes (the checkpoint's offset and source, or 0: read from the start). A
        restore's error ends the run, except a claim refused by a newer generation (this
        member is stale: the partition stays paused until the group takes it away)."""
        self._drop_fenced()
        out: dict[int, Resume] = {}
        for p, job in list(self._restoring.items()):
            if job.future is None or not job.future.done():
                continue
            del self._restoring[p]
            try:
                ckpt = job.future.result()
            except Fenced as e:
                log.warning("partition %d not restored: %s", p, e)
                self.totals.fenced += 1
                continue
            except LoopStopped as e:
                raise RuntimeError(f"the engine stopped: {e}") from e.__cause__ or e
            # the restore's own time (the consumer may ask for it a poll later)
            out[p] = self._adopted(p, ckpt, (job.finished or time.monotonic()) - job.started, job)
        if self._on_ready is not None and out and not self._restoring:
            self._on_ready()
            self._on_ready = None
        return out

    def _adopted(
        self,
        p: int,
        ckpt: PartitionCheckpoint | None,
        seconds: float,
        job: _Restore | None = None,
    ) -> Resume:
        if ckpt is None:
            # no checkpoint: the state is empty, so read the partition from its start
            # (never from a committed offset, which would skip events)
            resume = Resume(0)
            self.source[p] = {}
        else:
            src = {k: str(v) for k, v in ckpt.source.items()}
            resume = Resume(ckpt.next_offset, src.get("topic_id", ""), src.get("last_record", ""))
            self.source[p] = src
            self.written[p] = ckpt.next_offset
            self._head[p] = (ckpt.path.name, len(ckpt.chain) - 1)
            self.totals.restores += 1
            self.totals.restore_seconds += seconds
            self.totals.restore_bytes += ckpt.bytes_read
            split = ", ".join(f"{k} {v:.3f}" for k, v in (job.steps if job else {}).items())
            if job is not None and job.from_prefetch:
                split += ", from the prefetch"
                self.totals.restores_prefetched += 1
            log.info(
                "partition %d: restored %d users at offset %d from %s (generation %d; %s) "
                "in %.2f s",
                p, len(ckpt.user_ids), ckpt.next_offset, " + ".join(ckpt.chain),
                ckpt.generation, split or "-", seconds,
            )  # fmt: skip
        self.next_offsets[p] = resume.next_offset
        self.assigned.add(p)
        return resume

    def restore_now(self, partitions: list[int], timeout_s: float = 60.0) -> dict[int, Resume]:
        """``on_assigned`` and wait for the restores (callers that drive the sink
        themselves: tests, tools)."""
        self.on_assigned(partitions)
        deadline = time.monotonic() + timeout_s
        out: dict[int, Resume] = {}
        while set(partitions) - set(out):
            out.update(self.restored())
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions {partitions} not restored in {timeout_s}s")
            time.sleep(0.005)
        return out

    @property
    def restoring(self) -> list[int]:
        return sorted(self._restoring)

    def on_revoked(self, partitions: list[int]) -> None:
        self._cancel(partitions)
        self._write([p for p in partitions if p in self.assigned])
        self._forget(partitions)

    def on_lost(self, partitions: list[int]) -> None:
        """Partitions taken away without a clean revoke: another member may own them already,
        so nothing is written; the states are dropped."""
        self._cancel(partitions)
        self._forget(partitions)

    def _cancel(self, partitions: list[int]) -> None:
        """Abandon restores of these partitions (one whose install already started is
        dropped after it by ``_forget``'s loop task, in order)."""
        with self._lock:
            for p in partitions:
                job = self._restoring.pop(p, None)
                if job is not None:
                    job.cancelled = True

    def _drop_fenced(self) -> None:
        with self._lock:
            fenced, self._fenced = sorted(self._fenced), set()
        if fenced:
            log.warning("partitions %s: a newer generation owns them; dropped here", fenced)
            self._forget(fenced)

    takes_columns = True
    """``apply_batch`` takes an EventBatch too (consumer processes send columns)."""

    def apply_batch(
        self,
        events: list[ValidEvent] | EventBatch,
        next_offsets: dict[int, int],
        source: SourceMarks | None = None,
    ) -> None:
        self._drop_fenced()
        if any(p not in self.assigned for p in next_offsets):
            # a partition dropped here after a fenced write: not ours to apply
            if isinstance(events, EventBatch):
                mine = np.isin(events.partition, sorted(self.assigned))
                events = events.take(np.nonzero(mine)[0])
            else:
                events = [e for e in events if e.partition in self.assigned]
            next_offsets = {p: o for p, o in next_offsets.items() if p in self.assigned}
        with self._submit_lock:  # a capture's offsets cover exactly the batches before it
            try:
                self.loop.submit_apply(events)
            except LoopStopped as e:
                raise RuntimeError(f"applying a batch failed: {e}") from e.__cause__ or e
            self.next_offsets.update(next_offsets)
            for p in next_offsets:
                marks = source or SourceMarks()
                self.source[p] = {
                    "topic": self.topic,
                    "topic_id": marks.topic_id,
                    "last_record": marks.last_records.get(p, ""),
                }
        self.totals.batches += 1

    def checkpoint_due(self) -> bool:
        return self.clock() - self._last_checkpoint >= self.interval_s

    def checkpoint(self) -> dict[int, int]:
        """Start a checkpoint of every assigned partition whose offset moved: a writer thread
        has the loop copy each partition's contents in turn and writes its files, while
        consumption goes on.
        Returns the offsets whose checkpoints are complete (the consumer commits those)."""
        self._drop_fenced()
        if self._writing is None or self._writing.done():
            self._write(sorted(self.assigned), wait=False)
            self._last_checkpoint = self.clock()
        with self._lock:
            return {p: self.written[p] for p in sorted(self.assigned) if p in self.written}

    def flush(self) -> dict[int, int]:
        """Wait for the checkpoint being written; the offsets of the complete ones."""
        self._settle()
        with self._lock:
            return {p: self.written[p] for p in sorted(self.assigned) if p in self.written}

    def close(self) -> None:
        """Wait for a checkpoint being written (raises its error), stop the writer and the
        restore threads (restores not done are abandoned)."""
        self._cancel(list(self._restoring))
        try:
            self._settle()
        finally:
            self._writer.shutdown(wait=True)
            self._restorer.shutdown(wait=True, cancel_futures=True)
            self._prefetcher.shutdown(wait=True, cancel_futures=True)

    def drain(self) -> None:
        """Wait until every batch handed over is installed (raises if ingest failed)."""
        self._call(lambda engine: None)

    # ---- internals ---------------------------------------------------------------------

    def _call(self, fn: Callable[[Engine], object]) -> object:
        try:
            return self.loop.call(fn)
        except LoopStopped as e:
            raise RuntimeError(f"the engine stopped: {e}") from e.__cause__ or e

    def _settle(self) -> None:
        """Wait for the checkpoint being written, if any; raise what it raised."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _write(self, partitions: list[int], wait: bool = True) -> None:
        """Checkpoint each partition whose offset moved since its last checkpoint: a delta of
        the users changed since the previous checkpoint, or every user (full) when there is
        none to build on, every ``full_every``-th time, or when most users changed. One
        partition at a time, on this thread (``wait``) or the writer thread (one checkpoint
        at a time): the loop copies its contents (a task in ingest order, queued with the
        partition's offset), then its files are written; batches handed over meanwhile are
        applied between one partition's capture and the next."""
        self._settle()
        moved = [p for p in partitions if self.written.get(p) != self.next_offsets.get(p)]
        if not moved:
            return
        job = partial(self._capture_and_write, moved, time.perf_counter())
        if wait:
            job()
        else:
            self._writing = self._writer.submit(job)

    def _capture_and_write(self, moved: list[int], start: float) -> None:
        for p in moved:
            h = self._head.get(p)
            try:
                with self._submit_lock:  # the offset of exactly the batches queued before it
                    offset, source = self.next_offsets[p], dict(self.source.get(p, {}))
                    full = h is None or h[1] + 1 >= self.full_every
                    fut = self.loop.run_task(partial(capture, partition=p, full=full))
                captured: Captured = fut.result()
            except LoopStopped as e:
                raise RuntimeError(f"the engine stopped: {e}") from e.__cause__ or e
            self._write_files(captured, offset, source)
        self.totals.checkpoint_seconds += time.perf_counter() - start

    def _write_files(self, c: Captured, offset: int, source: dict[str, str]) -> None:
        head = self._head.get(c.partition)
        full = c.full or head is None
        try:
            path = self.checkpoints.write(
                c.partition,
                c.users,
                c.state,
                offset,
                model_version=self.engine.model_version,
                settings=self.settings,
                notes=c.arrays,
                parent=None if full or head is None else head[0],
                source=source,
                generation=self.generation,
                owner=self.owner,
            )
        except Fenced as e:
            log.warning("partition %d: checkpoint refused: %s", c.partition, e)
            self.totals.fenced += 1
            with self._lock:
                self._fenced.add(c.partition)
            return
        with self._lock:
            self._head[c.partition] = (path.name, 0 if full or head is None else head[1] + 1)
            self.written[c.partition] = offset
        self.totals.checkpoints += 1
        log.debug(
            "partition %d: %s checkpoint of %d users at offset %d",
            c.partition, "full" if full else "delta", len(c.users), offset,
        )  # fmt: skip

    def _forget(self, partitions: list[int]) -> None:
        self._settle()
        for p in partitions:
            self._call(partial(_drop, partition=p))
            self.assigned.discard(p)
            self._fenced.discard(p)
            self.next_offsets.pop(p, None)
            self.written.pop(p, None)
            self.source.pop(p, None)
            self._head.pop(p, None)


# ---- figures and ``recmem ingest`` -----------------------------------------------------


def _tier_count(store: UserStateStore, tier: str) -> float:
    return float(store.tier_counts()[tier])


class _Duplicates:
    """Prometheus collector: the engine's count of dropped duplicate events."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name, self.engine = name, engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            self.name,
            "Events dropped by the duplicate policy (state.dedupe_window)",
            value=self.engine.seen.dropped,
        )


def register_gauges(metrics: IngestMetrics, engine: Engine) -> None:
    """Users resident per tier, bytes per user state and duplicates dropped, on the
    consumer's registry."""
    store = engine.store
    resident = metrics.gauge("users_resident", "User states held, by tier", ["tier"])
    for tier in ("device", "host", "disk"):
        resident.labels(tier=tier).set_function(partial(_tier_count, store, tier))
    per_user = metrics.gauge("bytes_per_user", "Bytes of one user's memory state")
    per_user.set(store.bytes_per_user())
    metrics.registry.register(_Duplicates(f"{metrics.prefix}_duplicate_events", engine))


def run_ingest(cfg: Config, *, init_model: bool = False) -> tuple[BuiltEngine, IngestTotals]:
    """``recmem ingest``: consume until SIGTERM/SIGINT, then checkpoint, commit and leave."""
    from streams.clients import make_consumer

    built = build_engine(cfg, init_model=init_model)
    ingest = KafkaIngest(built.loop, built.checkpoints(), cfg)
    kafka = dataclasses.replace(cfg.kafka, group_id=built.group_id)
    consumer = make_consumer(kafka, ingest, member=Member(tag=built.model_version))
    store = built.engine.store
    register_gauges(consumer.metrics, built.engine)
    consumer.install_signal_handlers()
    log.info(
        "ingesting %s (group %s) on %s; %d bytes per user state",
        cfg.kafka.topic, kafka.group_id, store.device, store.bytes_per_user(),
    )  # fmt: skip
    try:
        consumer.run()
    finally:
        ingest.close()
        built.close()
    t = ingest.totals
    log.info(
        "stopped: %d events in %d batches, %d checkpoints written",
        built.engine.totals.events, t.batches, t.checkpoints,
    )  # fmt: skip
    return built, t
