"""``recmem serve``: Kafka consumer + engine + NoteBank + gRPC rank service in one process.

The consumer thread applies micro-batches through the ingest service (recmem/ingest.py)
and the rank worker reads copies of the same engine's states; one lock keeps a rank
snapshot from interleaving with an engine step or a partition change. A stop (SIGTERM,
SIGINT, or ``RecMemService.stop``) reports NOT_SERVING, drains the in-flight rank calls,
then lets the consumer finish its batch, checkpoint, commit and leave the group.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender
from recmem.checkpoint import CheckpointStore
from recmem.config import Config
from recmem.ingest import IngestService, load_or_init_model
from recmem.server.app import RankServer
from recmem.server.metrics import RankMetrics
from recmem.server.stack import RankStack, build_rank_stack, popularity_from_extra
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab
from streams.metrics import IngestMetrics
from streams.validate import ValidEvent

log = logging.getLogger(__name__)


class LockedSink:
    """The ingest service as the consumer's BatchSink. Rebalances run under the stack's
    lock, which the rank path holds while it copies states. A batch does not take it as a
    whole: ``Engine.apply`` holds the same lock (``Engine.lock``) only while it changes the
    store and the archive, so rank calls never wait for the model's step. ``checkpoint``
    does not take it: the consumer thread is the only one that changes the engine, and it is
    busy writing the checkpoint, while a checkpoint only reads the engine
    (``UserStateStore.read`` moves no user between tiers) and the rank path only reads it
    too; so rank calls go on while a checkpoint is copied and written to disk (a full
    checkpoint of a large partition takes seconds). ``on_ready`` runs once, after the first
    assignment's checkpoints are restored."""

    def __init__(
        self,
        inner: IngestService,
        lock: threading.RLock,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.inner = inner
        self.lock = lock
        self._on_ready = on_ready

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        with self.lock:
            offsets = self.inner.on_assigned(partitions)
        if self._on_ready is not None:
            self._on_ready()
            self._on_ready = None
        return offsets

    def on_revoked(self, partitions: list[int]) -> None:
        with self.lock:
            self.inner.on_revoked(partitions)

    def on_lost(self, partitions: list[int]) -> None:
        with self.lock:
            self.inner.on_lost(partitions)

    def apply_batch(self, events: list[ValidEvent], next_offsets: dict[int, int]) -> None:
        self.inner.apply_batch(events, next_offsets)  # Engine.apply locks its changes

    def checkpoint_due(self) -> bool:
        return self.inner.checkpoint_due()

    def checkpoint(self) -> dict[int, int]:
        return self.inner.checkpoint()  # no lock: see the class docstring


def load_serving_model(
    cfg: Config, device: torch.device, init_model: bool
) -> tuple[MemoryRecommender, ItemVocab, str, np.ndarray | None]:
    """The memory model in ``server.model_dir`` (or a fresh one with ``init_model``), its
    vocabulary, version and TRAIN popularity (None when the checkpoint has none). The
    configuration's memory and model sections become the model's own."""
    from recmem.modelstore import MODEL_FILE, adopt_model_config, load_model

    if not (Path(cfg.server.model_dir) / MODEL_FILE).exists():
        model, vocab, version = load_or_init_model(cfg, device, init_model)
        return model, vocab, version, None
    loaded, vocab, model_cfg, extra = load_model(cfg.server.model_dir, device)
    if not isinstance(loaded, MemoryRecommender):
        raise ValueError(f"{cfg.server.model_dir}: the rank service needs a memory model")
    adopt_model_config(cfg, model_cfg)
    popularity = popularity_from_extra(extra, vocab.n_items)
    if popularity is None:
        log.warning("model has no TRAIN popularity: cold-start answers follow catalog order")
    return loaded, vocab, str(extra.get("model_version", "unversioned")), popularity


class RecMemService:
    """The whole service of ``recmem serve`` (``ingest=False``: the gRPC side only, on
    whatever the engine holds, e.g. nothing but cold starts)."""

    def __init__(
        self,
        cfg: Config,
        *,
        init_model: bool = False,
        ingest: bool = True,
        device: str | None = None,
    ) -> None:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.server.torch_threads > 0:
            torch.set_num_threads(cfg.server.torch_threads)
        model, vocab, version, popularity = load_serving_model(cfg, dev, init_model)
        self.cfg = cfg
        self.stack: RankStack = build_rank_stack(cfg, model, vocab, version, popularity, dev)
        # one registry, one endpoint (server.metrics_port) for the rank and ingest figures
        self.metrics = IngestMetrics(prefix="recmem_ingest")
        self.server: RankServer = self.stack.server(cfg, RankMetrics(self.metrics.registry))
        store = self.stack.engine.store
        resident = self.metrics.gauge("users_resident", "User states held, by tier", ["tier"])
        for tier in ("device", "host", "disk"):
            resident.labels(tier=tier).set_function(_tier_count(store, tier))
        self.consumer: Any = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._done = threading.Event()
        if ingest:
            from streams.consumer import EventConsumer

            layout = StateLayout.from_config(cfg.memory, cfg.model)
            checkpoints = CheckpointStore(
                Path(cfg.checkpoint.dir) / cfg.kafka.topic, layout, keep=cfg.checkpoint.keep
            )
            service = IngestService(self.stack.engine, checkpoints, cfg.checkpoint.interval_s)
            self.ingest = service
            kafka = dataclasses.replace(cfg.kafka, metrics_port=0)  # served below instead
            sink = LockedSink(service, self.stack.lock, on_ready=self.server.mark_ready)
            self.consumer = EventConsumer(kafka, sink, metrics=self.metrics)

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> RecMemService:
        # with ingest on, health says SERVING only once the first partitions are restored
        self.server.start(ready=self.consumer is None)
        if self.cfg.server.metrics_port > 0:
            s = self.cfg.server
            self.metrics.serve(s.metrics_port, s.metrics_host, s.metrics_token)
        if self.consumer is not None:
            self._thread = threading.Thread(target=self._consume, name="ingest", daemon=True)
            self._thread.start()
        return self

    def _consume(self) -> None:
        try:
            self.consumer.run()
        except BaseException as e:  # noqa: BLE001 - reported by wait(); the process stops
            log.exception("ingest stopped with an error")
            self.failure = e
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the ingest thread ends (error) or ``stop``; True when it ended."""
        return self._done.wait(timeout)

    def stop(self, grace: float | None = None) -> None:
        self.server.stop(grace)  # None: server.shutdown_grace_s
        if self.consumer is not None:
            self.consumer.stop()
            if self._thread is not None:
                self._thread.join()
        self.stack.engine.store.close()
        self.metrics.close()
        self._done.set()


def _tier_count(store: UserStateStore, tier: str) -> Callable[[], float]:
    return lambda: float(store.tier_counts()[tier])


def run_serve(cfg: Config, *, init_model: bool = False, ingest: bool = True) -> int:
    """Run until SIGTERM/SIGINT (or an ingest error); returns the exit status."""
    service = RecMemService(cfg, init_model=init_model, ingest=ingest).start()

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signum)
        service._done.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    log.info(
        "recmem serve: gRPC on %s:%d, ingest %s",
        cfg.server.host,
        service.port,
        f"from {cfg.kafka.topic}" if ingest else "off",
    )
    service.wait()
    service.stop()
    return 1 if service.failure is not None else 0
