"""The duplicate-event policy: an event whose key equals that of one of its user's last
``window`` accepted events is dropped before it reaches the memory, and counted.

The key is the producer's ``event_id`` when the event has one, else (item, ts_ms, action)
(the user is implicit: keys are kept per user). Duplicates come from delivery, not from
users: a producer that retries a send whose acknowledgement it lost, a source system
replaying a batch, a record produced twice. Kafka hands them over as different records at
different offsets, so the offsets cannot tell; an exact copy of a recent event can. The
window bounds memory and says what "recent" means: a copy arriving after ``window`` newer
events of the same user is applied again. A crash replay is not affected: events after
the restored checkpoint were never accepted by the restored state, and the keys are part
of that checkpoint (arrays ``seen.*``). Owned by the engine (one thread).

``SeenEvents`` holds each user's keys as one row of a ring [window] int64
(recmem.rows.UserRows) and decides a whole batch with numpy; ``SeenEventsReference`` is
the plain per-event loop it must agree with (tests/recmem/test_seen_tails_fast.py).
Memory per user: 8 * window bytes of keys plus 16 bytes of count and ring position (528
bytes at the default window of 64, where a full deque and set of Python ints took about
5.8 kB), plus the user's dict entry; the table grows by 5/4, so up to a fifth of its
rows may wait unused (on the workload's first 100,000 events: 728 against 1,167 bytes a
user in all, tracemalloc: bench/experiments/seen_tails_micro_cpu.json).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from recmem.rows import UserRows, ragged_arange, ring_cells, row_cells

PREFIX = "seen."
_CELLS = 1 << 20
"""Event x key comparisons per slice of the membership test (bounds its temporaries)."""


def seen_lengths(
    arrays: dict[str, np.ndarray], user_ids: Sequence[str], window: int
) -> np.ndarray | None:
    """A checkpoint's keys per user (``seen.lengths``), checked against the users restored;
    None when it holds none or the policy is off."""
    lengths = arrays.get(PREFIX + "lengths")
    if lengths is None or window == 0:
        return None
    if len(lengths) != len(user_ids):
        raise ValueError(
            f"checkpoint has seen keys of {len(lengths)} users, {len(user_ids)} restored"
        )
    return lengths


class SeenEvents:
    """Each user's last ``window`` accepted event keys (0: the policy is off).

    A user's keys are row r of ``keys`` [rows, window], a ring: ``count[r]`` keys, the
    newest just before slot ``end[r]``; while ``count[r] < window`` they fill slots
    ``0 .. count[r]-1`` (``end[r] == count[r]``). The keys of a row are distinct (a key
    enters only when it is not there)."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError("the duplicate window must be >= 0")
        self.window = window
        self._rows = UserRows()
        if window:
            self._rows.add("keys", (window,), np.int64)
            self._rows.add("count", (), np.int64)
            self._rows.add("end", (), np.int64)
        self.dropped = 0
        """Duplicates dropped so far."""

    def keep(self, user_ids: Sequence[str], keys: np.ndarray) -> np.ndarray:
        """Indices of the events (``user_ids[i]``, ``keys[i]``: streams.batch.event_key) that
        are not duplicates (of the user's recent events or of an earlier one in the batch),
        in order; their keys become the users' recent keys."""
        n = len(user_ids)
        if self.window == 0:
            return np.arange(n)
        if n == 0:
            return np.zeros(0, np.int64)
        W = self.window
        keys = np.asarray(keys, np.int64)
        rows = self._rows.assign(user_ids)
        a = self._rows.arrays
        ring, count, end = a["keys"], a["count"], a["end"]
        # the batch user by user, each user's events in batch order
        by_user = np.argsort(rows, kind="stable")
        r_sorted = rows[by_user]
        starts = np.ones(n, bool)
        starts[1:] = r_sorted[1:] != r_sorted[:-1]
        gstart = np.flatnonzero(starts)
        gsize = np.diff(np.append(gstart, n))
        group = np.cumsum(starts) - 1
        # the first event of each (user, key) of the batch (a user's only event is one)
        first = np.ones(n, bool)
        several = by_user[(gsize > 1)[group]]
        if len(several):
            rs, ks = rows[several], keys[several]
            order = np.lexsort((several, ks, rs))
            again = (rs[order][1:] == rs[order][:-1]) & (ks[order][1:] == ks[order][:-1])
            first[several[order][1:][again]] = False
        # which events' keys the user held before the batch, and how old each is there
        hit, age = self._held(rows, keys, ring, count, end)
        # Taken alone, the rule "new to the user and the first of its key in the batch"
        # decides every event as the loop does until an event whose key the user held is
        # pushed out of the window by the batch's own accepted events before the event
        # (held at age g, after >= window - g accepted ones); batch keys are never pushed
        # out while a user has at most ``window`` events. Other users take the loop.
        accept = first & ~hit
        acc = accept[by_user].astype(np.int64)
        before = np.cumsum(acc) - acc
        before -= before[gstart][group]  # accepted events of the user earlier in the batch
        late = (hit[by_user] & (before >= W - age[by_user])).astype(np.int64)
        slow = (gsize > W) | (np.add.reduceat(late, gstart) > 0)
        kept = np.zeros(n, bool)
        fast = ~slow[group] & (acc > 0)
        sel = by_user[fast]
        r = rows[sel]
        ring[r, (end[r] + before[fast]) % W] = keys[sel]
        kept[sel] = True
        n_acc = np.add.reduceat(acc, gstart)
        g_rows = r_sorted[gstart][~slow]
        count[g_rows] = np.minimum(count[g_rows] + n_acc[~slow], W)
        end[g_rows] = (end[g_rows] + n_acc[~slow]) % W
        for g in np.flatnonzero(slow).tolist():
            events = by_user[gstart[g] : gstart[g] + gsize[g]]
            self._keep_one(int(r_sorted[gstart[g]]), events, keys, kept)
        out = np.flatnonzero(kept)
        self.dropped += n - len(out)
        return out

    def _held(
        self,
        rows: np.ndarray,
        keys: np.ndarray,
        ring: np.ndarray,
        count: np.ndarray,
        end: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per event: whether its user holds its key, and the key's age there (0: newest)."""
        W, n = self.window, len(rows)
        hit = np.zeros(n, bool)
        age = np.zeros(n, np.int64)
        known = np.flatnonzero(count[rows] > 0)
        step = max(1, _CELLS // W)
        slots = np.arange(W)
        for s in range(0, len(known), step):
            ev = known[s : s + step]
            r = rows[ev]
            eq = ring[r] == keys[ev, None]
            some = np.flatnonzero(eq.any(1))  # few: check only these against the counts
            ev, r, eq = ev[some], r[some], eq[some]
            eq &= slots[None, :] < count[r][:, None]  # slots past count hold nothing
            h = eq.any(1)
            hit[ev[h]] = True
            age[ev[h]] = (end[r[h]] - 1 - eq[h].argmax(1)) % W
        return hit, age

    def _ordered(self, row: int) -> np.ndarray:
        """Row ``row``'s keys, oldest first."""
        a = self._rows.arrays
        c, e = int(a["count"][row]), int(a["end"][row])
        return a["keys"][row, (e - c + np.arange(c)) % self.window]

    def _keep_one(self, row: int, events: np.ndarray, keys: np.ndarray, kept: np.ndarray) -> None:
        """The reference loop for one user's ``events`` (indices, in order)."""
        recent = deque(self._ordered(row).tolist())
        known = set(recent)
        for i, k in zip(events.tolist(), keys[events].tolist()):
            if k in known:
                continue
            recent.append(k)
            known.add(k)
            if len(recent) > self.window:
                known.discard(recent.popleft())
            kept[i] = True
        a = self._rows.arrays
        a["keys"][row, : len(recent)] = list(recent)
        a["count"][row] = len(recent)
        a["end"][row] = len(recent) % self.window

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        if self.window == 0:
            return {}
        rows = self._rows.lookup(user_ids)
        a = self._rows.arrays
        lengths = np.zeros(len(user_ids), np.int64)
        known = rows >= 0
        lengths[known] = a["count"][rows[known]]
        return {
            PREFIX + "lengths": lengths,
            PREFIX + "keys": a["keys"][ring_cells(rows, lengths, a["end"], self.window)],
        }

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        self.drop(user_ids)
        lengths = seen_lengths(arrays, user_ids, self.window)
        if lengths is None:
            return
        keys = arrays[PREFIX + "keys"]
        ends = np.cumsum(lengths)
        has = np.flatnonzero(np.asarray(lengths) > 0)
        rows = self._rows.assign([user_ids[i] for i in has.tolist()])
        c = np.minimum(lengths[has], self.window).astype(np.int64)  # the last window keys
        a = self._rows.arrays
        a["keys"][row_cells(rows, c)] = keys[ragged_arange(ends[has] - c, c)]
        a["count"][rows] = c
        a["end"][rows] = c % self.window

    def drop(self, user_ids: Sequence[str]) -> None:
        rows = self._rows.release(user_ids)
        if len(rows):
            self._rows.arrays["count"][rows] = 0
            self._rows.arrays["end"][rows] = 0


class SeenEventsReference:
    """The plain form of :class:`SeenEvents` (a deque and a set per user, one event at a
    time): the fast path must agree with it on every batch, export and load."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError("the duplicate window must be >= 0")
        self.window = window
        self._keys: dict[str, deque[int]] = {}
        self._sets: dict[str, set[int]] = {}
        """The same keys as sets, for the membership test."""
        self.dropped = 0
        """Duplicates dropped so far."""

    def keep(self, user_ids: Sequence[str], keys: np.ndarray) -> np.ndarray:
        if self.window == 0:
            return np.arange(len(user_ids))
        kept = []
        window = self.window
        keys_of, sets = self._keys, self._sets
        for i, (user, k) in enumerate(zip(user_ids, keys.tolist())):
            recent = keys_of.get(user)
            if recent is None:
                recent = keys_of[user] = deque()
                sets[user] = set()
            known = sets[user]
            if k in known:
                self.dropped += 1
                continue
            recent.append(k)
            known.add(k)
            if len(recent) > window:
                known.discard(recent.popleft())
            kept.append(i)
        return np.asarray(kept, dtype=np.int64)

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        if self.window == 0:
            return {}
        keys = [list(self._keys.get(u, ())) for u in user_ids]
        return {
            PREFIX + "lengths": np.array([len(k) for k in keys], dtype=np.int64),
            PREFIX + "keys": np.array([x for k in keys for x in k], dtype=np.int64),
        }

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        self.drop(user_ids)
        lengths = seen_lengths(arrays, user_ids, self.window)
        if lengths is None:
            return
        keys = arrays[PREFIX + "keys"]
        ends = np.cumsum(lengths)
        for user, s, e in zip(user_ids, ends - lengths, ends):
            if e > s:
                kept = [int(x) for x in keys[s:e]][-self.window :]
                self._keys[user] = deque(kept)
                self._sets[user] = set(kept)

    def drop(self, user_ids: Sequence[str]) -> None:
        for user in user_ids:
            self._keys.pop(user, None)
            self._sets.pop(user, None)
