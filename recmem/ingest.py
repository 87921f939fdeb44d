"""The Kafka adapter of the engine loop, and ``recmem ingest``.

:class:`KafkaIngest` is the :class:`streams.sink.BatchSink` of the consumer: it hands each
batch to the engine loop, and keeps each assigned partition as one checkpoint unit (like a
Kafka Streams task): the states of its users, their notes and latest events and the
partition's next offset are written together, so after a crash the service restores the
newest complete checkpoint, the consumer seeks to its offset, and every event is applied
exactly once. ``recmem ingest`` (``run_ingest``) is ``recmem serve`` without gRPC: the same
builder, the same engine, the same checkpoint contents.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from prometheus_client.core import CounterMetricFamily

from models.state import MemoryState
from recmem.checkpoint import CheckpointStore, PartitionCheckpoint, data_settings
from recmem.config import CheckpointConfig, Config
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.engine.engine import Engine
from recmem.engine.loop import EngineLoop, LoopStopped
from recmem.state_store import UserStateStore
from streams.metrics import IngestMetrics
from streams.sink import Resume, SourceMarks
from streams.validate import ValidEvent

log = logging.getLogger(__name__)

CAPTURE_SLICE_USERS = 1024
"""Users copied per loop iteration while capturing a checkpoint (rank batches run between
slices)."""


@dataclass
class IngestTotals:
    """Running figures of one adapter: batches handed over, checkpoints written."""

    batches: int = 0
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0


@dataclass
class Captured:
    """One partition's checkpoint contents, copied on the loop at a consistent point."""

    partition: int
    users: list[str]
    state: MemoryState
    arrays: dict
    full: bool


def capture(
    engine: Engine, partitions: list[int], full_for: set[int]
) -> Generator[None, None, list[Captured]]:
    """Loop task: copy each partition's users (all of them for a full checkpoint, else
    those changed since the last capture) in slices, yielding between slices."""
    out = []
    for p in partitions:
        changed = engine.dirty_users(p)
        every = engine.users_of(p)
        full = p in full_for or 2 * len(changed) > len(every)
        users = every if full else changed
        states = []
        for start in range(0, len(users), CAPTURE_SLICE_USERS):
            states.append(engine.store.read(users[start : start + CAPTURE_SLICE_USERS]))
            yield
        state = MemoryState.cat(states) if states else engine.store.layout.zeros(0)
        arrays = engine.export_arrays(users)
        engine.clear_dirty(p)
        out.append(Captured(p, users, state, arrays, full))
        yield
    return out


