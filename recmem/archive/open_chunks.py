"""The open chunks of many users in one arena (NoteBank's fast write path; the plain
reference keeps one ``PendingEvents`` per user, recmem/archive/store.py).

Every buffered event occupies one slot of flat event arrays (items, actions, ts_ms,
positions, item ids, unit keys k and addresses u, as PENDING_DTYPE); a user is a row of a
slot table ``slot`` [rows, width] (its events' slots in event order, ``count`` of them)
and of ``last`` (the lifetime position of the user's latest event, -1 before the first).
A user's open chunk never holds ``chunk_events`` events after a write (a full chunk
closes), so width = chunk_events - 1 (wider only after loading a checkpoint written with
a larger chunk). The rows are a ``recmem.rows.UserRows`` and the slots a
``recmem.rows.SlotPool`` (as the engine's per-user rows, ``engine.dedupe`` and
``engine.tails``): rows and slots freed are reused and both grow by a quarter in place, so
growing copies nothing and leaves at most a fifth unused (only a wider slot table is a
copy). The first growth is to 1024 rows and 4096 slots. Per user this
costs 4 * width + 12 bytes of table (136 at the default 32 events per chunk) beside its
events, instead of a ``PendingEvents`` of seven arrays and a list per user.
Not thread-safe: the NoteBank calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recmem.archive.store import PENDING_DTYPE, PendingEvents
from recmem.rows import SlotPool, UserRows, row_cells, row_prefixes

INT_FIELDS = ("items", "actions", "ts_ms", "positions")


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
        self.rows = UserRows(first=1024)
        """user -> row (``rows.of``: its order is the order users got archive state,
        ``users()``), and the arrays ``count``, ``last`` and ``slot`` of the rows."""
        self.count = self.rows.add("count", (), np.int32)
        self.last = self.rows.add("last", (), np.int64)
        self.rows.add("slot", (max(chunk_events - 1, 0),), np.int32)
        self.events = SlotPool(first=4096)
        """The buffered events, a slot each: the fields of ``EventColumns``."""
        self.events.add("ints", (4,), np.int64)
        self.events.add("ids", (), object)
        self.events.add("k", (n_channels, key_dim), PENDING_DTYPE)
        self.events.add("u", (n_channels, d_rho), PENDING_DTYPE)

    # ---- rows ---------------------------------------------------------------------------

    def __contains__(self, user_id: str) -> bool:
        return user_id in self.rows

    def add_users(self, user_ids: Sequence[str]) -> np.ndarray:
        """Rows for new users (distinct, none with a row yet), in order: freed rows first;
        empty chunks, no event seen."""
        rows = self.rows.insert(user_ids)
        self.count[rows] = 0
        self.last[rows] = -1
        return rows

    def drop_user(self, user_id: str) -> bool:
        rows = self.rows.release([user_id])
        self.clear(rows)
        return len(rows) > 0

    # ---- events -------------------------------------------------------------------------

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The slots of ``rows``' buffered events, row by row, each in event order."""
        return row_prefixes(self.rows.arrays["slot"], rows, self.count[rows]).astype(np.int64)

    def gather(self, rows: np.ndarray) -> EventColumns:
        """The buffered events of ``rows``, row by row (copies)."""
        return EventColumns(*self.events.read(self.slots_of(rows), EventColumns.__slots__))

    def clear(self, rows: np.ndarray) -> None:
        """Empty the chunks of ``rows`` (their slots become free; the events' ids are
        dropped with them, so the strings are not kept alive)."""
        self.events.give(self.slots_of(rows))
        self.count[rows] = 0

    def append(self, rows: np.ndarray, lengths: np.ndarray, ev: EventColumns) -> None:
        """Append ``ev`` (row by row: ``lengths[i]`` events for ``rows[i]``, distinct rows)
        after each row's buffered events. The caller keeps counts within the width."""
        if len(ev) == 0:
            return
        lengths = np.asarray(lengths, dtype=np.int64)
        cnt = self.count[rows].astype(np.int64)
        slot = self.rows.widen("slot", int((cnt + lengths).max()))
        s = self.events.take(len(ev))
        self.events.write(s, {f: getattr(ev, f) for f in EventColumns.__slots__})
        slot[row_cells(rows, lengths, cnt)] = s
        self.count[rows] = cnt + lengths

    # ---- per user (checkpoints, inspection) -------------------------------------------

    def pending(self, user_ids: Sequence[str]) -> list[PendingEvents]:
        """Each user's open chunk as ``PendingEvents`` (copies; users must have rows)."""
        rows = np.array([self.rows.of[u] for u in user_ids], dtype=np.int64)
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
        rows = self.rows.lookup([u for u, _, _ in items])
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
