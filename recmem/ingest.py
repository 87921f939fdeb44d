"""The ingest service: Kafka micro-batches -> the engine, with per-partition checkpoints.

:class:`IngestService` is the :class:`streams.sink.BatchSink` of the consumer. Each assigned
partition is one checkpoint unit (like a Kafka Streams task): the states of its users, their
archive notes and the partition's next offset are written together, so after a crash the
service restores the newest complete checkpoint, the consumer seeks to its offset, and every
event is applied exactly once. ``run_ingest`` is what ``recmem ingest`` runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from models.memory.recurrent import process_flushes_denormals
from models.recommender import MemoryRecommender
from recmem.checkpoint import CheckpointStore
from recmem.config import Config
from recmem.engine import Engine
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab
from streams.metrics import IngestMetrics
from streams.validate import ValidEvent

log = logging.getLogger(__name__)


@dataclass
class IngestTotals:
    """Running figures of one service (events applied, batches, checkpoints written)."""

    events: int = 0
    batches: int = 0
    checkpoints: int = 0
    apply_seconds: float = 0.0
    checkpoint_seconds: float = 0.0


class IngestService:
    """BatchSink: applies batches through ``engine`` and checkpoints per partition."""

    def __init__(
        self,
        engine: Engine,
        checkpoints: CheckpointStore,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        full_every: int = 8,
    ) -> None:
        self.engine = engine
        self.checkpoints = checkpoints
        self.interval_s = interval_s
        self.clock = clock
        self.full_every = full_every
        """Every this many checkpoints of a partition one is full; 0 or 1: always full."""
        self.assigned: set[int] = set()
        self.next_offsets: dict[int, int] = {}
        """Per partition: the offset after the last record applied (state includes it)."""
        self.written: dict[int, int] = {}
        """Per partition: the next offset of its newest checkpoint."""
        self._head: dict[int, tuple[str, int]] = {}
        """Per partition: (name of the checkpoint the state continues, deltas since a full)."""
        self._last_checkpoint = clock()
        self.totals = IngestTotals()

    # ---- BatchSink ---------------------------------------------------------------------

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        offsets = {}
        for p in partitions:
            self.engine.drop_partition(p)  # anything left from an earlier ownership is stale
            ckpt = self.checkpoints.restore(p, config_hash=self.engine.config_hash)
            if ckpt is None:
                # no checkpoint: the state is empty, so read the partition from its start
                # (never from a committed offset, which would skip events)
                offsets[p] = 0
            else:
                if ckpt.model_version != self.engine.model_version:
                    log.warning(
                        "partition %d: checkpoint written by model %s, continuing with %s",
                        p,
                        ckpt.model_version,
                        self.engine.model_version,
                    )
                self.engine.adopt(p, ckpt.user_ids, ckpt.state)
                if self.engine.archive is not None:
                    for users, notes in ckpt.notes_parts:
                        self.engine.archive.import_notes(users, notes)
                offsets[p] = ckpt.next_offset
                self.written[p] = ckpt.next_offset
                self._head[p] = (ckpt.path.name, len(ckpt.chain) - 1)
                log.info(
                    "partition %d: restored %d users at offset %d from %s",
                    p,
                    len(ckpt.user_ids),
                    ckpt.next_offset,
                    " + ".join(ckpt.chain),
                )
            self.next_offsets[p] = offsets[p]
            self.assigned.add(p)
        return offsets

    def on_revoked(self, partitions: list[int]) -> None:
        self._write([p for p in partitions if p in self.assigned])
        self._forget(partitions)

    def on_lost(self, partitions: list[int]) -> None:
        """Partitions taken away without a clean revoke: another member may own them already,
        so nothing is written; the states are dropped."""
        self._forget(partitions)

    def apply_batch(self, events: list[ValidEvent], next_offsets: dict[int, int]) -> None:
        start = time.perf_counter()
        self.engine.apply(events)
        self.next_offsets.update(next_offsets)
        self.totals.events += len(events)
        self.totals.batches += 1
        self.totals.apply_seconds += time.perf_counter() - start

    def checkpoint_due(self) -> bool:
        return self.clock() - self._last_checkpoint >= self.interval_s

    def checkpoint(self) -> dict[int, int]:
        self._write(sorted(self.assigned))
        self._last_checkpoint = self.clock()
        return {p: self.written[p] for p in sorted(self.assigned) if p in self.written}

    # ---- internals ---------------------------------------------------------------------

    def _write(self, partitions: list[int]) -> None:
        """Checkpoint each partition whose offset moved since its last checkpoint: a delta of
        the users changed since the previous checkpoint, or every user (full) when there is
        none to build on, every ``full_every``-th time, or when most users changed."""
        for p in partitions:
            offset = self.next_offsets.get(p)
            if offset is None or self.written.get(p) == offset:
                continue
            start = time.perf_counter()
            head = self._head.get(p)
            changed = self.engine.dirty_users(p)
            full = (
                head is None
                or head[1] + 1 >= self.full_every
                or 2 * len(changed) > len(self.engine.users_of(p))
            )
            if full:
                users, state = self.engine.export_partition(p)
            else:
                users, state = changed, self.engine.store.read(changed)
            notes = None
            if self.engine.archive is not None:
                notes = self.engine.archive.export_notes(users)
            path = self.checkpoints.write(
                p,
                users,
                state,
                offset,
                model_version=self.engine.model_version,
                config_hash=self.engine.config_hash,
                notes=notes,
                parent=None if full or head is None else head[0],
            )
            self.engine.clear_dirty(p)
            self._head[p] = (path.name, 0 if full or head is None else head[1] + 1)
            self.written[p] = offset
            self.totals.checkpoints += 1
            self.totals.checkpoint_seconds += time.perf_counter() - start
            log.debug(
                "partition %d: %s checkpoint of %d users at offset %d",
                p,
                "full" if full else "delta",
                len(users),
                offset,
            )

    def _forget(self, partitions: list[int]) -> None:
        for p in partitions:
            users = self.engine.users_of(p)
            if self.engine.archive is not None:
                self.engine.archive.drop(users)
            self.engine.drop_partition(p)
            self.assigned.discard(p)
            self.next_offsets.pop(p, None)
            self.written.pop(p, None)
            self._head.pop(p, None)


class PipelinedSink:
    """A BatchSink that applies each batch on a worker thread, so that the consumer fetches
    and decodes the next batch while the engine runs this one (the engine's tensor work
    releases the GIL). At most one batch waits while one is applied. Every other call
    (checkpoint, rebalance, stop) first waits until all handed-over batches are applied, so
    a checkpoint still holds exactly the effects of the offsets it writes. An error in the
    worker is raised by the next call. Callers that guard ``Engine.apply`` with a lock of
    their own (the rank server) use the plain :class:`IngestService` instead."""

    def __init__(self, inner: IngestService) -> None:
        self.inner = inner
        self._queue: queue.Queue[tuple[list[ValidEvent], dict[int, int]] | None] = queue.Queue(1)
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="ingest-apply", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        if process_flushes_denormals():
            torch.set_flush_denormal(True)  # before this thread's first parallel operation
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self.inner.apply_batch(*item)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer's thread
                self._error = e
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every handed-over batch is applied; raise the worker's error if any."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"applying a batch failed: {self._error!r}") from self._error

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=60)

    def apply_batch(self, events: list[ValidEvent], next_offsets: dict[int, int]) -> None:
        if self._error is not None:
            self.drain()
        self._queue.put((events, next_offsets))

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        self.drain()
        return self.inner.on_assigned(partitions)

    def on_revoked(self, partitions: list[int]) -> None:
        self.drain()
        self.inner.on_revoked(partitions)

    def on_lost(self, partitions: list[int]) -> None:
        self.drain()
        self.inner.on_lost(partitions)

    def checkpoint_due(self) -> bool:
        return self.inner.checkpoint_due()

    def checkpoint(self) -> dict[int, int]:
        self.drain()
        return self.inner.checkpoint()


# ---- composition ---------------------------------------------------------------------


def load_or_init_model(
    cfg: Config, device: torch.device, init_model: bool
) -> tuple[MemoryRecommender, ItemVocab, str]:
    """The model in ``cfg.server.model_dir``; with ``init_model`` and none there, a freshly
    initialised one (seeded by ``train.seed``, so every process builds the same weights) is
    saved there first. A fresh model knows no items: every item id maps to a hashed
    out-of-vocabulary bucket. The configuration's memory and model sections are replaced by
    the model's own."""
    from recmem.modelstore import MODEL_FILE, adopt_model_config, load_model, save_model

    model_dir = Path(cfg.server.model_dir)
    if not (model_dir / MODEL_FILE).exists():
        if not init_model:
            raise FileNotFoundError(
                f"no trained model at {model_dir / MODEL_FILE} (train one with `recmem train`,"
                " or pass --init-model for a freshly initialised one)"
            )
        torch.manual_seed(cfg.train.seed)
        vocab = ItemVocab(["<no-item>"], cfg.model.n_oov_buckets)
        fresh = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
        save_model(model_dir, fresh, vocab, cfg, {"note": "freshly initialised (--init-model)"})
        log.info("saved a freshly initialised model in %s", model_dir)
    model, vocab, model_cfg, extra = load_model(model_dir, device)
    if not isinstance(model, MemoryRecommender):
        raise ValueError(f"{model_dir}: the ingest service needs a memory model, not a baseline")
    adopt_model_config(cfg, model_cfg)
    return model, vocab, str(extra.get("model_version", "unversioned"))


