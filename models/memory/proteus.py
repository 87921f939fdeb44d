"""Proteus progressive-capacity schedule (SPEC section 3).

The key dimension K is split into E contiguous blocks of d = K // E rows (the last block
takes any remainder). At the user's lifetime event position t = 1, 2, ... the first
k(t) = min(E, 1 + floor((t - 1) / Delta)) blocks are open, Delta = max(1, floor(N / E)).
"""

from __future__ import annotations

import torch


def schedule_delta(n_blocks: int, horizon: int) -> int:
    """Delta: events between two unlocks."""
    return max(1, horizon // n_blocks)


def unlocked_blocks(t: int, n_blocks: int, horizon: int) -> int:
    """k(t) for one position t >= 1 (t <= 0, a user with no events yet, opens block 1)."""
    t = max(int(t), 1)
    return min(n_blocks, 1 + (t - 1) // schedule_delta(n_blocks, horizon))


def open_rows(t: int, key_dim: int, n_blocks: int, horizon: int) -> int:
    """Rows of S open at position t: k(t) * d, or all K rows once every block is open."""
    k = unlocked_blocks(t, n_blocks, horizon)
    return key_dim if k >= n_blocks else k * (key_dim // n_blocks)


def open_rows_tensor(
    positions: torch.Tensor, key_dim: int, n_blocks: int, horizon: int
) -> torch.Tensor:
    """open_rows for a tensor of positions (int64, any shape); positions <= 0 give 0 rows.

    Position 0 or below is how padding is marked: a padding event opens no row, so it
    neither reads, writes nor decays anything.
    """
    delta = schedule_delta(n_blocks, horizon)
    k = torch.clamp(1 + torch.div(positions - 1, delta, rounding_mode="floor"), max=n_blocks)
    rows = torch.where(k >= n_blocks, torch.full_like(k, key_dim), k * (key_dim // n_blocks))
    return torch.where(positions >= 1, rows, torch.zeros_like(rows))


def proteus_row_mask(
    positions: torch.Tensor,
    key_dim: int,
    n_blocks: int,
    horizon: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """m_t[j] = 1 if j < open_rows(t) else 0; shape positions.shape + (K,)."""
    rows = open_rows_tensor(positions, key_dim, n_blocks, horizon)
    j = torch.arange(key_dim, device=positions.device)
    return (j < rows.unsqueeze(-1)).to(dtype)