def _install(engine: Engine, partition: int, ckpt: PartitionCheckpoint | None) -> None:
    """Loop task: forget what an earlier ownership left, then adopt the restored users."""
    engine.drop_partition(partition)
    if ckpt is not None:
        engine.adopt(partition, ckpt.user_ids, ckpt.state, ckpt.notes_parts)


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
        self._on_ready = on_ready
        self.assigned: set[int] = set()
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

    # ---- BatchSink ---------------------------------------------------------------------

    def on_assigned(self, partitions: list[int]) -> dict[int, Resume]:
        offsets: dict[int, Resume] = {}
        for p in partitions:
            # read and verified on this thread; the loop only installs
            ckpt = self.checkpoints.restore(p, settings=self.settings)
            self._call(partial(_install, partition=p, ckpt=ckpt))
            if ckpt is None:
                # no checkpoint: the state is empty, so read the partition from its start
                # (never from a committed offset, which would skip events)
                offsets[p] = Resume(0)
                self.source[p] = {}
            else:
                if ckpt.model_version != self.engine.model_version:
                    log.warning(
                        "partition %d: checkpoint written by model %s, continuing with %s",
                        p, ckpt.model_version, self.engine.model_version,
                    )  # fmt: skip
                src = {k: str(v) for k, v in ckpt.source.items()}
                offsets[p] = Resume(
                    ckpt.next_offset, src.get("topic_id", ""), src.get("last_record", "")
                )
                self.source[p] = src
                self.written[p] = ckpt.next_offset
                self._head[p] = (ckpt.path.name, len(ckpt.chain) - 1)
                log.info(
                    "partition %d: restored %d users at offset %d from %s",
                    p, len(ckpt.user_ids), ckpt.next_offset, " + ".join(ckpt.chain),
                )  # fmt: skip
            self.next_offsets[p] = offsets[p].next_offset
            self.assigned.add(p)
        if self._on_ready is not None:
            self._on_ready()
            self._on_ready = None
        return offsets

    def on_revoked(self, partitions: list[int]) -> None:
        self._write([p for p in partitions if p in self.assigned])
        self._forget(partitions)

    def on_lost(self, partitions: list[int]) -> None:
        """Partitions taken away without a clean revoke: another member may own them already,
        so nothing is written; the states are dropped."""
        self._forget(partitions)

    def apply_batch(
        self,
        events: list[ValidEvent],
        next_offsets: dict[int, int],
        source: SourceMarks | None = None,
    ) -> None:
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
        """Start a checkpoint of every assigned partition whose offset moved: the loop copies
        the contents at once; a writer thread writes the files while consumption goes on.
        Returns the offsets whose checkpoints are complete (the consumer commits those)."""
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
        """Wait for a checkpoint being written (raises its error), stop the writer."""
        try:
            self._settle()
        finally:
            self._writer.shutdown(wait=True)

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
        none to build on, every ``full_every``-th time, or when most users changed. The
        loop copies the contents; the files are written on this thread (``wait``) or the
        writer thread (one checkpoint at a time)."""
        self._settle()
        moved = [p for p in partitions if self.written.get(p) != self.next_offsets.get(p)]
        if not moved:
            return
        start = time.perf_counter()
        full_for = {
            p for p in moved if (h := self._head.get(p)) is None or h[1] + 1 >= self.full_every
        }
        offsets = {p: self.next_offsets[p] for p in moved}
        sources = {p: dict(self.source.get(p, {})) for p in moved}
        captured: list[Captured] = self._call(  # type: ignore[assignment]
            partial(capture, partitions=moved, full_for=full_for)
        )
        job = partial(self._write_files, captured, offsets, sources, start)
        if wait:
            job()
        else:
            self._writing = self._writer.submit(job)

    def _write_files(
        self,
        captured: list[Captured],
        offsets: dict[int, int],
        sources: dict[int, dict[str, str]],
        start: float,
    ) -> None:
        for c in captured:
            head = self._head.get(c.partition)
            full = c.full or head is None
            path = self.checkpoints.write(
                c.partition,
                c.users,
                c.state,
                offsets[c.partition],
                model_version=self.engine.model_version,
                settings=self.settings,
                notes=c.arrays,
                parent=None if full or head is None else head[0],
                source=sources[c.partition],
            )
            with self._lock:
                self._head[c.partition] = (path.name, 0 if full or head is None else head[1] + 1)
                self.written[c.partition] = offsets[c.partition]
            self.totals.checkpoints += 1
            log.debug(
                "partition %d: %s checkpoint of %d users at offset %d",
                c.partition, "full" if full else "delta", len(c.users), offsets[c.partition],
            )  # fmt: skip
        self.totals.checkpoint_seconds += time.perf_counter() - start

    def _forget(self, partitions: list[int]) -> None:
        self._settle()
        for p in partitions:
            self._call(partial(_drop, partition=p))
            self.assigned.discard(p)
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
    from streams.consumer import EventConsumer

    built = build_engine(cfg, init_model=init_model)
    ingest = KafkaIngest(built.loop, built.checkpoints(), cfg)
    consumer = EventConsumer(cfg.kafka, ingest)
    store = built.engine.store
    register_gauges(consumer.metrics, built.engine)
    consumer.install_signal_handlers()
    log.info(
        "ingesting %s (group %s) on %s; %d bytes per user state",
        cfg.kafka.topic, cfg.kafka.group_id, store.device, store.bytes_per_user(),
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
