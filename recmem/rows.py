"""Per-user state as rows of dense arrays (``UserRows``: a dict user id -> row, a free list
of the rows of dropped users, arrays whose first axis is the rows) and per-event data as
slots of a pool (``SlotPool``: a stack of free slot ids, arrays whose first axis is the
slots), for data a user holds a varying amount of; and the index helpers both use.

The engine's per-user structures (``engine.dedupe.SeenEvents``, ``engine.tails.
RecentEvents``) and the NoteBank's open chunks (``archive.open_chunks.OpenChunks``) keep
their users here, so that a batch's work is numpy over the whole batch plus one dict
lookup per user or event (``np.fromiter(map(...))``, no per-event Python). Growing resizes
each array in place (``ndarray.resize``: realloc moves a large buffer without copying it,
and zeroes the new rows; object arrays get None), so no second copy of a table is ever
held; as growing copies nothing, the factor can be small: 5/4, so that at most a fifth of
the rows (zeroed, hence resident) wait unused. Only ``UserRows.widen`` (a wider second
axis) copies. The arrays are the owner's alone (it hands out copies, never views; an
array's object stays the same while it grows, so an owner may keep a name for it). Owned
by one thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat

import numpy as np


class UserRows:
    """User id -> row of the arrays in ``arrays`` (``add``); a released row is reused.

    ``first``: the capacity of the first growth (in rows); after it, by a quarter."""

    def __init__(self, first: int = 64) -> None:
        self.of: dict[str, int] = {}
        """User -> row, in the order the users got their rows."""
        self.arrays: dict[str, np.ndarray] = {}
        """Name -> array [capacity, ...], resized in place when rows are added."""
        self.capacity = 0
        self._first = first
        self._next = 0
        """Rows [0, _next) were handed out at some time (in use or in ``_free``)."""
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.of)

    def __contains__(self, user_id: str) -> bool:
        return user_id in self.of

    def add(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """A new array of rows of ``shape`` (zeros)."""
        self.arrays[name] = np.zeros((self.capacity, *shape), dtype)
        return self.arrays[name]

    def widen(self, name: str, width: int) -> np.ndarray:
        """Array ``name`` [rows, w, ...] with at least ``width`` columns (a copy when it is
        narrower: the new columns are zeros); returns it."""
        a = self.arrays[name]
        if width > a.shape[1]:
            wide = np.zeros((a.shape[0], width, *a.shape[2:]), a.dtype)
            wide[:, : a.shape[1]] = a
            self.arrays[name] = a = wide
        return a

    def lookup(self, users: Sequence[str]) -> np.ndarray:
        """The users' rows, -1 for a user without one (int64 [len(users)])."""
        return np.fromiter(map(self.of.get, users, repeat(-1)), np.int64, len(users))

    def assign(self, users: Sequence[str]) -> np.ndarray:
        """``lookup``, with a new row for each user that has none (``insert``)."""
        rows = self.lookup(users)
        new = np.flatnonzero(rows < 0)
        if len(new):
            idx = new.tolist()
            self.insert(list(dict.fromkeys([users[i] for i in idx])))  # first seen first
            get = self.of.__getitem__
            rows[new] = np.fromiter(map(get, [users[i] for i in idx]), np.int64, len(idx))
        return rows

    def insert(self, users: Sequence[str]) -> np.ndarray:
        """New rows for ``users`` (distinct, none with a row), in order: the last released
        rows first, then rows never used. Their arrays' rows are whatever the last owner
        left (zeros for a row never used): callers reset what they read."""
        n = len(users)
        reused = self._free[-n:] if n else []
        del self._free[len(self._free) - len(reused) :]
        fresh = np.arange(self._next, self._next + n - len(reused), dtype=np.int64)
        self._next += len(fresh)
        if self._next > self.capacity:
            self.capacity = max(self._next, self.capacity + self.capacity // 4, self._first)
            grow_in_place(self.arrays, self.capacity)
        rows = np.concatenate([np.asarray(reused[::-1], np.int64), fresh])
        self.of.update(zip(users, rows.tolist()))
        return rows

    def release(self, users: Sequence[str]) -> np.ndarray:
        """Forget the users (unknown ones are skipped); their rows, for the caller to reset."""
        pop = self.of.pop
        rows = [r for r in map(pop, users, repeat(None)) if r is not None]
        self._free.extend(rows)
        return np.asarray(rows, np.int64)


class SlotPool:
    """Slots of per-event arrays (``add``), handed out and given back in bulk: a stack of
    free slot ids (int32, as the slot tables that hold them); the arrays grow in place
    like :class:`UserRows`'s (``first``: the capacity of the first growth)."""

    def __init__(self, first: int = 64) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        """Name -> array [capacity, ...], resized in place when slots are added."""
        self.capacity = 0
        self._first = first
        self._objects: list[str] = []
        """Arrays of dtype object: a slot given back drops its reference (None)."""
        self._free = np.zeros(0, np.int32)
        """Free slot ids: ``_free[:_n_free]``, the next taken last."""
        self._n_free = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> None:
        """A new array of slots of ``shape`` (zeros; None for dtype object)."""
        self.arrays[name] = np.zeros((self.capacity, *shape), dtype)
        if self.arrays[name].dtype == object:
            self.arrays[name][...] = None
            self._objects.append(name)

    @property
    def used(self) -> int:
        return self.capacity - self._n_free

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (int64; whatever their last user left in them)."""
        if n > self._n_free:
            old = self.capacity
            cap = max(old + n - self._n_free, old + old // 4, self._first)
            grow_in_place(self.arrays, cap)
            self._free.resize(cap, refcheck=False)
            self._free[self._n_free : self._n_free + cap - old] = np.arange(old, cap)
            self._n_free += cap - old
            self.capacity = cap
        self._n_free -= n
        return self._free[self._n_free : self._n_free + n].astype(np.int64)

    def give(self, ids: np.ndarray) -> None:
        """Slots no longer used (each given once)."""
        self._free[self._n_free : self._n_free + len(ids)] = ids
        self._n_free += len(ids)
        for name in self._objects:
            self.arrays[name][ids] = None

    def write(self, ids: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        """Array ``name`` gets ``values[name]`` at slots ``ids`` (row i at ``ids[i]``)."""
        for name, v in values.items():
            self.arrays[name][ids] = v

    def read(self, ids: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        """The arrays ``names`` at slots ``ids`` (copies), in that order."""
        return [self.arrays[name][ids] for name in names]


def grow_in_place(arrays: dict[str, np.ndarray], capacity: int) -> None:
    """Resize every array to ``capacity`` rows in place (realloc: a large buffer moves
    without a copy; the new rows are zeroed, an object array's set to None). No view of
    these arrays outlives a call of their owner (it hands out copies), so the reference
    check is off: it would also count the owner's own names for them."""
    for a in arrays.values():
        old = len(a)
        a.resize((capacity, *a.shape[1:]), refcheck=False)
        if a.dtype == object:
            a[old:] = None


def row_cells(
    rows: np.ndarray, counts: np.ndarray, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of columns ``starts[i] .. starts[i] + counts[i] - 1`` (from 0 without
    ``starts``) of row ``rows[i]``, row after row: an index into an array [rows, width]."""
    cols = positions(counts) if starts is None else ragged_arange(starts, counts)
    return np.repeat(rows, counts), cols


def row_prefixes(table: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``table[rows[i], :counts[i]]`` for each i, concatenated: the entries a row holds
    from its first column (a table [rows, width, ...]), by one masked gather of the rows
    (faster than indexing with ``row_cells(rows, counts)`` for the narrow slot tables)."""
    return table[rows][np.arange(table.shape[1])[None, :] < counts[:, None]]


def ring_cells(
    rows: np.ndarray, counts: np.ndarray, end: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) of the last ``counts[i]`` entries of ring row ``rows[i]`` (the newest
    just before slot ``end[row]``), user after user, oldest first: an index into an array
    [rows, size, ...]. Users with a count of 0 may have row -1."""
    rep = np.repeat(np.arange(len(rows)), counts)
    r = rows[rep]
    return r, (end[r] - counts[rep] + positions(counts)) % size


def split_runs(values: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """``np.split(values, np.cumsum(counts)[:-1])``: consecutive views of ``counts[i]``
    entries each, by slicing (np.split costs a few microseconds per piece)."""
    ends = np.cumsum(counts).tolist()
    return [values[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def positions(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[i]-1 for each i, concatenated (int64)."""
    return ragged_arange(np.zeros(len(counts), np.int64), counts)


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
