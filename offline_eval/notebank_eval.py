"""``memory-proteus-notebank``: offline evaluation of the memory recommender with NoteBank
replay (SPEC section 5), driven by the same code the service runs.

Per batch of users the scorer replays the service's life of each user: events go through
``model.advance(..., return_kq=True)`` and the engine's archive seam (``RecentEventsHook``
in front of ``NoteBankHook`` over a fresh ``NoteBank``, as ``recmem.server.stack`` builds
it); after each query row r the rank path of a replay request without context is run
(``recmem.ranking.Ranker``, steps 3-4): route the q~ of the user's latest
``server.replay_query_events`` events (r's q~ by default) to the archive, which holds the
notes written from events up to r only; on a COPY of the state after r run the top-R notes'
raw events (chronological, positions continuing after the user's position) and then the
query events again, and read the user vector. A query without notes keeps the plain vector
after r, bit-identical to ``memory-proteus`` (taken from ``model.user_vectors``).

The Ranker has no function that returns user vectors (it scores and keeps the top k), so the
final pass is re-stated here in a few lines (``_replay``), the same concatenation and one
padded ``advance`` per step over the users that got notes.

Batching: the events before each user's first query row run in one padded ``advance`` per
batch of users; from there one step per event position, each step one ``advance`` of the
still-active users' next events (the live states), one archive observe, the routes of the
step's queries, and one ``advance`` of the replays on copies. The live state is never
touched by a replay; ``stats["max_live_drift"]`` records the largest difference between the
live read-out and the plain vector at any query row (float noise only).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender, next_event_ts, padded_batch
from models.sequences import EventSeqs
from models.state import MemoryState
from recmem.archive import NoteBank
from recmem.config import Config
from recmem.ranking import UserEvents
from recmem.server.sources import RecentEventsHook
from recmem.server.stack import NoteBankHook
from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)


def _pad_events(rows: list[UserEvents], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded [B, T] items, actions, ts and lengths [B] of ``rows``."""
    T = max(len(r) for r in rows)
    out = np.zeros((3, len(rows), T), dtype=np.int64)
    lengths = np.zeros(len(rows), dtype=np.int64)
    for b, r in enumerate(rows):
        n = len(r)
        out[0, b, :n], out[1, b, :n], out[2, b, :n], lengths[b] = r.items, r.actions, r.ts_ms, n
    return (*(torch.from_numpy(a).to(device) for a in out), torch.from_numpy(lengths).to(device))


FINAL_PASSES = (
    "service",
    "read_only",
    "query_only",
    "notes_only",
    "read_only_query",
    "read_only_state_gap",
    "read_only_own_pos",
)
"""What runs on the copy for a query that got notes: "service" = the rank path (the notes'
events, then the query events run again: a second write of the latest event);
"read_only" = the notes' events, then a READ-ONLY read of the user's latest event
(``MemoryRecommender.read_only``: no second write; its time gap from its own previous
event, read at the copy's position). Diagnostics that split the effect: "query_only" = the
query events alone (the re-run without the notes), "notes_only" = the notes' events alone
(no re-read), "read_only_query" = the read-only read alone on the live copy (no notes;
equals the plain vector up to float noise, since the rule reads after the write),
"read_only_state_gap" = "read_only" with the time gap measured from the copy's last ts
(the last replayed event) instead of the event's own previous event, "read_only_own_pos" =
"read_only" read at the event's own position (the live one) instead of the copy's."""

READ_ONLY_PASSES = ("read_only", "read_only_query", "read_only_state_gap", "read_only_own_pos")


