"""Per-user memory state as the model reads and writes it, for a batch of users."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MemoryState:
    """States of B users, every layer and head.

    S, M: [B, L, H, K, V] (M is None for the gated-delta variant, which has no momentum);
    pos: [B] int64, the user's count of applied events (Proteus position);
    last_ts: [B] int64, event time (ms) of the user's latest applied event, -1 if none;
    h: [B, D] the model's read-out after the user's latest event (the user vector without
    replay; zeros for a user with no events).
    """

    S: torch.Tensor
    M: torch.Tensor | None
    pos: torch.Tensor
    last_ts: torch.Tensor
    h: torch.Tensor

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
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> MemoryState:
        shape = (batch, n_layers, n_heads, key_dim, value_dim)
        return cls(
            S=torch.zeros(shape, device=device, dtype=dtype),
            M=torch.zeros(shape, device=device, dtype=dtype) if momentum else None,
            pos=torch.zeros(batch, dtype=torch.int64, device=device),
            last_ts=torch.full((batch,), -1, dtype=torch.int64, device=device),
            h=torch.zeros((batch, embed_dim), device=device, dtype=dtype),
        )

    def clone(self) -> MemoryState:
        return MemoryState(
            self.S.clone(),
            None if self.M is None else self.M.clone(),
            self.pos.clone(),
            self.last_ts.clone(),
            self.h.clone(),
        )

    def detach(self) -> MemoryState:
        return MemoryState(
            self.S.detach(),
            None if self.M is None else self.M.detach(),
            self.pos,
            self.last_ts,
            self.h.detach(),
        )

    def index(self, rows: torch.Tensor | slice) -> MemoryState:
        return MemoryState(
            self.S[rows],
            None if self.M is None else self.M[rows],
            self.pos[rows],
            self.last_ts[rows],
            self.h[rows],
        )
