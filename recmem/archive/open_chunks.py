"""The open chunks of many users in one arena (NoteBank's fast write path; the plain
reference keeps one ``PendingEvents`` per user, recmem/archive/store.py).

Every buffered event occupies one slot of flat event arrays (items, actions, ts_ms,
positions, item ids, unit keys k and addresses u, as PENDING_DTYPE); a user is a row of a
slot table ``slot`` [rows, width] (its events' slots in event order, ``count`` of them)
and of ``last`` (the lifetime position of the user's latest event, -1 before the first).
A user's open chunk never holds ``chunk_events`` events after a write (a full chunk
closes), so width = chunk_events - 1 (wider only after loading a checkpoint written with
a larger chunk). Slots and rows freed are reused; both grow by a quarter (the event arrays
in place, so growing copies nothing and leaves at most a quarter unused). Per user this
costs 4 * width + 12 bytes of table (136 at the default 32 events per chunk) beside its
events, instead of a ``PendingEvents`` of seven arrays and a list per user.
Not thread-safe: the NoteBank calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recmem.archive.store import PENDING_DTYPE, PendingEvents

INT_FIELDS = ("items", "actions", "ts_ms", "positions")


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    # every output position's offset within its run, plus its run's start
    run = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(total, dtype=np.int64) - (ends - lengths)[run]
    return np.asarray(starts, dtype=np.int64)[run] + within


class EventColumns:
    """Events as parallel arrays: the four integer fields [n], ids (object [n] of str),
    k [n, C_ch, K] and u [n, C_ch, d_rho] (PENDING_DTYPE)."""

    __slots__ = ("ints", "ids", "k", "u")

    def __init__(self, ints: np.ndarray, ids: np.ndarray, k: np.ndarray, u: np.ndarray) -> None:
        self.ints = ints  # [n, 4] int64: items, actions, ts_ms, positions
        self.ids = ids
        self.k = k
        self.u = u

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: np.ndarray) -> EventColumns:
        return EventColumns(self.ints[idx], self.ids[idx], self.k[idx], self.u[idx])

    @staticmethod
    def concat(parts: Sequence[EventColumns]) -> EventColumns:
        return EventColumns(
            np.concatenate([p.ints for p in parts]),
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.k for p in parts]),
            np.concatenate([p.u for p in parts]),
        )


class OpenChunks:
    """The open chunks (buffered events) of many users; see the module docstring."""

    def __init__(self, chunk_events: int, n_channels: int, key_dim: int, d_rho: int) -> None:
        self.chunk_events = chunk_events
        self.n_channels, self.key_dim, self.d_rho = n_channels, key_dim, d_rho
        self.row_of: dict[str, int] = {}
        """user -> row; its order is the order users got archive state (``users()``)."""
        self._free_rows: list[int] = []
        self.count = np.zeros(0, dtype=np.int32)
        self.last = np.zeros(0, dtype=np.int64)
        self.slot = np.zeros((0, max(chunk_events - 1, 0)), dtype=np.int32)
        self._ints = np.zeros((0, 4), dtype=np.int64)
        self._ids = np.zeros(0, dtype=object)
        self._k = np.zeros((0, n_channels, key_dim), PENDING_DTYPE)
        self._u = np.zeros((0, n_channels, d_rho), PENDING_DTYPE)
        self._free = np.zeros(0, dtype=np.int32)  # a stack of free slots
        self._n_free = 0

    # ---- rows ---------------------------------------------------------------------------

    def __contains__(self, user_id: str) -> bool:
        return user_id in self.row_of

    def add_users(self, user_ids: Sequence[str]) -> np.ndarray:
        """Rows for new users (distinct, none with a row yet), in order: freed rows first."""
        k = len(user_ids)
        reuse = min(k, len(self._free_rows))
        fresh = len(self.row_of) + len(self._free_rows)  # rows ever handed out
        rows = np.empty(k, dtype=np.int64)
        if reuse:
            rows[:reuse] = self._free_rows[len(self._free_rows) - reuse :][::-1]
            del self._free_rows[len(self._free_rows) - reuse :]
        rows[reuse:] = np.arange(fresh, fresh + k - reuse)
        if k and int(rows.max()) >= len(self.count):
            self._grow_rows(max(len(self.count) * 5 // 4, int(rows.max()) + 1, 1024))
        self.count[rows] = 0
        self.last[rows] = -1
        self.row_of.update(zip(user_ids, rows.tolist()))
        return rows

    def drop_user(self, user_id: str) -> bool:
        row = self.row_of.pop(user_id, None)
        if row is None:
            return False
        self.clear(np.array([row]))
        self._free_rows.append(row)
        return True

    def _grow_rows(self, n: int) -> None:
        old = len(self.count)
        # in place, as the event arrays (``_grow_slots``); the new rows are zeros
        for a in (self.count, self.last, self.slot):
            a.resize((n, *a.shape[1:]), refcheck=False)
        self.last[old:] = -1

    def _widen(self, width: int) -> None:
        if width > self.slot.shape[1]:
            slot = np.zeros((len(self.slot), width), np.int32)
            slot[:, : self.slot.shape[1]] = self.slot
            self.slot = slot

    # ---- events -------------------------------------------------------------------------

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The slots of ``rows``' buffered events, row by row, each in event order."""
        if not len(rows):
            return np.zeros(0, dtype=np.int64)
        cnt = self.count[rows]
        mask = np.arange(self.slot.shape[1])[None, :] < cnt[:, None]
        return self.slot[rows][mask].astype(np.int64)

    def gather(self, rows: np.ndarray) -> EventColumns:
        """The buffered events of ``rows``, row by row (copies)."""
        s = self.slots_of(rows)
        return EventColumns(self._ints[s], self._ids[s], self._k[s], self._u[s])

    def clear(self, rows: np.ndarray) -> None:
        """Empty the chunks of ``rows`` (their slots become free)."""
        s = self.slots_of(rows)
        self._push_free(s)
        self.count[rows] = 0

    def _push_free(self, s: np.ndarray) -> None:
        self._free[self._n_free : self._n_free + len(s)] = s
        self._n_free += len(s)
        # the events' ids are dropped with their slots (the strings are not kept alive)
        self._ids[s] = None

    def append(self, rows: np.ndarray, lengths: np.ndarray, ev: EventColumns) -> None:
        """Append ``ev`` (row by row: ``lengths[i]`` events for ``rows[i]``, distinct rows)
        after each row's buffered events. The caller keeps counts within the width."""
        n = len(ev)
        if n == 0:
            return
        lengths = np.asarray(lengths, dtype=np.int64)
        cnt = self.count[rows].astype(np.int64)
        need = int((cnt + lengths).max())
        self._widen(need)
        if n > self._n_free:
            self._grow_slots(max(len(self._ids) * 5 // 4, n - self._n_free + len(self._ids), 4096))
        s = self._free[self._n_free - n : self._n_free].astype(np.int64)
        self._n_free -= n
        self._ints[s] = ev.ints
        self._ids[s] = ev.ids
        self._k[s] = ev.k
        self._u[s] = ev.u
        row_e = np.repeat(rows, lengths)
        col_e = ragged_arange(cnt, lengths)
        self.slot[row_e, col_e] = s
        self.count[rows] = cnt + lengths

    def _grow_slots(self, n: int) -> None:
        old = len(self._ids)
        # in place (realloc: a large block is remapped, not copied); nothing holds a view
        # of these arrays (every read of them is a gather, a copy)
        for a in (self._ints, self._k, self._u):
            a.resize((n, *a.shape[1:]), refcheck=False)
        ids = np.empty(n, dtype=object)
        ids[:old] = self._ids
        self._ids = ids
        free = np.zeros(n, dtype=np.int32)
        free[: self._n_free] = self._free[: self._n_free]
        # new slots on top of the stack, lowest popped last
        free[self._n_free : self._n_free + n - old] = np.arange(n - 1, old - 1, -1)
        self._free = free
        self._n_free += n - old

    # ---- per user (checkpoints, inspection) -------------------------------------------

    def pending(self, user_ids: Sequence[str]) -> list[PendingEvents]:
        """Each user's open chunk as ``PendingEvents`` (copies; users must have rows)."""
        rows = np.array([self.row_of[u] for u in user_ids], dtype=np.int64)
        ev = self.gather(rows)
        ends = np.cumsum(self.count[rows].astype(np.int64))
        out = []
        for a, b in zip((ends - self.count[rows]).tolist(), ends.tolist()):
            ints = ev.ints[a:b]
            out.append(
                PendingEvents(
                    ints[:, 0].copy(),
                    ev.ids[a:b].tolist(),
                    ints[:, 1].copy(),
                    ints[:, 2].copy(),
                    ints[:, 3].copy(),
                    ev.k[a:b],
                    ev.u[a:b],
                )  # fmt: skip
            )
        return out

    def put(self, items: Sequence[tuple[str, PendingEvents, int]]) -> None:
        """Replace the open chunks and last positions of (user, events, last position)
        (rows made for new users, in order)."""
        rows = np.array([self.row_of.get(u, -1) for u, _, _ in items], dtype=np.int64)
        new = np.nonzero(rows < 0)[0]
        rows[new] = self.add_users([items[i][0] for i in new.tolist()])
        if not len(rows):
            return
        self.clear(rows)
        self.last[rows] = [last for _, _, last in items]
        pend = [p for _, p, _ in items]
        lengths = np.array([len(p) for p in pend], dtype=np.int64)
        if not lengths.sum():
            return
        ev = EventColumns(
            np.stack(
                [np.concatenate([getattr(p, f) for p in pend]) for f in INT_FIELDS], axis=1
            ).astype(np.int64),
            np.array([i for p in pend for i in p.item_ids] + [None], dtype=object)[:-1],
            np.concatenate([p.k for p in pend]).astype(PENDING_DTYPE),
            np.concatenate([p.u for p in pend]).astype(PENDING_DTYPE),
        )
        self.append(rows, lengths, ev)
