"""The one builder of the engine, used by every entry point (``recmem serve``, ``recmem
ingest``, the demo through serve, the benchmarks, tests): model, state store, NoteBank,
engine, Ranker and the engine loop from one configuration, so they cannot drift apart."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender
from recmem.archive import NoteBank
from recmem.blobstore import S3Settings
from recmem.checkpoint import CheckpointStore, checkpoint_root
from recmem.config import Config
from recmem.engine.engine import Engine
from recmem.engine.loop import EngineLoop
from recmem.ranking import Ranker
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    """What ``build_engine`` made. ``loop`` owns ``engine`` once started; before that (or
    without starting it) one thread may drive ``engine`` and ``ranker`` directly."""

    cfg: Config
    engine: Engine
    ranker: Ranker
    loop: EngineLoop
    vocab: ItemVocab
    model_version: str
    popularity: np.ndarray | None

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def group_id(self) -> str:
        """``kafka.group_id`` with ``{model_version}`` replaced by this model's version."""
        return resolve_group_id(self.cfg.kafka.group_id, self.model_version)

    def checkpoints(self) -> CheckpointStore:
        """The checkpoint store of the configured topic and group
        (``checkpoint.dir``/topic/group, a directory or an s3:// location)."""
        ck = self.cfg.checkpoint
        layout = StateLayout.from_config(self.cfg.memory, self.cfg.model)
        return CheckpointStore(
            checkpoint_root(ck.dir, self.cfg.kafka.topic, self.group_id),
            layout,
            keep=ck.keep,
            s3=S3Settings(ck.s3_endpoint_url, ck.s3_region),
            conditional=ck.conditional_writes,
        )

    def close(self) -> None:
        """Stop the loop (if started) and remove the store's spill files."""
        if self.loop.alive:
            self.loop.stop()
        self.engine.store.close()


def resolve_group_id(group_id: str, model_version: str) -> str:
    """The consumer group of a service: ``{model_version}`` in ``kafka.group_id`` stands for
    the served model's version, so that each model version consumes in a group of its own
    (the rollout path, docs/scaling.md)."""
    return group_id.replace("{model_version}", model_version)


def popularity_from_extra(extra: dict[str, Any], n_items: int) -> np.ndarray | None:
    """TRAIN popularity stored in a model checkpoint's extras (key ``popularity``), checked
    against the catalog size; None when absent."""
    pop = extra.get("popularity")
    if pop is None:
        return None
    arr = np.asarray(pop, dtype=np.float32).reshape(-1)
    if len(arr) != n_items:
        raise ValueError(f"checkpoint popularity has {len(arr)} entries for {n_items} items")
    return arr


def categories_from_extra(extra: dict[str, Any], n_items: int) -> np.ndarray | None:
    """The category key of each item index (key ``item_categories``, written by ``recmem
    train``), for lexical and candidate-aware routing; None when absent."""
    cats = extra.get("item_categories")
    if cats is None:
        return None
    arr = np.asarray(cats, dtype=np.int64).reshape(-1)
    if len(arr) != n_items:
        raise ValueError(f"checkpoint item_categories has {len(arr)} entries for {n_items} items")
    return arr


def load_served_model(
    cfg: Config, device: torch.device, init_model: bool = False
) -> tuple[MemoryRecommender, ItemVocab, str, np.ndarray | None, np.ndarray | None]:
    """The memory model in ``server.model_dir``, its vocabulary, version, TRAIN popularity
    and item categories (each None when it has none). With ``init_model`` and no model there, a freshly
    initialised one (seeded by ``train.seed``, so every process builds the same weights)
    is saved there first; such a model knows no items (every item id maps to a hashed
    out-of-vocabulary bucket): for tests and benchmarks. The configuration's memory and
    model sections become the model's own."""
    from recmem.modelstore import MODEL_FILE, adopt_model_config, load_model, save_model

    model_dir = Path(cfg.server.model_dir)
    if not (model_dir / MODEL_FILE).exists() and init_model:
        torch.manual_seed(cfg.train.seed)
        vocab = ItemVocab(["<no-item>"], cfg.model.n_oov_buckets)
        fresh = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
        save_model(model_dir, fresh, vocab, cfg, {"note": "freshly initialised (--init-model)"})
        log.info("saved a freshly initialised model in %s", model_dir)
    if not (model_dir / MODEL_FILE).exists():
        raise FileNotFoundError(
            f"no trained model at {model_dir / MODEL_FILE} (train one with `recmem train`,"
            " or pass --init-model for a freshly initialised one)"
        )
    loaded, vocab, model_cfg, extra = load_model(model_dir, device)
    if not isinstance(loaded, MemoryRecommender):
        raise ValueError(f"{model_dir}: the service needs a memory model, not a baseline")
    adopt_model_config(cfg, model_cfg)
    popularity = popularity_from_extra(extra, vocab.n_items)
    if popularity is None:
        log.warning("model has no TRAIN popularity: cold-start answers follow catalog order")
    version = str(extra.get("model_version", "unversioned"))
    return loaded, vocab, version, popularity, categories_from_extra(extra, vocab.n_items)


def build_engine(
    cfg: Config,
    *,
    device: torch.device | str | None = None,
    init_model: bool = False,
    model: MemoryRecommender | None = None,
    vocab: ItemVocab | None = None,
    model_version: str = "unversioned",
    popularity: np.ndarray | None = None,
    item_categories: np.ndarray | None = None,
    use_gpu_index: bool | None = None,
    start: bool = True,
) -> BuiltEngine:
    """The engine of ``cfg``: the model in ``server.model_dir`` (or ``model`` and
    ``vocab`` when given), the state store, the NoteBank, the Ranker (replay cache, CUDA
    graphs captured now) and the engine loop (started unless ``start=False``)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.server.torch_threads > 0:
        torch.set_num_threads(cfg.server.torch_threads)
    if model is None:
        model, vocab, model_version, popularity, item_categories = load_served_model(
            cfg, dev, init_model
        )
    elif vocab is None:
        raise ValueError("build_engine: a model needs its vocabulary")
    assert vocab is not None
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    store = UserStateStore(
        layout, cfg.state.device_capacity, cfg.state.host_capacity, cfg.state.spill_dir, dev
    )
    mem = cfg.memory
    bank = NoteBank(
        cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed,
        use_gpu=use_gpu_index, query_dim=model.route_dim,
        route_device=dev if cfg.archive.route_device == "rank" else None,
    )  # fmt: skip
    engine = Engine(model, vocab, store, cfg, bank=bank, model_version=model_version)
    if engine.compiles:
        engine.compile_step()
    s = cfg.server
    ranker = Ranker(
        engine.model,
        engine,
        popularity,
        s.replay_query_events,
        cuda_graphs=s.cuda_graphs,
        max_batch=s.max_batch,
        replay_cache=engine.replay_cache,
        routing=cfg.archive.routing,
        route_candidates=cfg.archive.route_candidates,
        item_categories=item_categories,
    )
    ranker.warm_up()
    loop = EngineLoop(
        ranker,
        engine,
        window_ms=s.batch_window_ms,
        max_batch=s.max_batch,
        adaptive=s.adaptive_window,
    )
    if start:
        loop.start()
    return BuiltEngine(cfg, engine, ranker, loop, vocab, model_version, popularity)
