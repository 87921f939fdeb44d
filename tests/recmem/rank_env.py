"""Shared setup of the rank tests: a small freshly initialised memory model, its vocabulary
and TRAIN popularity, and the real engine + NoteBank (FAISS) built by ``build_engine``,
fed through ``Engine.apply`` as the Kafka ingest path would. The engine loop is not started:
the test thread drives the engine and the Ranker itself (``start_loop`` starts one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.recommender import MemoryRecommender
from recmem.config import Config
from recmem.engine import Engine, EngineLoop
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.ranking import Ranker, UserEvents, train_popularity
from recmem.server import RankServer
from recmem.vocab import ItemVocab
from streams.validate import ValidEvent

N_ITEMS = 60
EVENTS_PER_USER = 40


def small_config(spill_dir: Path) -> Config:
    cfg = Config()
    cfg.memory.n_layers = 2
    cfg.memory.n_heads = 2
    cfg.memory.key_dim = 16
    cfg.memory.value_dim = 16
    cfg.memory.n_blocks = 4
    cfg.memory.horizon = 32
    cfg.model.embed_dim = 32
    cfg.model.n_oov_buckets = 8
    cfg.model.dropout = 0.0
    # the full read-out head: window attention (state kept per user) and request time
    cfg.model.hybrid = "mac"
    cfg.model.window = 8
    cfg.model.request_time = "gap_clock"
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.address_dim = 8
    cfg.state.device_capacity = 4
    cfg.state.host_capacity = 2
    cfg.state.spill_dir = str(spill_dir)
    cfg.server.port = 0
    cfg.kafka.min_ts_ms = 0  # the test histories start at t = 1,000,000 ms
    cfg.kafka.max_past_ms = 0
    cfg.kafka.max_future_ms = 0
    return cfg


@dataclass
class RankEnv:
    cfg: Config
    model: MemoryRecommender
    vocab: ItemVocab
    popularity: np.ndarray
    built: BuiltEngine
    history: dict[str, UserEvents]

    @property
    def engine(self) -> Engine:
        return self.built.engine

    @property
    def ranker(self) -> Ranker:
        return self.built.ranker


def user_events(rng: np.random.Generator, n: int, t0: int = 1_000_000) -> UserEvents:
    items = rng.integers(0, N_ITEMS, n).astype(np.int64)
    actions = rng.integers(0, 6, n).astype(np.int64)
    ts = (t0 + np.cumsum(rng.integers(1, 600_000, n))).astype(np.int64)
    return UserEvents(items, actions, ts)


def make_env(
    spill_dir: Path,
    n_users: int = 6,
    seed: int = 0,
    edit: Callable[[Config], None] | None = None,
    item_categories: np.ndarray | None = None,
) -> RankEnv:
    """``n_users`` users named user0.. with EVENTS_PER_USER events each, ingested in
    micro-batches of 10 events per user; the slab holds 4 users, host memory 2, so some
    states live on disk. ``edit`` changes the configuration before anything is built;
    ``item_categories`` go to the Ranker."""
    torch.manual_seed(seed)
    cfg = small_config(spill_dir)
    if edit is not None:
        edit(cfg)
    vocab = ItemVocab([f"item{i}" for i in range(N_ITEMS)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(N_ITEMS, cfg.model.n_oov_buckets, cfg.memory, cfg.model).eval()
    rng = np.random.default_rng(seed)
    history = {f"user{u}": user_events(rng, EVENTS_PER_USER) for u in range(n_users)}
    popularity = train_popularity(np.concatenate([h.items for h in history.values()]), N_ITEMS)
    built = build_engine(
        cfg, model=model, vocab=vocab, model_version="test-model", popularity=popularity,
        item_categories=item_categories, device="cpu", start=False,
    )  # fmt: skip
    for start in range(0, EVENTS_PER_USER, 10):
        batch = [
            ValidEvent(
                user, f"item{h.items[i]}", int(h.ts_ms[i]), int(h.actions[i]), 1.0, None, 0, i
            )
            for user, h in history.items()
            for i in range(start, start + 10)
        ]
        built.engine.apply(batch)
    return RankEnv(cfg, model, vocab, popularity, built, history)


def start_loop(env: RankEnv, **overrides: object) -> EngineLoop:
    """An engine loop over the env's engine and Ranker (started). While it runs, only it
    may touch the engine; stop it before the test thread does again."""
    s = env.cfg.server
    opts: dict = dict(
        window_ms=s.batch_window_ms, max_batch=s.max_batch, adaptive=s.adaptive_window
    )
    opts.update(overrides)
    return EngineLoop(env.ranker, env.engine, **opts).start()  # type: ignore[arg-type]


def start_server(env: RankEnv, loop: EngineLoop) -> RankServer:
    return RankServer(env.cfg, loop, env.vocab, env.built.model_version).start()


class LoopServer(RankServer):
    """A RankServer over its own engine loop, which ``stop`` stops too."""

    def stop(self, grace: float | None = None) -> None:
        super().stop(grace)
        self.loop.stop()


def loop_server(env: RankEnv, cfg: Config | None = None, ranker: object = None) -> LoopServer:
    """A (not started) server over a started loop of ``env``'s engine and ``ranker``
    (default the env's Ranker; a wrapper with ``rank`` and ``n_items`` will do)."""
    cfg = cfg or env.cfg
    s = cfg.server
    loop = EngineLoop(
        ranker or env.ranker,  # type: ignore[arg-type]
        env.engine,
        window_ms=s.batch_window_ms,
        max_batch=s.max_batch,
        adaptive=s.adaptive_window,
    ).start()
    return LoopServer(cfg, loop, env.vocab, env.built.model_version)
