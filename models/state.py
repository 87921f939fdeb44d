"""Per-user memory state as the model reads and writes it, for a batch of users."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

NO_ITEM = -1
"""``win_items`` of an empty window slot (a user with fewer than W events)."""

OPTIONAL_FIELDS = ("M", "unlocks", "unlock_acc", "order_key")
"""Fields a state may lack (None): momentum, and the unlock schedules' own."""


@dataclass
class MemoryState:
    """States of B users, every layer and head.

    S, M: [B, L, H, K, V] (M is None for the gated-delta variant, which has no momentum);
    pos: [B] int64, the user's count of applied events (Proteus position);
    last_ts: [B] int64, event time (ms) of the user's latest applied event, -1 if none;
    h: [B, D] the memory layers' output after the user's latest event (zeros for a user
    with no events); the user vector is read from it (``MemoryRecommender.read_user``);
    win_items, win_actions, win_gaps, win_ts: [B, W] int64, the user's latest W events
    (item index, action index, time-gap bucket, event time), oldest first and right-aligned:
    column W - 1 is the latest event; empty slots hold item NO_ITEM and ts -1. W = 0 (no
    window) gives [B, 0] tensors.

    Optional fields of the unlock schedules (models/memory/schedule.py), None unless the
    model's schedule needs them: unlocks [B, L] int64, the blocks each layer's memory has
    unlocked beyond the first (memory.unlock surprise | drift), unlock_acc [B, L, 2] the
    signal summed since that layer's last decision and the sum of its past interval means; order_key [B] int64, the key of the user's
    block order (memory.block_order random).

    Every field is a tensor whose first dimension is the user (M and the optional fields may
    be None), so stores and checkpoints handle a state generically through ``to_fields`` /
    ``from_fields``.
    """

    S: torch.Tensor
    M: torch.Tensor | None
    pos: torch.Tensor
    last_ts: torch.Tensor
    h: torch.Tensor
    win_items: torch.Tensor
    win_actions: torch.Tensor
    win_gaps: torch.Tensor
    win_ts: torch.Tensor
    unlocks: torch.Tensor | None = None
    unlock_acc: torch.Tensor | None = None
    order_key: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        batch: int,
        n_layers: int,
        n_heads: int,
        key_dim: int,
        value_dim: int,
        momentum: bool,
        embed_dim: int,
        window: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        adaptive: bool = False,
        keyed_order: bool = False,
    ) -> MemoryState:
        """A batch of new users. ``adaptive``: with the unlock fields; ``keyed_order``: with
        the block-order key."""
        shape = (batch, n_layers, n_heads, key_dim, value_dim)

        def ints(fill: int) -> torch.Tensor:
            return torch.full((batch, window), fill, dtype=torch.int64, device=device)

        return cls(
            S=torch.zeros(shape, device=device, dtype=dtype),
            M=torch.zeros(shape, device=device, dtype=dtype) if momentum else None,
            pos=torch.zeros(batch, dtype=torch.int64, device=device),
            last_ts=torch.full((batch,), -1, dtype=torch.int64, device=device),
            h=torch.zeros((batch, embed_dim), device=device, dtype=dtype),
            win_items=ints(NO_ITEM),
            win_actions=ints(0),
            win_gaps=ints(0),
            win_ts=ints(-1),
            unlocks=(
                torch.zeros((batch, n_layers), dtype=torch.int64, device=device)
                if adaptive
                else None
            ),
            unlock_acc=(
                torch.zeros((batch, n_layers, 2), device=device, dtype=dtype) if adaptive else None
            ),
            order_key=torch.zeros(batch, dtype=torch.int64, device=device) if keyed_order else None,
        )

    @property
    def window(self) -> int:
        """W: events kept in the window."""
        return int(self.win_items.shape[1])

    def to_fields(self) -> dict[str, torch.Tensor]:
        """name -> tensor for every field present (M and the optional fields are left out
        when None)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_fields(cls, f: dict[str, torch.Tensor]) -> MemoryState:
        """Inverse of ``to_fields``; a missing M means no momentum, a missing optional
        field that the schedule does not use it."""
        names = [x.name for x in fields(cls)]
        missing = [n for n in names if n not in OPTIONAL_FIELDS and n not in f]
        if missing:
            raise ValueError(f"state fields missing: {missing}")
        return cls(**{n: f.get(n) for n in names})  # type: ignore[arg-type]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MemoryState:
        """A state with ``fn`` applied to every tensor field."""
        return MemoryState.from_fields({k: fn(v) for k, v in self.to_fields().items()})

    def clone(self) -> MemoryState:
        return self.map(torch.Tensor.clone)

    def detach(self) -> MemoryState:
        return self.map(torch.Tensor.detach)

    def index(self, rows: torch.Tensor | slice) -> MemoryState:
        return self.map(lambda t: t[rows])

    def to(self, device: torch.device | str) -> MemoryState:
        return self.map(lambda t: t.to(device))

    def put_rows(self, rows: torch.Tensor, other: MemoryState) -> MemoryState:
        """A copy of this state with users ``rows`` replaced by ``other``'s (in order)."""
        src = other.to_fields()
        return MemoryState.from_fields(
            {k: v.index_copy(0, rows, src[k]) for k, v in self.to_fields().items()}
        )

    @staticmethod
    def cat(states: list[MemoryState]) -> MemoryState:
        """The users of ``states`` stacked in order."""
        parts = [s.to_fields() for s in states]
        return MemoryState.from_fields({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
