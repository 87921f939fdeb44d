"""What a rank request and its answer are inside the service, with no torch: the front-end
processes (recmem/server/frontend.py) validate and pack requests with these, and the rank
step (recmem/ranking.py, which re-exports them) answers them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class Events(Protocol):
    """What the rank step reads of a run of one user's events, oldest first: a
    ``UserEvents``, or a NoteBank note (recmem/archive/store.py ``Note``) as routed."""

    @property
    def items(self) -> np.ndarray: ...

    @property
    def actions(self) -> np.ndarray: ...

    @property
    def ts_ms(self) -> np.ndarray: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class UserEvents:
    """Raw events of one user, oldest first: encoded item indices, action indices, ts (ms)."""

    items: np.ndarray
    actions: np.ndarray
    ts_ms: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.items) == len(self.actions) == len(self.ts_ms)):
            raise ValueError("UserEvents arrays must have the same length")

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def empty(cls) -> UserEvents:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: Sequence[UserEvents]) -> UserEvents:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        return cls(
            np.concatenate([p.items for p in parts]).astype(np.int64),
            np.concatenate([p.actions for p in parts]).astype(np.int64),
            np.concatenate([p.ts_ms for p in parts]).astype(np.int64),
        )


@dataclass(frozen=True)
class RankQuery:
    """One validated request. ``candidates``: encoded TRAIN item indices, None = catalog."""

    user_id: str
    k: int
    candidates: np.ndarray | None = None
    replay_notes: int = 0
    """R; 0 = replay off."""
    context: UserEvents = field(default_factory=UserEvents.empty)
    request_ts_ms: int = 0
    """When the question is asked (ms since the epoch); 0 = the server's clock at ranking."""


@dataclass
class RankResult:
    items: np.ndarray
    """Encoded item indices, best first."""
    scores: np.ndarray
    position: int
    """The user's live position (before context and replay)."""
    cold_start: bool
    notes_replayed: int
    context_applied: int
    from_cache: bool = False
    """The user vector came from the replay cache (``Ranker(replay_cache=...)``)."""
