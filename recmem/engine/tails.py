"""Each user's latest applied events and the masked queries q~ the engine computed for them.

They are a replay request's routing query and the "question" re-read after the notes when
the request carries no context (recmem/ranking.py). They travel in the partition checkpoint
next to the notes (arrays ``recent.*``), so a restarted service routes exactly as before.
Owned by the engine (one thread): no lock.

``RecentEvents`` holds every kept event in a slot of a pool (item, action, ts_ms int64 and
q~ [L, H, K] float32: 24 + 4 * L*H*K bytes, 536 with the default model's 2*2*32) and each
user as a row of ``keep`` slot ids (recmem.rows: UserRows, SlotPool), so that a step is
written with numpy and a user holds slots for its events only, as before; per user 4 *
keep + 24 bytes of slot ids, counts and ring position (56 at keep 8) plus the user's dict
entry, where the per-user arrays and their objects took about 680 bytes (on the workload's
first 100,000 events, 1.4 held events a user: 1,016 against 1,416 bytes a user in all,
tracemalloc: bench/experiments/seen_tails_micro_cpu.json). Both grow by 5/4, so up to a
fifth of the rows and slots may wait unused. ``RecentEventsReference`` is the plain
per-user form it must agree with (tests/recmem/test_seen_tails_fast.py). A user restored
with more than ``keep`` events (a checkpoint written under a larger
``server.replay_query_events``) keeps them in the plain form until its next event, as
before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recmem.ranking import UserEvents
from recmem.rows import (
    SlotPool,
    UserRows,
    positions,
    ragged_arange,
    ring_cells,
    row_cells,
    row_prefixes,
    split_runs,
)

PREFIX = "recent."
_EVENT_FIELDS = ("items", "actions", "ts_ms")


def export_tails(
    tails: list[UserEvents], queries: list[np.ndarray | None]
) -> dict[str, np.ndarray]:
    """The checkpoint arrays (``recent.*``) of users' tails, and the q~ of those with a
    tail (``recent.queries`` only when every one of them has its q~)."""
    out = {PREFIX + "lengths": np.array([len(t) for t in tails], dtype=np.int64)}
    joined = UserEvents.concat(tails)
    out[PREFIX + "items"] = joined.items
    out[PREFIX + "actions"] = joined.actions
    out[PREFIX + "ts_ms"] = joined.ts_ms
    if queries and all(q is not None for q in queries):
        out[PREFIX + "queries"] = np.concatenate(queries).astype(np.float32)  # type: ignore[arg-type]
    return out


def tail_spans(
    arrays: dict[str, np.ndarray], user_ids: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """A checkpoint's tails per user (``recent.lengths``) as (lengths, starts, ends) into
    the flat arrays, and its q~ (None when it has none), checked against the users
    restored; None when the checkpoint holds no tails."""
    lengths = arrays.get(PREFIX + "lengths")
    if lengths is None:
        return None
    if len(lengths) != len(user_ids):
        raise ValueError(
            f"checkpoint has recent events of {len(lengths)} users, {len(user_ids)} users restored"
        )
    lengths = np.asarray(lengths)
    ends = np.cumsum(lengths)
    queries = arrays.get(PREFIX + "queries")
    if queries is not None and len(queries) != int(ends[-1] if len(ends) else 0):
        raise ValueError("checkpoint recent.queries do not match recent.lengths")
    return lengths, ends - lengths, ends, queries


class RecentEvents:
    """The last ``keep`` events of every user with their q~ [n, L, H, K] (float32, host).

    Each held event is a slot of ``_pool`` (item, action, ts_ms, q~); a user is row r of
    ``_rows``: ``slot[r]``, a ring of ``keep`` slot ids whose events are at positions
    ``(end[r] - count[r] + t) % keep``, oldest first, and while ``count[r] < keep`` fill
    positions ``0 .. count[r]-1`` (``end[r] == count[r]``). The last ``qcount[r] <=
    count[r]`` of them have their q~ (fewer only after a restore without
    ``recent.queries``; 0: the user has none). A user holds slots for its events only."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError("RecentEvents keeps at least one event")
        self.keep = keep
        self._rows = UserRows()
        self._rows.add("slot", (keep,), np.int32)
        for name in ("count", "qcount", "end"):
            self._rows.add(name, (), np.int64)
        self._pool = SlotPool()
        for name in _EVENT_FIELDS:
            self._pool.add(name, (), np.int64)
        self._qshape: tuple[int, ...] | None = None
        """q~'s [L, H, K], from the first queries seen (then the pool has ``queries``)."""
        self._long: dict[str, tuple[UserEvents, np.ndarray | None]] = {}
        """Users restored with more than ``keep`` events, in the plain form."""

    def observe(
        self,
        user_ids: list[str],
        items: np.ndarray,
        actions: np.ndarray,
        ts_ms: np.ndarray,
        lengths: np.ndarray,
        q_tilde: torch.Tensor,
        packed: bool = False,
    ) -> None:
        """New events of a step: [B, T] host arrays, ``lengths`` [B], q~ [B, T, L, H, K]
        (``packed``: [N, L, H, K], one row per event, user by user)."""
        k = self.keep
        lengths = np.asarray(lengths)
        b = np.flatnonzero(lengths > 0)
        if not len(b):
            return
        n = lengths[b].astype(np.int64)
        m = np.minimum(n, k)  # only the last keep new events of a user can stay
        src, col = row_cells(b, m, n - m)  # those events, user after user
        # their q~ (only theirs), moved to the host in one copy
        dev = q_tilde.device
        if packed:
            flat = (np.cumsum(lengths) - lengths)[src] + col
            picked = q_tilde[torch.as_tensor(flat, device=dev)]
        else:
            picked = q_tilde[torch.as_tensor(src, device=dev), torch.as_tensor(col, device=dev)]
        q = picked.detach().to("cpu", torch.float32).numpy()
        users = [user_ids[i] for i in b.tolist()]
        if self._long:
            self._settle(users)
        self._ensure_queries(q.shape[1:])
        rows = self._rows.assign(users)
        new = {"items": items[src, col], "actions": actions[src, col], "ts_ms": ts_ms[src, col]}
        new["queries"] = q
        if len(np.unique(rows)) == len(rows):
            self._write(rows, n, new)
        else:  # a user twice in one call: one at a time, in order
            ends = np.cumsum(m)
            for j in range(len(b)):
                s = slice(int(ends[j] - m[j]), int(ends[j]))
                self._write(rows[j : j + 1], n[j : j + 1], {f: v[s] for f, v in new.items()})

    def _write(self, rows: np.ndarray, n: np.ndarray, new: dict[str, np.ndarray]) -> None:
        """Users ``rows`` (distinct) got ``n`` new events each, of which the last
        min(n, keep) are ``new`` (pool fields), user after user."""
        k = self.keep
        a = self._rows.arrays
        count, qcount, end, slot = a["count"], a["qcount"], a["end"], a["slot"]
        m = np.minimum(n, k)
        rep = np.repeat(np.arange(len(rows)), m)
        r, held = rows[rep], count[rows][rep]
        pos = ((end[rows] + n - m)[rep] + positions(m)) % k
        # a position that holds an event gets the new one in its slot, the others new slots
        fresh = (held < k) & (pos >= held)
        ids = slot[r, pos].astype(np.int64)
        ids[fresh] = self._pool.take(int(fresh.sum()))
        slot[r[fresh], pos[fresh]] = ids[fresh]
        self._pool.write(ids, new)
        count[rows] = np.minimum(count[rows] + n, k)
        qcount[rows] = np.minimum(qcount[rows] + n, k)
        end[rows] = (end[rows] + n) % k

    def _ensure_queries(self, shape: tuple[int, ...]) -> None:
        if self._qshape is None:
            self._qshape = tuple(shape)
            self._pool.add("queries", tuple(shape), np.float32)
        elif tuple(shape) != self._qshape:
            raise ValueError(f"recent q~ of shape {tuple(shape)}, kept ones are {self._qshape}")

    def _settle(self, users: list[str]) -> None:
        """Restored users with more than ``keep`` events that have new ones: only their
        last ``keep`` can stay, which the rings hold."""
        k = self.keep
        for user in [u for u in dict.fromkeys(users) if u in self._long]:
            tail, q = self._long.pop(user)
            last = UserEvents(tail.items[-k:], tail.actions[-k:], tail.ts_ms[-k:])
            self._put([user], last, np.array([len(last)]), None if q is None else q[-k:])

    def _put(
        self, users: list[str], events: UserEvents, lengths: np.ndarray, queries: np.ndarray | None
    ) -> None:
        """Install the users' events (``lengths[i]`` <= keep each, user after user, with
        their q~ or none) in fresh rows."""
        rows = self._rows.assign(users)
        c = lengths.astype(np.int64)
        ids = self._pool.take(int(c.sum()))
        a = self._rows.arrays
        a["slot"][row_cells(rows, c)] = ids
        self._pool.write(ids, {f: getattr(events, f) for f in _EVENT_FIELDS})
        if queries is not None:
            self._ensure_queries(queries.shape[1:])
            self._pool.arrays["queries"][ids] = queries
        a["count"][rows] = c
        a["qcount"][rows] = c if queries is not None else 0
        a["end"][rows] = c % self.keep

    def recent(self, user_id: str, n: int) -> UserEvents:
        if user_id in self._long:
            tail = self._long[user_id][0]
            return UserEvents(tail.items[-n:], tail.actions[-n:], tail.ts_ms[-n:])
        row = self._rows.of.get(user_id)
        if row is None:
            return UserEvents.empty()
        ids = self._ids(row, int(self._rows.arrays["count"][row]))
        return UserEvents(*(v[-n:] for v in self._pool.read(ids, _EVENT_FIELDS)))

    def recent_queries(self, user_id: str, n: int) -> np.ndarray | None:
        """q~ [n', L, H, K] of the events ``recent(user_id, n)`` returns (None if unknown)."""
        if user_id in self._long:
            q = self._long[user_id][1]
            return None if q is None else q[-n:]
        row = self._rows.of.get(user_id)
        if row is None or self._rows.arrays["qcount"][row] == 0:
            return None
        ids = self._ids(row, int(self._rows.arrays["qcount"][row]))
        return self._pool.arrays["queries"][ids][-n:]

    def recent_many(self, user_ids: Sequence[str], n: int) -> list[UserEvents]:
        """``recent(u, n)`` for each of ``user_ids`` (repeats allowed), the held users' events
        gathered from the pool at once and split per user (views of one copy)."""
        if n <= 0:  # -0: all of them; the rank step always asks for n >= 1
            return [self.recent(u, n) for u in user_ids]
        rows, take = self._takes(user_ids, n, "count")
        a = self._rows.arrays
        ids = a["slot"][ring_cells(rows, take, a["end"], self.keep)]
        cols = [split_runs(v, take) for v in self._pool.read(ids, _EVENT_FIELDS)]
        out = [UserEvents(it, ac, ts) for it, ac, ts in zip(*cols)]
        if self._long:
            for i, u in enumerate(user_ids):
                if u in self._long:
                    out[i] = self.recent(u, n)
        return out

    def recent_queries_many(self, user_ids: Sequence[str], n: int) -> list[np.ndarray | None]:
        """``recent_queries(u, n)`` for each of ``user_ids`` (repeats allowed), gathered
        from the pool at once and split per user (views of one copy)."""
        if n <= 0 or self._qshape is None:
            return [self.recent_queries(u, n) for u in user_ids]
        rows, take = self._takes(user_ids, n, "qcount")
        a = self._rows.arrays
        ids = a["slot"][ring_cells(rows, take, a["end"], self.keep)]
        parts = split_runs(self._pool.arrays["queries"][ids], take)
        out: list[np.ndarray | None] = [
            q if t else None for q, t in zip(parts, take.tolist(), strict=True)
        ]
        if self._long:
            for i, u in enumerate(user_ids):
                if u in self._long:
                    out[i] = self.recent_queries(u, n)
        return out

    def _takes(self, user_ids: Sequence[str], n: int, held: str) -> tuple[np.ndarray, np.ndarray]:
        """The users' rows (-1: none) and how many of their latest events (``held``:
        ``count`` or ``qcount``) up to ``n`` a read returns (0 without a row)."""
        rows = self._rows.lookup(user_ids)
        take = np.zeros(len(rows), np.int64)
        known = rows >= 0
        take[known] = np.minimum(self._rows.arrays[held][rows[known]], n)
        return rows, take

    def _ids(self, row: int, c: int) -> np.ndarray:
        """Slot ids of row ``row``'s last ``c`` events, oldest first."""
        a = self._rows.arrays
        return a["slot"][row, (int(a["end"][row]) - c + np.arange(c)) % self.keep]

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """The tails of ``user_ids`` as flat arrays (keys ``recent.*``) for a checkpoint."""
        if self._long and any(u in self._long for u in user_ids):
            return self._export_plain(user_ids)
        rows = self._rows.lookup(user_ids)
        a = self._rows.arrays
        known = rows >= 0
        lengths = np.zeros(len(user_ids), np.int64)
        lengths[known] = a["count"][rows[known]]
        qlengths = np.zeros(len(user_ids), np.int64)
        qlengths[known] = a["qcount"][rows[known]]
        out = {PREFIX + "lengths": lengths}
        ids = a["slot"][ring_cells(rows, lengths, a["end"], self.keep)]
        for f in _EVENT_FIELDS:
            out[PREFIX + f] = self._pool.arrays[f][ids]
        tailed = lengths > 0
        if tailed.any() and (qlengths[tailed] > 0).all():
            qids = a["slot"][ring_cells(rows, qlengths, a["end"], self.keep)]
            out[PREFIX + "queries"] = self._pool.arrays["queries"][qids]
        return out

    def _export_plain(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """``export`` user by user (some users are in the plain form)."""
        tails = [self.recent(u, 0) for u in user_ids]  # [-0:]: all of them
        queries = [self.recent_queries(u, 0) for u, t in zip(user_ids, tails) if len(t)]
        return export_tails(tails, queries)

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        """Install the tails ``export`` wrote for ``user_ids`` (arrays without ``recent.*``
        keys: the users have no tails)."""
        self.drop(user_ids)
        spans = tail_spans(arrays, user_ids)
        if spans is None:
            return
        lengths, starts, ends, queries = spans
        cols = {f: arrays[PREFIX + f] for f in _EVENT_FIELDS} if (lengths > 0).any() else {}
        for i in np.flatnonzero(lengths > self.keep).tolist():  # the plain form
            s, e = int(starts[i]), int(ends[i])
            tail = UserEvents(*(cols[f][s:e].astype(np.int64) for f in _EVENT_FIELDS))
            q = None if queries is None else queries[s:e].astype(np.float32)
            self._long[user_ids[i]] = (tail, q)
        short = np.flatnonzero((lengths > 0) & (lengths <= self.keep))
        if not len(short):
            return
        c = lengths[short]
        src = ragged_arange(starts[short], c)
        self._put(
            [user_ids[i] for i in short.tolist()],
            UserEvents(*(cols[f][src].astype(np.int64) for f in _EVENT_FIELDS)),
            c,
            None if queries is None else queries[src].astype(np.float32),
        )

    def drop(self, user_ids: list[str]) -> None:
        if self._long:
            for user in user_ids:
                self._long.pop(user, None)
        rows = self._rows.release(user_ids)
        if len(rows):
            a = self._rows.arrays
            c = a["count"][rows]  # a user's events fill positions 0 .. count-1
            self._pool.give(row_prefixes(a["slot"], rows, c))
            a["count"][rows] = a["qcount"][rows] = a["end"][rows] = 0


class RecentEventsReference:
    """The plain form of :class:`RecentEvents` (arrays per user, a user at a time): the
    fast path must agree with it on every step, export and load."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError("RecentEvents keeps at least one event")
        self.keep = keep
        self._tails: dict[str, UserEvents] = {}
        self._queries: dict[str, np.ndarray] = {}

    def observe(
        self,
        user_ids: list[str],
        items: np.ndarray,
        actions: np.ndarray,
        ts_ms: np.ndarray,
        lengths: np.ndarray,
        q_tilde: torch.Tensor,
        packed: bool = False,
    ) -> None:
        """New events of a step: [B, T] host arrays, ``lengths`` [B], q~ [B, T, L, H, K]
        (``packed``: [N, L, H, K], one row per event, user by user)."""
        k = self.keep
        rows = [b for b in range(len(user_ids)) if lengths[b] > 0]
        if not rows:
            return
        # the q~ of each user's last <= keep new events, moved to the host in one copy
        T = items.shape[1]
        cols = np.arange(T - k, T)[None, :] + (lengths[rows][:, None] - T)
        cols = np.clip(cols, 0, None)
        if packed:
            starts = np.cumsum(lengths) - lengths
            flat = torch.as_tensor(starts[rows][:, None] + cols, device=q_tilde.device)
            picked = q_tilde[flat]
        else:
            take = torch.as_tensor(cols, device=q_tilde.device)
            b_idx = torch.as_tensor(rows, device=q_tilde.device)[:, None]
            picked = q_tilde[b_idx, take]
        tail_q = picked.detach().to("cpu", torch.float32).numpy()
        tails, queries = self._tails, self._queries
        for j, b in enumerate(rows):
            user, n = user_ids[b], int(lengths[b])
            lo = max(0, n - k)  # only the last k new events can stay
            it, ac, ts = items[b, lo:n], actions[b, lo:n], ts_ms[b, lo:n]
            q = tail_q[j, max(0, k - n) :]
            if n < k:  # older events fill the rest (most users: one or two new events)
                old, old_q = tails.get(user), queries.get(user)
                if old is not None:
                    it = np.concatenate([old.items, it])[-k:]
                    ac = np.concatenate([old.actions, ac])[-k:]
                    ts = np.concatenate([old.ts_ms, ts])[-k:]
                if old_q is not None:
                    q = np.concatenate([old_q, q])[-k:]
            tails[user] = UserEvents(
                it.astype(np.int64), ac.astype(np.int64), ts.astype(np.int64)
            )  # copies: nothing keeps the batch's arrays alive
            queries[user] = q.copy()

    def recent(self, user_id: str, n: int) -> UserEvents:
        tail = self._tails.get(user_id)
        if tail is None:
            return UserEvents.empty()
        return UserEvents(tail.items[-n:], tail.actions[-n:], tail.ts_ms[-n:])

    def recent_queries(self, user_id: str, n: int) -> np.ndarray | None:
        """q~ [n', L, H, K] of the events ``recent(user_id, n)`` returns (None if unknown)."""
        q = self._queries.get(user_id)
        return None if q is None else q[-n:]

    def recent_many(self, user_ids: Sequence[str], n: int) -> list[UserEvents]:
        """``recent(u, n)`` for each of ``user_ids``, a user at a time."""
        return [self.recent(u, n) for u in user_ids]

    def recent_queries_many(self, user_ids: Sequence[str], n: int) -> list[np.ndarray | None]:
        """``recent_queries(u, n)`` for each of ``user_ids``, a user at a time."""
        return [self.recent_queries(u, n) for u in user_ids]

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """The tails of ``user_ids`` as flat arrays (keys ``recent.*``) for a checkpoint."""
        tails = [self._tails.get(u, UserEvents.empty()) for u in user_ids]
        queries = [self._queries.get(u) for u, t in zip(user_ids, tails) if len(t)]
        return export_tails(tails, queries)

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        """Install the tails ``export`` wrote for ``user_ids`` (arrays without ``recent.*``
        keys: the users have no tails)."""
        self.drop(user_ids)
        spans = tail_spans(arrays, user_ids)
        if spans is None:
            return
        _, starts, ends, queries = spans
        for user, s, e in zip(user_ids, starts, ends):
            if e > s:
                self._tails[user] = UserEvents(
                    arrays[PREFIX + "items"][s:e].astype(np.int64),
                    arrays[PREFIX + "actions"][s:e].astype(np.int64),
                    arrays[PREFIX + "ts_ms"][s:e].astype(np.int64),
                )
                if queries is not None:
                    self._queries[user] = queries[s:e].astype(np.float32)

    def drop(self, user_ids: list[str]) -> None:
        for user in user_ids:
            self._tails.pop(user, None)
            self._queries.pop(user, None)
