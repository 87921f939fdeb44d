"""What the rank path reads, over the live engine: state copies (Engine.snapshot), the
user's latest raw events (RecentEventsHook) and routed notes (NoteBank.route).

``RecentEventsHook`` sits in the engine's archive seam (recmem.engine.ArchiveHook) in front
of the NoteBank hook: it keeps each user's last few raw events with the masked queries q~
the engine computed for them. They are the routing query and the "question" re-read after
a replay when a request carries no context (see recmem/ranking.py). The tails travel in
the partition checkpoint next to the notes (keys ``recent.*``), so they survive restarts
like the state they belong to.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from models.memory.proteus import unlocked_blocks
from models.state import MemoryState
from recmem.engine import ArchiveHook, Engine
from recmem.ranking import UserEvents
from recmem.server.servicer import UserInfo

_PREFIX = "recent."


class RecentEventsHook:
    """ArchiveHook that records every user's last ``keep`` events, then delegates.

    With ``defer_inner`` the inner hook's ``observe`` (the NoteBank writing notes: a quarter
    of a CPU engine step) runs in ``settle``, which the engine calls outside its lock: a
    rank call's copy then waits only for the state write and the tails, and may route on
    notes one step old for that moment. The user's counter moves after the tails change and
    again after the notes do, so read-aheads and cached replays are never kept across
    either."""

    def __init__(self, inner: ArchiveHook | None, keep: int, defer_inner: bool = False) -> None:
        if keep < 1:
            raise ValueError("RecentEventsHook keeps at least one event")
        self.inner = inner
        self.keep = keep
        self.defer_inner = defer_inner
        self._pending: list[tuple[tuple[Any, ...], list[str]]] = []
        """Deferred inner ``observe`` calls (``defer_inner``) and the users each touches, run
        by ``settle``."""
        self._tails: dict[str, UserEvents] = {}
        self._queries: dict[str, np.ndarray] = {}
        """user -> q~ [n, L, H, K] of the tail events (float32, host)."""
        self._versions: dict[str, int] = {}
        """user -> the clock when the user's tail or notes last changed (see ``versions``)."""
        self._clock = 0
        self._lock = threading.Lock()

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
        k = self.keep
        rows = [b for b in range(len(user_ids)) if lengths[b] > 0]
        if rows:
            # the q~ of each user's last <= keep new events, moved to the host in one copy
            T = items.shape[1]
            cols = np.arange(T - k, T)[None, :] + (lengths[rows][:, None] - T)
            take = torch.as_tensor(np.clip(cols, 0, None), device=kq[1].device)
            b_idx = torch.as_tensor(rows, device=kq[1].device)[:, None]
            tail_q = kq[1][b_idx, take].detach().to("cpu", torch.float32).numpy()
        with self._lock:
            for j, b in enumerate(rows):
                user, n = user_ids[b], int(lengths[b])
                new = UserEvents(items[b, :n], actions[b, :n], ts_ms[b, :n])
                new_q = tail_q[j, max(0, k - n) :]
                both = UserEvents.concat([self._tails.get(user, UserEvents.empty()), new])
                old_q = self._queries.get(user)
                q = new_q if old_q is None else np.concatenate([old_q, new_q])
                self._tails[user] = UserEvents(
                    both.items[-k:].copy(), both.actions[-k:].copy(), both.ts_ms[-k:].copy()
                )
                self._queries[user] = q[-k:].copy()
        touched = [user_ids[b] for b in rows]
        if self.defer_inner and self.inner is not None:
            self._touch(touched)  # the tails changed
            self._pending.append(
                ((user_ids, items, actions, ts_ms, lengths, kq, positions), touched)
            )
            return
        try:
            if self.inner is not None:
                self.inner.observe(user_ids, items, actions, ts_ms, lengths, kq, positions)
        finally:
            self._touch(touched)

    def settle(self) -> None:
        """Run the deferred inner ``observe`` calls (``defer_inner``), then move the
        counters of their users again."""
        while self._pending:
            args, touched = self._pending.pop(0)
            try:
                if self.inner is not None:
                    self.inner.observe(*args)
                    self.inner.settle()
            finally:
                self._touch(touched)
        if not self.defer_inner and self.inner is not None:
            self.inner.settle()

    def _touch(self, user_ids: Sequence[str]) -> None:
        """Move the users' counters, after their tails and notes changed."""
        with self._lock:
            self._clock += 1
            for user in user_ids:
                self._versions[user] = self._clock

    def versions(self, user_ids: Sequence[str]) -> list[int]:
        """Per user, the clock of the last change to the user's tail or notes (-1: none
        since this hook started). Every change goes through this hook (``observe``,
        ``import_notes``, ``drop``) and moves the counter once the change is complete, so
        a tail and notes read after a counter value are current while it stays put."""
        with self._lock:
            return [self._versions.get(u, -1) for u in user_ids]

    def recent(self, user_id: str, n: int) -> UserEvents:
        with self._lock:
            tail = self._tails.get(user_id)
        if tail is None:
            return UserEvents.empty()
        return UserEvents(tail.items[-n:], tail.actions[-n:], tail.ts_ms[-n:])

    def recent_queries(self, user_id: str, n: int) -> np.ndarray | None:
        """q~ [n', L, H, K] of the events ``recent(user_id, n)`` returns (None if unknown)."""
        with self._lock:
            q = self._queries.get(user_id)
        return None if q is None else q[-n:]

    def export_notes(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        out = dict(self.inner.export_notes(user_ids)) if self.inner is not None else {}
        with self._lock:
            tails = [self._tails.get(u, UserEvents.empty()) for u in user_ids]
            queries = [self._queries.get(u) for u, t in zip(user_ids, tails) if len(t)]
        out[_PREFIX + "lengths"] = np.array([len(t) for t in tails], dtype=np.int64)
        joined = UserEvents.concat(tails)
        out[_PREFIX + "items"] = joined.items
        out[_PREFIX + "actions"] = joined.actions
        out[_PREFIX + "ts_ms"] = joined.ts_ms
        if queries and all(q is not None for q in queries):
            out[_PREFIX + "queries"] = np.concatenate(queries).astype(np.float32)  # type: ignore[arg-type]
        return out

    def import_notes(self, user_ids: list[str], notes: dict[str, np.ndarray] | None) -> None:
        rest = None
        if notes is not None:
            rest = {k: v for k, v in notes.items() if not k.startswith(_PREFIX)}
            lengths = notes.get(_PREFIX + "lengths")
            if lengths is not None:
                if len(lengths) != len(user_ids):
                    raise ValueError(
                        f"checkpoint has recent events of {len(lengths)} users, "
                        f"{len(user_ids)} users restored"
                    )
                ends = np.cumsum(lengths)
                starts = ends - lengths
                queries = notes.get(_PREFIX + "queries")
                if queries is not None and len(queries) != int(ends[-1] if len(ends) else 0):
                    raise ValueError("checkpoint recent.queries do not match recent.lengths")
                with self._lock:
                    for user, s, e in zip(user_ids, starts, ends):
                        if e > s:
                            self._tails[user] = UserEvents(
                                notes[_PREFIX + "items"][s:e].astype(np.int64),
                                notes[_PREFIX + "actions"][s:e].astype(np.int64),
                                notes[_PREFIX + "ts_ms"][s:e].astype(np.int64),
                            )
                            if queries is not None:
                                self._queries[user] = queries[s:e].astype(np.float32)
        try:
            if self.inner is not None:
                self.inner.import_notes(user_ids, rest or None)
        finally:
            self._touch(user_ids)

    def drop(self, user_ids: list[str]) -> None:
        with self._lock:
            for user in user_ids:
                self._tails.pop(user, None)
                self._queries.pop(user, None)
        try:
            if self.inner is not None:
                self.inner.drop(user_ids)
        finally:
            self._touch(user_ids)  # a fresh value, never -1 again (no A-B-A for read-aheads)


class EngineSources:
    """RankSources (recmem.ranking) over an Engine, its NoteBank and the recent-event tails.

    ``lock`` is held around every read of the engine's store; the ingest side must hold the
    same lock around ``Engine.apply`` and partition changes (see recmem/server/serve.py).
    ``bank`` is anything with NoteBank's ``route(user, q, r)`` and ``note_count(user)``.
    """

    def __init__(
        self,
        engine: Engine,
        bank: Any | None,
        recent: RecentEventsHook | None,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.engine = engine
        self.bank = bank
        self.recent = recent
        self.lock: AbstractContextManager[Any] = lock if lock is not None else nullcontext()

    def snapshot(self, user_ids: Sequence[str]) -> MemoryState:
        """``Engine.snapshot`` under the lock: one gather on the engine's device when every
        user is resident on the slab, else a host copy with zeros for unknown users."""
        with self.lock:
            return self.engine.snapshot(user_ids)

    def recent_events(self, user_id: str, n: int) -> UserEvents:
        return self.recent.recent(user_id, n) if self.recent is not None else UserEvents.empty()

    def recent_queries(self, user_id: str, n: int) -> torch.Tensor | None:
        if self.recent is None:
            return None
        q = self.recent.recent_queries(user_id, n)
        return None if q is None else torch.from_numpy(q)

    def versions(self, user_ids: Sequence[str]) -> list[int] | None:
        return self.recent.versions(user_ids) if self.recent is not None else None

    def route(self, user_id: str, queries: torch.Tensor, n_notes: int) -> list[UserEvents]:
        return self.route_many([(user_id, queries, n_notes)])[0]

    def route_many(
        self, requests: Sequence[tuple[str, torch.Tensor, int]]
    ) -> list[list[UserEvents]]:
        if self.bank is None:
            return [[] for _ in requests]
        routed = self.bank.route_many(list(requests))
        return [[UserEvents(n.items, n.actions, n.ts_ms) for n in notes] for notes in routed]

    def inspect(self, user_id: str) -> UserInfo | None:
        """InspectUser's answer: position, Proteus blocks, notes, residence tier."""
        with self.lock:
            if not self.engine.known([user_id])[0]:
                return None
            state = self.engine.snapshot([user_id])
            tier = _tier(self.engine, user_id)
        mem = self.engine.cfg.memory
        pos = int(state.pos[0])
        return UserInfo(
            position=pos,
            last_ts_ms=int(state.last_ts[0]),
            unlocked_blocks=unlocked_blocks(pos, mem.n_blocks, mem.horizon) if pos > 0 else 0,
            total_blocks=mem.n_blocks,
            note_count=self.bank.note_count(user_id) if self.bank is not None else 0,
            resident_tier=tier,
        )


def _tier(engine: Engine, user_id: str) -> str:
    """ "device" | "host" | "disk", read off ``users()`` (slab users first, then host, then
    disk) against ``tier_counts()``, which walks every user but only runs for an inspection
    call."""
    store = engine.store
    counts = store.tier_counts()
    for i, user in enumerate(store.users()):
        if user == user_id:
            if i < counts["device"]:
                return "device"
            return "host" if i < counts["device"] + counts["host"] else "disk"
    return ""
