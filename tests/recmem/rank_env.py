"""Shared setup of the rank tests: a small freshly initialised memory model, its vocabulary
and TRAIN popularity, and the engine/archive the Ranker reads from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.recommender import MemoryRecommender
from models.state import MemoryState
from recmem.config import Config
from recmem.ranking import Ranker, UserEvents, train_popularity
from recmem.vocab import ItemVocab

N_ITEMS = 60


def small_config() -> Config:
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
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.address_dim = 8
    cfg.server.port = 0
    cfg.kafka.max_past_ms = 0
    cfg.kafka.max_future_ms = 0
    return cfg


@dataclass
class RankEnv:
    cfg: Config
    model: MemoryRecommender
    vocab: ItemVocab
    popularity: np.ndarray
    sources: DictSources
    ranker: Ranker


class DictSources:
    """Placeholder engine + archive until recmem.engine and the NoteBank land."""

    def __init__(self, model: MemoryRecommender) -> None:
        self.model = model
        self.states: dict[str, MemoryState] = {}
        self.events: dict[str, UserEvents] = {}
        self.notes: dict[str, list[UserEvents]] = {}

    @torch.no_grad()
    def ingest(self, user: str, ev: UserEvents) -> None:
        st = self.states.get(user, self.model.init_state(1, "cpu"))
        t = lambda a: torch.as_tensor(a, dtype=torch.int64)[None]  # noqa: E731
        res = self.model.advance(t(ev.items), t(ev.actions), t(ev.ts_ms), t([len(ev)])[0], st)
        self.states[user] = res.state
        self.events[user] = UserEvents.concat([self.events.get(user, UserEvents.empty()), ev])
        self.notes[user] = [
            UserEvents(ev.items[i : i + 3], ev.actions[i : i + 3], ev.ts_ms[i : i + 3])
            for i in range(0, len(ev), 8)
        ]

    def snapshot(self, user_ids: Sequence[str]) -> MemoryState:
        parts = [self.states.get(u, self.model.init_state(1, "cpu")).clone() for u in user_ids]
        return MemoryState(
            torch.cat([p.S for p in parts]),
            None if parts[0].M is None else torch.cat([p.M for p in parts]),  # type: ignore[misc]
            torch.cat([p.pos for p in parts]),
            torch.cat([p.last_ts for p in parts]),
            torch.cat([p.h for p in parts]),
        )

    def recent_events(self, user_id: str, n: int) -> UserEvents:
        ev = self.events.get(user_id, UserEvents.empty())
        return UserEvents(ev.items[-n:], ev.actions[-n:], ev.ts_ms[-n:])

    def route(self, user_id: str, queries: torch.Tensor, n_notes: int) -> list[UserEvents]:
        return self.notes.get(user_id, [])[:n_notes]


def user_events(rng: np.random.Generator, n: int, t0: int = 1_000_000) -> UserEvents:
    items = rng.integers(0, N_ITEMS, n).astype(np.int64)
    actions = rng.integers(0, 6, n).astype(np.int64)
    ts = (t0 + np.cumsum(rng.integers(1, 600_000, n))).astype(np.int64)
    return UserEvents(items, actions, ts)


def make_env(n_users: int = 6, events_per_user: int = 40, seed: int = 0) -> RankEnv:
    torch.manual_seed(seed)
    cfg = small_config()
    vocab = ItemVocab([f"item{i}" for i in range(N_ITEMS)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(N_ITEMS, cfg.model.n_oov_buckets, cfg.memory, cfg.model).eval()
    rng = np.random.default_rng(seed)
    sources = DictSources(model)
    seen = []
    for u in range(n_users):
        ev = user_events(rng, events_per_user)
        sources.ingest(f"user{u}", ev)
        seen.append(ev.items)
    popularity = train_popularity(np.concatenate(seen), N_ITEMS)
    ranker = Ranker(model, sources, popularity, query_events=cfg.server.replay_query_events)
    return RankEnv(cfg, model, vocab, popularity, sources, ranker)
