"""What the archive keeps per user: notes (raw events + addresses), the open chunk's
buffered events, and the helpers that hand notes to replay."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np


@dataclass(frozen=True)
class Note:
    """One archived span of a user's events, in event order.

    serial: the note's number among all notes ever written for this user (0, 1, ...), so
    a larger serial is a more recent note; items: encoded item indices; item_ids: the raw
    item id strings; actions: action indices; ts_ms: event times; positions: the events'
    lifetime positions; addresses: [C_ch, d_rho] unit addresses rho_c = P q_{t*, c}
    (all-zero where the query had no selected coordinate open); votes: channels that voted
    for the note in the route that returned it (0 for a stored note).
    """

    serial: int
    items: np.ndarray
    item_ids: tuple[str, ...]
    actions: np.ndarray
    ts_ms: np.ndarray
    positions: np.ndarray
    addresses: np.ndarray
    votes: int = 0

    def __len__(self) -> int:
        return len(self.items)


def with_votes(note: Note, votes: int) -> Note:
    """A copy of ``note`` with ``votes`` set: the same field values (the arrays shared, not
    copied) as ``dataclasses.replace(note, votes=votes)`` gives, without its per-call field
    introspection (the route of a micro-batch builds hundreds of these)."""
    out = object.__new__(type(note))
    fields = out.__dict__
    fields.update(note.__dict__)
    fields["votes"] = votes
    return out


@dataclass(frozen=True)
class ReplayEvents:
    """The routed notes' raw events concatenated in chronological order, ready to replay."""

    items: np.ndarray
    item_ids: tuple[str, ...]
    actions: np.ndarray
    ts_ms: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return len(self.items)


def replay_events(notes: list[Note]) -> ReplayEvents:
    """Concatenate ``notes`` (already chronological, as ``NoteBank.route`` returns them)."""

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return ReplayEvents(
        items=cat([n.items for n in notes]),
        item_ids=tuple(i for n in notes for i in n.item_ids),
        actions=cat([n.actions for n in notes]),
        ts_ms=cat([n.ts_ms for n in notes]),
        positions=cat([n.positions for n in notes]),
    )


PENDING_DTYPE = np.float16
"""Storage type of the open chunk's unit keys and projected queries: half the memory and
checkpoint bytes of float32, and the same values whether or not a restart came between
(distinctiveness and addresses are computed from the stored values either way)."""


@dataclass
class PendingEvents:
    """Events of the user's open chunk (not yet closed), with what the write path needs of
    them later: unit keys k [n, C_ch, K] and unit projected queries u = P q / |P q|
    [n, C_ch, d_rho] (both scale-free where they are used), as PENDING_DTYPE."""

    items: np.ndarray
    item_ids: list[str]
    actions: np.ndarray
    ts_ms: np.ndarray
    positions: np.ndarray
    k: np.ndarray
    u: np.ndarray

    @classmethod
    def empty(cls, n_channels: int, key_dim: int, address_dim: int) -> PendingEvents:
        z = np.zeros(0, dtype=np.int64)
        return cls(
            items=z,
            item_ids=[],
            actions=z,
            ts_ms=z,
            positions=z,
            k=np.zeros((0, n_channels, key_dim), PENDING_DTYPE),
            u=np.zeros((0, n_channels, address_dim), PENDING_DTYPE),
        )

    def __len__(self) -> int:
        return len(self.items)

    def append(self, other: PendingEvents) -> None:
        if not len(self):  # copies: nothing keeps the caller's (batch) arrays alive
            self.items, self.item_ids = other.items.copy(), list(other.item_ids)
            self.actions, self.ts_ms = other.actions.copy(), other.ts_ms.copy()
            self.positions, self.k, self.u = other.positions.copy(), other.k.copy(), other.u.copy()
            return
        self.items = np.concatenate([self.items, other.items])
        self.item_ids = self.item_ids + other.item_ids
        self.actions = np.concatenate([self.actions, other.actions])
        self.ts_ms = np.concatenate([self.ts_ms, other.ts_ms])
        self.positions = np.concatenate([self.positions, other.positions])
        self.k = np.concatenate([self.k, other.k])
        self.u = np.concatenate([self.u, other.u])

    def take(self, n: int) -> PendingEvents:
        """Remove and return the first ``n`` events."""
        head = PendingEvents(
            self.items[:n],
            self.item_ids[:n],
            self.actions[:n],
            self.ts_ms[:n],
            self.positions[:n],
            self.k[:n],
            self.u[:n],
        )
        self.items, self.item_ids = self.items[n:], self.item_ids[n:]
        self.actions, self.ts_ms = self.actions[n:], self.ts_ms[n:]
        self.positions, self.k, self.u = self.positions[n:], self.k[n:], self.u[n:]
        return head


@dataclass
class UserArchive:
    """One user's archive: notes in chronological order (oldest first), the count of notes
    ever written (serial of the next note), the open chunk, and the lifetime position of
    the latest event seen (-1 before the first)."""

    pending: PendingEvents
    notes: list[Note] = field(default_factory=list)
    n_written: int = 0
    last_position: int = -1

    def addresses(self) -> np.ndarray:
        """[n_notes, C_ch, d_rho] addresses of the notes, chronological."""
        return np.stack([n.addresses for n in self.notes])


class ItemIdRows(Sequence[Sequence[str]]):
    """The item ids of a batch's users as one flat object array of ``str`` (user by user,
    valid events only) with each user's count: ``item_ids`` for ``NoteBank.observe_batch``
    without a list per user (row b is a view of ``flat``)."""

    def __init__(self, flat: np.ndarray, lengths: Any) -> None:
        self.flat = np.asarray(flat, dtype=object)
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.ends = np.cumsum(self.lengths)
        if self.flat.ndim != 1 or int(self.lengths.sum()) != len(self.flat):
            raise ValueError("ItemIdRows: lengths do not add up to the flat ids")

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, b: int) -> Sequence[str]: ...

    @overload
    def __getitem__(self, b: slice) -> Sequence[Sequence[str]]: ...

    def __getitem__(self, b: int | slice) -> Sequence[str] | Sequence[Sequence[str]]:
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        n = len(self)
        if not -n <= b < n:
            raise IndexError(b)
        b %= n
        end = int(self.ends[b])
        return cast(Sequence[str], self.flat[end - int(self.lengths[b]) : end])