def build_service(
    cfg: Config, *, init_model: bool = False, device: str | None = None
) -> IngestService:
    """Model, state store, engine, checkpoint store and service from one configuration."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.server.torch_threads > 0:
        torch.set_num_threads(cfg.server.torch_threads)
    model, vocab, version = load_or_init_model(cfg, dev, init_model)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    store = UserStateStore(
        layout, cfg.state.device_capacity, cfg.state.host_capacity, cfg.state.spill_dir, dev
    )
    engine = Engine(model, vocab, store, cfg, model_version=version)
    ckpt_root = Path(cfg.checkpoint.dir) / cfg.kafka.topic
    checkpoints = CheckpointStore(ckpt_root, layout, keep=cfg.checkpoint.keep)
    return IngestService(
        engine, checkpoints, cfg.checkpoint.interval_s, full_every=cfg.checkpoint.full_every
    )


def _tier_count(store: UserStateStore, tier: str) -> float:
    return float(store.tier_counts()[tier])


def register_gauges(metrics: IngestMetrics, store: UserStateStore) -> None:
    """Users resident per tier and bytes per user state, on the consumer's registry."""
    resident = metrics.gauge("users_resident", "User states held, by tier", ["tier"])
    for tier in ("device", "host", "disk"):
        resident.labels(tier=tier).set_function(partial(_tier_count, store, tier))
    per_user = metrics.gauge("bytes_per_user", "Bytes of one user's memory state")
    per_user.set(store.bytes_per_user())


def run_ingest(cfg: Config, *, init_model: bool = False) -> IngestTotals:
    """``recmem ingest``: consume until SIGTERM/SIGINT, then checkpoint, commit and leave."""
    from streams.consumer import EventConsumer

    service = build_service(cfg, init_model=init_model)
    sink = PipelinedSink(service)
    consumer = EventConsumer(cfg.kafka, sink)
    store = service.engine.store
    register_gauges(consumer.metrics, store)
    consumer.install_signal_handlers()
    log.info(
        "ingesting %s (group %s) on %s; %d bytes per user state",
        cfg.kafka.topic,
        cfg.kafka.group_id,
        store.device,
        store.bytes_per_user(),
    )
    try:
        consumer.run()
    finally:
        sink.close()
        store.close()
    t = service.totals
    log.info(
        "stopped: %d events in %d batches, %d checkpoints written",
        t.events,
        t.batches,
        t.checkpoints,
    )
    return t
