"""``memory-proteus-notebank``: offline evaluation of the memory recommender with NoteBank
replay (SPEC section 5), through the served code paths.

Per batch of users the scorer replays the service's life of each user on a real
``recmem.engine.Engine`` (state store, latest events, NoteBank): the events before each
user's first query row go in as one grouped batch, then one event per user per step, each
step through the engine's ingest path (``Engine.apply_grouped``: the same pieces, model
step, latest events and notes as under ``recmem serve``). After each query row r the rank
step's own vector function, ``Ranker.user_vectors`` (what ``Rank`` scores), is asked for a
replay request without context at the target's timestamp: route the q~ of the user's latest
``server.replay_query_events`` events to the archive, which holds the notes written from
events up to r only; on a copy of the state after r run the top-R notes and the query
events again; read the user vector at the request time. A query without notes gets the
head over the live read-out, as ``Rank`` answers it (equal to ``memory-proteus`` up to float
noise).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender, next_event_ts, padded_batch
from models.sequences import EventSeqs
from recmem.archive import NoteBank
from recmem.config import Config
from recmem.engine import Engine, GroupedBatch
from recmem.ranking import Ranker, RankQuery
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)


class NotebankScorer:
    """Scorer (offline_eval.evaluate) of ``model`` with NoteBank replay of R notes
    (``replay_notes``; default ``cfg.archive.replay_notes``) per query, computed by the
    service's engine and Ranker."""

    def __init__(
        self,
        model: MemoryRecommender,
        cfg: Config,
        vocab: ItemVocab | None = None,
        *,
        replay_notes: int | None = None,
        batch_users: int = 256,
        item_categories: np.ndarray | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.R = cfg.archive.replay_notes if replay_notes is None else replay_notes
        if self.R < 0:
            raise ValueError(f"replay_notes must be >= 0, got {self.R}")
        self.query_events = max(1, cfg.server.replay_query_events)
        self.vocab = (
            vocab if vocab is not None else ItemVocab([str(i) for i in range(model.n_items)], 1)
        )
        self.batch_users = batch_users
        self.item_categories = item_categories
        self.stats: dict[str, float] = {
            "queries": 0,
            "replayed": 0,
            "notes_replayed": 0,
        }

    def item_matrix(self) -> torch.Tensor:
        return self.model.item_matrix()

    def describe(self) -> dict[str, Any]:
        """Settings for the report; "stats" is the live ``self.stats`` dict (queries,
        replayed queries, notes replayed), so it holds the evaluation's counts when the
        summary is written after the evaluation."""
        return {
            "replay_notes": self.R,
            "replay_query_events": self.query_events,
            "routing": self.cfg.archive.routing,
            "replay_fusion": self.model.model_cfg.replay_fusion,
            "archive": dataclasses.asdict(self.cfg.archive),
            "stats": self.stats,
        }

    @torch.no_grad()
    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        rows = np.asarray(query_rows, dtype=np.int64)
        req = next_event_ts(seqs, rows) if request_ts is None else np.asarray(request_ts)
        self.stats["queries"] += len(rows)
        if self.R == 0 or len(rows) == 0:
            return self.model.user_vectors(seqs, rows, req)
        weight = self.model.item_matrix()
        result = torch.zeros(len(rows), self.model.embed_dim, dtype=weight.dtype)
        was_training = self.model.training
        self.model.eval()
        try:
            user_of = seqs.user_of_event()[rows]
            users = np.unique(user_of)
            with tempfile.TemporaryDirectory(prefix="notebank-eval-") as spill:
                for start in range(0, len(users), self.batch_users):
                    batch = users[start : start + self.batch_users]
                    sel = np.flatnonzero(np.isin(user_of, batch))
                    self._run_batch(seqs, batch, sel, rows, user_of, req, result, spill)
        finally:
            self.model.train(was_training)
        log.debug("notebank replay: %s", self.stats)
        return result.to(weight.device)

    def _engine(self, n_users: int, spill: str) -> tuple[Engine, Ranker]:
        """A fresh engine (every user of the batch on its slab) and the rank step over it."""
        cfg = self.cfg
        layout = StateLayout.from_config(cfg.memory, cfg.model)
        device = next(self.model.parameters()).device
        store = UserStateStore(layout, max(1, n_users), 0, spill, device)
        mem = cfg.memory
        bank = NoteBank(
            cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed,
            query_dim=self.model.route_dim,
        )  # fmt: skip
        engine = Engine(self.model, self.vocab, store, cfg, bank=bank)
        ranker = Ranker(
            self.model, engine, None, self.query_events, routing=cfg.archive.routing,
            route_candidates=cfg.archive.route_candidates, item_categories=self.item_categories,
        )  # fmt: skip
        return engine, ranker

    def _run_batch(
        self,
        seqs: EventSeqs,
        users: np.ndarray,
        sel: np.ndarray,
        rows: np.ndarray,
        user_of: np.ndarray,
        request_ts: np.ndarray,
        result: torch.Tensor,
        spill: str,
    ) -> None:
        """Vectors for the queries ``sel`` (indices into ``rows``) of ``users``."""
        engine, ranker = self._engine(len(users), spill)
        pos_in = rows[sel] - seqs.offsets[user_of[sel]]
        slot_of = {int(u): i for i, u in enumerate(users)}
        q_slot = np.array([slot_of[int(u)] for u in user_of[sel]], dtype=np.int64)
        first = np.full(len(users), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, q_slot, pos_in)
        need = np.zeros(len(users), dtype=np.int64)
        np.maximum.at(need, q_slot, pos_in + 1)
        steps = need - first  # events run one at a time, from the first query row on
        # active users first: at step s the live batch is the first n_s of this order
        order = np.argsort(-steps, kind="stable")
        users, first, steps = users[order], first[order], steps[order]
        q_slot = np.argsort(order)[q_slot]
        q_step = pos_in - first[q_slot]
        by_step = np.argsort(q_step, kind="stable")
        bounds = np.searchsorted(q_step[by_step], np.arange(int(steps.max()) + 1))
        uids = [seqs.user_ids[u] for u in users]
        try:
            self._ingest(engine, uids, seqs, users, first, np.zeros_like(first))
            for s in range(int(steps.max())):
                n_act = int((steps > s).sum())
                self._ingest(
                    engine, uids[:n_act], seqs, users[:n_act], np.ones(n_act, np.int64),
                    first[:n_act] + s,
                )  # fmt: skip
                q_idx = by_step[bounds[s] : bounds[s + 1]]  # this step's queries
                if len(q_idx) == 0:
                    continue
                targets = sel[q_idx]
                queries = [
                    RankQuery(uids[b], k=1, replay_notes=self.R, request_ts_ms=int(t))
                    for b, t in zip(q_slot[q_idx], request_ts[targets], strict=True)
                ]
                got = ranker.user_vectors(queries)
                notes = np.array(got.notes_replayed)
                self.stats["replayed"] += int((notes > 0).sum())
                self.stats["notes_replayed"] += int(notes.sum())
                result[torch.as_tensor(targets)] = got.vectors.to("cpu", result.dtype)
        finally:
            engine.store.close()

    @staticmethod
    def _ingest(
        engine: Engine,
        uids: list[str],
        seqs: EventSeqs,
        users: np.ndarray,
        lengths: np.ndarray,
        start: np.ndarray,
    ) -> None:
        """Events ``start[b] .. start[b] + lengths[b]`` of each user through the engine's
        ingest path."""
        keep = lengths > 0
        if not keep.any():
            return
        users, lengths, start = users[keep], lengths[keep], start[keep]
        items, actions, ts, _ = padded_batch(seqs, users, lengths, "cpu", start)
        names = [u for u, k in zip(uids, keep, strict=True) if k]
        engine.apply_grouped(
            GroupedBatch(
                names, [0] * len(names), items.numpy(), actions.numpy(), ts.numpy(), lengths
            )
        )
