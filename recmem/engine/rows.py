"""Per-user state as rows of dense arrays: a dict user id -> row, a free list of the rows
of dropped users, and arrays (first axis: rows) grown geometrically, in place; and a pool
of per-event slots (``SlotPool``) for data a user holds a varying amount of.

The engine's per-user structures (``dedupe.SeenEvents``, ``tails.RecentEvents``) keep
their users here so that a batch's work is numpy over the whole batch plus one dict
lookup per user or event (``np.fromiter(map(...))``, no per-event Python). Growing resizes
each array in place (``ndarray.resize``: realloc moves a large buffer without copying it,
and zeroes the new rows), so no second copy of a table is ever held; as growing copies
nothing, the factor can be small: 5/4, so that at most a fifth of the rows (zeroed, hence
resident) wait unused. The arrays are the owner's alone (it hands out copies, never
views). Owned by one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from recmem.archive.open_chunks import ragged_arange


class UserRows:
    """User id -> row of the arrays in ``arrays`` (``add``); a released row is reused."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}
        self.arrays: dict[str, np.ndarray] = {}
        """Name -> array [capacity, ...], resized in place when rows are added."""
        self.capacity = 0
        self._next = 0
        """Rows [0, _next) were handed out at some time (in use or in ``_free``)."""
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.of)

    def add(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """A new array of rows of ``shape`` (zeros)."""
        self.arrays[name] = np.zeros((self.capacity, *shape), dtype)
        return self.arrays[name]

    def lookup(self, users: Sequence[str]) -> np.ndarray:
        """The users' rows, -1 for a user without one (int64 [len(users)])."""
        return np.fromiter(map(self.of.get, users, repeat(-1)), np.int64, len(users))

    def assign(self, users: Sequence[str]) -> np.ndarray:
        """``lookup``, with a new row for each user that has none (its arrays' rows are
        whatever the last owner left: callers reset what they read)."""
        rows = self.lookup(users)
        new = np.flatnonzero(rows < 0)
        if len(new):
            idx = new.tolist()
            names = list(dict.fromkeys([users[i] for i in idx]))  # distinct, first seen first
            self.of.update(zip(names, self._alloc(len(names)).tolist()))
            get = self.of.__getitem__
            rows[new] = np.fromiter(map(get, [users[i] for i in idx]), np.int64, len(idx))
        return rows

    def release(self, users: Sequence[str]) -> np.ndarray:
        """Forget the users (unknown ones are skipped); their rows, for the caller to reset."""
        pop = self.of.pop
        rows = [r for r in map(pop, users, repeat(None)) if r is not None]
        self._free.extend(rows)
        return np.asarray(rows, np.int64)

    def _alloc(self, n: int) -> np.ndarray:
        reused = self._free[-n:] if n else []
        del self._free[len(self._free) - len(reused) :]
        fresh = np.arange(self._next, self._next + n - len(reused), dtype=np.int64)
        self._next += len(fresh)
        if self._next > self.capacity:
            self._grow(max(self._next, self.capacity + self.capacity // 4, 64))
        return np.concatenate([np.asarray(reused[::-1], np.int64), fresh])

    def _grow(self, capacity: int) -> None:
        grow_in_place(self.arrays, capacity)
        self.capacity = capacity


class SlotPool:
    """Slots of per-event arrays (``add``), handed out and given back in bulk: a stack of
    free slot ids; the arrays grow in place like :class:`UserRows`'s."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        """Name -> array [capacity, ...], resized in place when slots are added."""
        self.capacity = 0
        self._free = np.zeros(0, np.int64)
        """Free slot ids: ``_free[:_n_free]``."""
        self._n_free = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> None:
        self.arrays[name] = np.zeros((self.capacity, *shape), dtype)

    @property
    def used(self) -> int:
        return self.capacity - self._n_free

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (whatever their last user left in them)."""
        if n > self._n_free:
            old = self.capacity
            cap = max(old + n - self._n_free, old + old // 4, 64)
            grow_in_place(self.arrays, cap)
            self._free.resize(cap, refcheck=False)
            self._free[self._n_free : self._n_free + cap - old] = np.arange(old, cap)
            self._n_free += cap - old
            self.capacity = cap
        self._n_free -= n
        return self._free[self._n_free : self._n_free + n].copy()

    def give(self, ids: np.ndarray) -> None:
        """Slots no longer used (each given once)."""
        self._free[self._n_free : self._n_free + len(ids)] = ids
        self._n_free += len(ids)


def grow_in_place(arrays: dict[str, np.ndarray], capacity: int) -> None:
    """Resize every array to ``capacity`` rows in place (realloc: a large buffer moves
    without a copy; the new rows are zeroed). No view of these arrays outlives a call of
    their owner (it hands out copies), so the reference check is off: it would also count
    the owner's local names."""
    for a in arrays.values():
        a.resize((capacity, *a.shape[1:]), refcheck=False)


def ring_cells(
    rows: np.ndarray, counts: np.ndarray, end: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) of the last ``counts[i]`` entries of ring row ``rows[i]`` (the newest
    just before slot ``end[row]``), user after user, oldest first: an index into an array
    [rows, size, ...]. Users with a count of 0 may have row -1."""
    rep = np.repeat(np.arange(len(rows)), counts)
    r = rows[rep]
    return r, (end[r] - counts[rep] + positions(counts)) % size


def positions(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[i]-1 for each i, concatenated (int64)."""
    return ragged_arange(np.zeros(len(counts), np.int64), counts)