class NotebankScorer:
    """Scorer (offline_eval.evaluate) of ``model`` with NoteBank replay of R notes
    (``replay_notes``; default ``cfg.archive.replay_notes``) per query. ``final_pass``
    other than "service" is for diagnosis only (see FINAL_PASSES)."""

    def __init__(
        self,
        model: MemoryRecommender,
        cfg: Config,
        vocab: ItemVocab | None = None,
        *,
        replay_notes: int | None = None,
        batch_users: int = 256,
        final_pass: str = "service",
        blend: float = 1.0,
    ) -> None:
        self.model = model
        self._request_ts = np.zeros(0, dtype=np.int64)
        if not 0.0 <= blend <= 1.0:
            raise ValueError(f"blend must be in [0, 1], got {blend}")
        self.blend = blend
        """Weight of the replayed read-out; the rest goes to the stored (no replay) one."""
        self.cfg = cfg
        self.R = cfg.archive.replay_notes if replay_notes is None else replay_notes
        if self.R < 0:
            raise ValueError(f"replay_notes must be >= 0, got {self.R}")
        if final_pass not in FINAL_PASSES:
            raise ValueError(f"final_pass must be one of {FINAL_PASSES}, got {final_pass!r}")
        self.final_pass = final_pass
        self.query_events = max(1, cfg.server.replay_query_events)
        self.vocab = (
            vocab if vocab is not None else ItemVocab([str(i) for i in range(model.n_items)], 1)
        )
        self.batch_users = batch_users
        self.stats: dict[str, float] = {
            "queries": 0,
            "replayed": 0,
            "notes_replayed": 0,
            "max_live_drift": 0.0,
        }

    def item_matrix(self) -> torch.Tensor:
        return self.model.item_matrix()

    def describe(self) -> dict[str, Any]:
        """Settings for the report; "stats" is the live ``self.stats`` dict (queries,
        replayed queries, notes replayed, max_live_drift), so it holds the evaluation's
        counts when the summary is written after the evaluation."""
        return {
            "replay_notes": self.R,
            "replay_query_events": self.query_events,
            "final_pass": self.final_pass,
            "blend": self.blend,
            "archive": dataclasses.asdict(self.cfg.archive),
            "stats": self.stats,
        }

    @torch.no_grad()
    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        rows = np.asarray(query_rows, dtype=np.int64)
        self._request_ts = (
            next_event_ts(seqs, rows) if request_ts is None else np.asarray(request_ts)
        )
        # the plain vectors (memory-proteus)
        result = self.model.user_vectors(seqs, rows, self._request_ts)
        self.stats["queries"] += len(rows)
        if self.R == 0 or len(rows) == 0:
            return result
        was_training = self.model.training
        self.model.eval()
        try:
            user_of = seqs.user_of_event()[rows]
            users = np.unique(user_of)
            for start in range(0, len(users), self.batch_users):
                batch = users[start : start + self.batch_users]
                sel = np.flatnonzero(np.isin(user_of, batch))
                self._run_batch(seqs, batch, sel, rows, user_of, result)
        finally:
            self.model.train(was_training)
        log.debug("notebank replay: %s", self.stats)
        return result

    def _run_batch(
        self,
        seqs: EventSeqs,
        users: np.ndarray,
        sel: np.ndarray,
        rows: np.ndarray,
        user_of: np.ndarray,
        result: torch.Tensor,
    ) -> None:
        """Replayed vectors for the queries ``sel`` (indices into ``rows``) of ``users``."""
        model, device = self.model, result.device
        mem = model.mem_cfg
        bank = NoteBank(self.cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads,
                        seed=self.cfg.train.seed)  # fmt: skip
        hook = RecentEventsHook(NoteBankHook(bank, self.vocab), self.query_events)
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

        state = model.init_state(len(users), device)
        state = self._ingest(hook, uids, seqs, users, first, np.zeros_like(first), state)
        for s in range(int(steps.max())):
            n_act = int((steps > s).sum())
            state = state.index(slice(0, n_act))
            state = self._ingest(
                hook, uids[:n_act], seqs, users[:n_act], np.ones(n_act, np.int64),
                first[:n_act] + s, state,
            )  # fmt: skip
            q_idx = by_step[bounds[s] : bounds[s + 1]]  # this step's queries
            if len(q_idx) == 0:
                continue
            targets = sel[q_idx]
            slots = q_slot[q_idx]
            live = state.index(torch.as_tensor(slots, device=device))
            req = torch.as_tensor(self._request_ts[targets], device=device)
            drift = (self.model.read_user(live, req) - result[targets]).abs()
            self.stats["max_live_drift"] = max(self.stats["max_live_drift"], float(drift.max()))
            ev = rows[targets]  # the query events' rows, for the read-only read
            first_row = seqs.offsets[user_of[targets]]
            prev = np.where(ev > first_row, seqs.ts_ms[np.maximum(ev - 1, 0)], -1)
            latest = (seqs.items[ev], seqs.actions[ev], seqs.ts_ms[ev], prev)
            self._replay(
                hook, bank, [uids[i] for i in slots], slots, targets, state, result, latest
            )

    def _ingest(
        self,
        hook: RecentEventsHook,
        uids: list[str],
        seqs: EventSeqs,
        users: np.ndarray,
        lengths: np.ndarray,
        start: np.ndarray,
        state: MemoryState,
    ) -> MemoryState:
        """What the engine does with new events: advance with (k~, q~), then the archive
        seam observes them (host arrays, positions before the step)."""
        if len(users) == 0 or int(lengths.max()) == 0:
            return state
        items, actions, ts, lens = padded_batch(seqs, users, lengths, state.S.device, start)
        positions = state.pos.cpu().numpy()
        res = self.model.advance(items, actions, ts, lens, state, return_kq=True)
        assert res.kq is not None
        host = [a.cpu().numpy() for a in (items, actions, ts, lens)]
        hook.observe(uids, host[0], host[1], host[2], host[3], res.kq, positions)
        return res.state

    def _replay(
        self,
        hook: RecentEventsHook,
        bank: NoteBank,
        uids: list[str],
        slots: np.ndarray,
        targets: np.ndarray,
        state: MemoryState,
        result: torch.Tensor,
        latest: tuple[np.ndarray, ...],
    ) -> None:
        """Ranker steps 3-4 for these queries: route the stored q~ of the latest events,
        then notes + query events on copies of the live states (or, read-only passes, the
        notes and a read of ``latest`` = items, actions, ts, previous ts of each query's
        event); write the read-outs."""
        read_only = self.final_pass in READ_ONLY_PASSES
        rows: list[UserEvents] = []
        keep: list[int] = []
        asked = [
            (j, uid, hook.recent_queries(uid, self.query_events)) for j, uid in enumerate(uids)
        ]
        asked = [(j, uid, q) for j, uid, q in asked if q is not None]
        routed = bank.route_many([(uid, q, self.R) for _, uid, q in asked])
        for (j, uid, _), notes in zip(asked, routed, strict=True):
            if not notes:
                continue
            parts = [UserEvents(n.items, n.actions, n.ts_ms) for n in notes]
            if self.final_pass in ("query_only", "read_only_query"):
                parts = []
            if self.final_pass not in ("notes_only", *READ_ONLY_PASSES):
                parts.append(hook.recent(uid, self.query_events))
            rows.append(UserEvents.concat(parts))
            keep.append(j)
            self.stats["notes_replayed"] += len(notes)
        if not keep:
            return
        self.stats["replayed"] += len(keep)
        device = result.device
        idx = torch.as_tensor(slots[keep], device=device)
        copy = state.index(idx)  # advanced indexing: new tensors, the live state stays
        live_pos = copy.pos
        vec = copy.h
        if any(len(r) for r in rows):
            items, actions, ts, lengths = _pad_events(rows, device)
            if read_only:  # the read needs the state after the notes
                copy = self.model.advance(items, actions, ts, lengths, copy).state
            else:  # the rank path's read-out-only pass
                vec = self.model.replay_read(items, actions, ts, lengths, copy)
        if read_only:
            it, ac, t, prev = (torch.as_tensor(a[keep], device=device) for a in latest)
            prev_ts = None if self.final_pass == "read_only_state_gap" else prev
            own = live_pos if self.final_pass == "read_only_own_pos" else None
            vec = self.model.read_only(it, ac, t, copy, prev_ts=prev_ts, positions=own)
        if self.blend < 1.0:
            vec = self.blend * vec + (1.0 - self.blend) * state.h[idx]
        req = torch.as_tensor(self._request_ts[targets[keep]], device=device)
        vec = self.model.read_user(state.index(idx), req, mem=vec)
        result[torch.as_tensor(targets[keep], device=device)] = vec.to(result.dtype)
