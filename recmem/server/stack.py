"""Composition of the rank path over one engine: the engine's archive seam (recent-event
tails in front of the NoteBank), the sources the Ranker reads, the Ranker itself, and the
lock that keeps ingest and rank reads of the state store apart. ``recmem serve`` and the
rank benchmark build the same stack."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender
from recmem.archive import NoteBank
from recmem.config import Config
from recmem.engine import Engine
from recmem.ranking import Ranker
from recmem.server.app import RankServer
from recmem.server.metrics import RankMetrics
from recmem.server.sources import EngineSources, RecentEventsHook
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab


class NoteBankHook:
    """The engine's ArchiveHook (recmem.engine) over a NoteBank: every engine step's events
    and their (k~, q~) go to ``observe_batch``; notes travel in partition checkpoints."""

    def __init__(self, bank: NoteBank, vocab: ItemVocab) -> None:
        self.bank = bank
        self.vocab = vocab

    def _item_id(self, index: int) -> str:
        if index < self.vocab.n_items:
            return self.vocab.item_ids[index]
        return f"<oov:{index - self.vocab.n_items}>"

    def observe(
        self,
        user_ids: list[str],
        items: np.ndarray,
        actions: np.ndarray,
        ts_ms: np.ndarray,
        lengths: np.ndarray,
        kq: tuple[torch.Tensor, torch.Tensor],
        positions: np.ndarray,
    ) -> None:
        T = items.shape[1]
        event_pos = positions[:, None] + np.arange(1, T + 1)[None, :]
        item_ids = [
            [self._item_id(int(i)) for i in items[b, : lengths[b]]] for b in range(len(user_ids))
        ]
        self.bank.observe_batch(
            user_ids, items, item_ids, actions, ts_ms, event_pos, lengths, kq[0], kq[1]
        )

    def settle(self) -> None:
        """Nothing: ``observe`` writes the notes (``RecentEventsHook`` decides when)."""

    def export_notes(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        return self.bank.state_for_users(user_ids)

    def import_notes(self, user_ids: list[str], notes: dict[str, np.ndarray] | None) -> None:
        if notes:
            # validated before anything changes: a bad archive leaves the old notes in place
            self.bank.load_users(notes, replace=user_ids)
        else:
            self.bank.drop_users(user_ids)

    def drop(self, user_ids: list[str]) -> None:
        self.bank.drop_users(user_ids)


@dataclass
class RankStack:
    engine: Engine
    bank: NoteBank
    recent: RecentEventsHook
    sources: EngineSources
    ranker: Ranker
    vocab: ItemVocab
    model_version: str
    lock: threading.RLock

    def server(self, cfg: Config, metrics: RankMetrics | None = None) -> RankServer:
        """A RankServer (not started) over this stack."""
        return RankServer(
            cfg, self.ranker, self.vocab, self.model_version, self.sources.inspect, metrics
        )


def build_rank_stack(
    cfg: Config,
    model: MemoryRecommender,
    vocab: ItemVocab,
    model_version: str,
    popularity: np.ndarray | None,
    device: torch.device | str | None = None,
    use_gpu_index: bool | None = None,
) -> RankStack:
    """Store, NoteBank, engine (archive seam: recent tails -> NoteBank) and Ranker."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    store = UserStateStore(
        layout, cfg.state.device_capacity, cfg.state.host_capacity, cfg.state.spill_dir, dev
    )
    mem = cfg.memory
    bank = NoteBank(
        cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed,
        use_gpu=use_gpu_index,
    )  # fmt: skip
    recent = RecentEventsHook(
        NoteBankHook(bank, vocab), max(1, cfg.server.replay_query_events), defer_inner=True
    )
    engine = Engine(model, vocab, store, cfg, archive=recent, model_version=model_version)
    lock = threading.RLock()
    engine.lock = lock  # apply holds it only while it changes the store and the archive
    sources = EngineSources(engine, bank, recent, lock)
    ranker = Ranker(
        engine.model,
        sources,
        popularity,
        cfg.server.replay_query_events,
        cuda_graphs=cfg.server.cuda_graphs,
        max_batch=cfg.server.max_batch,
        replay_cache=cfg.server.replay_cache_users,
    )
    ranker.warm_up()
    return RankStack(engine, bank, recent, sources, ranker, vocab, model_version, lock)


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
