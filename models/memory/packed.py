"""The memory scan on packed events, for the CPU ingest step (``MemoryRecommender.advance_packed``).

Packed: the events of B users stored one row each, user b's t-th event in row starts[b] + t
(no padding cells). q, k [N, H, K], v [N, H, V], the gates [N, H]. Same semantics as
``naive.memory_scan_reference`` on the right-padded batch, no autograd.

One batch of users of very different lengths runs as two scans instead of one per
power-of-two length: the users with a few events or more take ONE aligned chunked scan
(``chunk_aligned.py``; it computes chunk n only for the users that still have events in
it, so listing users longest first wastes no work: on ML-100K's ingest batches the chunks
hold about 1.2 slots per event), the users with fewer take one vectorised recurrent scan
of at most 3 steps.

On a GPU (``padded_backend``, "triton" there) the scan itself runs on right-padded copies
instead: the users, longest first, in groups of at most ``PADDED_SCAN_CELLS`` padded
cells, each group one call of the padded batch's kernel (which stops at each user's
length). The aligned chunked form is many small operations, which a GPU runs slower than
the one fused kernel; only the scan's inputs and outputs are padded, the projections and
feed-forward blocks around it still run on the events alone.
"""

from __future__ import annotations

import torch

from models.memory.chunk_aligned import (
    EAGER_CHUNK_OPS,
    ChunkOps,
    aligned_chunk_size,
    memory_scan_chunk_aligned_packed,
)
from models.memory.ops import CPU_CHUNK_MIN_SIZE, memory_scan
from models.memory.recurrent import memory_scan_recurrent

PACKED_CHUNK_MIN_EVENTS = 4
"""Users take the aligned chunked scan when the aligned chunk is at least
``ops.CPU_CHUNK_MIN_SIZE`` wide (narrower chunks leave every user on the recurrent scan)
and they have at least this many events: a user's chunks then hold at most 4x its events (8x
when they cross an unlock and the user is shifted into a second chunk),
and the users with fewer run ONE recurrent scan of at most 3 steps (a batch of users with
one event each runs one step, not a chunk of 16 slots per user)."""


PADDED_SCAN_CELLS = 65_536
"""The padded groups' size (users x their longest length) on the padded-scan path: the
padded copies of q, k, v and y stay small, and the first group's longest user does not pad
all the others."""


def padded_groups(lengths: torch.Tensor, cells: int | None = None) -> list[torch.Tensor]:
    """The rows of the users with events, longest first, cut into consecutive groups of at
    most ``cells`` (default ``PADDED_SCAN_CELLS``) padded cells (rows x the group's first
    length; one row at least)."""
    cells = PADDED_SCAN_CELLS if cells is None else cells
    rows = (lengths > 0).nonzero().flatten()
    if not len(rows):
        return []
    lens = lengths[rows]
    order = torch.argsort(-lens, stable=True)
    rows, lens_host = rows[order], lens[order].tolist()
    out, i = [], 0
    while i < len(lens_host):
        n = max(1, cells // max(lens_host[i], 1))
        out.append(rows[i : i + n])
        i += n
    return out


def packed_groups(lengths: torch.Tensor, chunk: int) -> list[tuple[str, torch.Tensor]]:
    """(backend, user rows) of each scan: ``chunk_aligned`` for the users with >=
    PACKED_CHUNK_MIN_EVENTS events (when chunk >= CPU_CHUNK_MIN_SIZE), ``recurrent`` for
    the others; users without events are left out."""
    long = (lengths >= PACKED_CHUNK_MIN_EVENTS) & (chunk >= CPU_CHUNK_MIN_SIZE)
    short = (~long) & (lengths > 0)
    groups = [("chunk_aligned", long), ("recurrent", short)]
    return [(name, rows.nonzero().flatten()) for name, rows in groups if bool(rows.any())]


@torch.no_grad()
def memory_scan_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    S0: torch.Tensor,
    M0: torch.Tensor | None,
    pos0: torch.Tensor,
    lengths: torch.Tensor,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
    chunk_size: int = 16,
    ops: ChunkOps = EAGER_CHUNK_OPS,
    padded_backend: str | None = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y [N, H, V], S, M) for packed events (module docstring): user b's events are rows
    sum(lengths[:b]) ... sum(lengths[:b + 1]) - 1. The inputs are not changed.
    ``padded_backend``: run the scan on right-padded groups on this backend
    (``memory_scan``'s names), or None for the aligned chunked and recurrent scans; auto =
    "triton" on a CUDA device, None elsewhere."""
    N = q.shape[0]
    starts = torch.cumsum(lengths, 0) - lengths
    y = v.new_zeros(v.shape)
    S = S0.clone()
    momentum = eta is not None and M0 is not None
    M = M0.clone() if M0 is not None else None
    if N == 0:
        return y, S, M
    if padded_backend == "auto":
        padded_backend = "triton" if q.device.type == "cuda" else None
    chunk = aligned_chunk_size(chunk_size, n_blocks, horizon)
    if padded_backend is not None:
        groups = [(padded_backend, rows) for rows in padded_groups(lengths)]
    else:
        groups = packed_groups(lengths, chunk)
    for backend, rows in groups:
        lens, st = lengths[rows], starts[rows]
        m0 = M0[rows] if momentum and M0 is not None else M0
        if backend == "chunk_aligned":
            S_g, M_g = memory_scan_chunk_aligned_packed(
                q, k, v, theta, eta, alpha, S0[rows], m0, pos0[rows], lens, st, y,
                n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm, chunk_size=chunk_size,
                ops=ops,
            )  # fmt: skip
        else:
            # right-padded [B_g, T_g] copies of the group's rows; padding repeats the user's
            # last event (any finite values: a padding event is an exact no-op)
            T = int(lens.max())
            cols = torch.minimum(torch.arange(T, device=lens.device)[None, :], lens[:, None] - 1)
            idx = (st[:, None] + cols).flatten()
            B = len(rows)
            pad = [None if x is None else _rows(x, idx, B, T) for x in (q, k, v, theta, eta, alpha)]
            q_, k_, v_, th_, eta_, al_ = pad
            assert q_ is not None and k_ is not None and v_ is not None
            assert th_ is not None and al_ is not None
            if backend == "recurrent":
                y_g, S_g, M_g = memory_scan_recurrent(
                    q_, k_, v_, th_, eta_, al_, S0[rows], m0, pos0[rows], lens,
                    n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm,
                )  # fmt: skip
            else:
                y_g, S_g, M_g = memory_scan(
                    q_, k_, v_, th_, eta_, al_, S0[rows], m0, pos0[rows], lens,
                    n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm,
                    backend=backend, chunk_size=chunk_size,
                )  # fmt: skip
            valid = (torch.arange(T, device=lens.device)[None, :] < lens[:, None]).flatten()
            y.index_copy_(0, idx[valid], y_g.reshape(B * T, *y.shape[1:])[valid])
        S[rows] = S_g
        if momentum and M is not None and M_g is not None:
            M[rows] = M_g
    return y, S, M


def _rows(x: torch.Tensor, idx: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Rows ``idx`` of packed x [N, ...] as a right-padded [B, T, ...] batch."""
    return x.index_select(0, idx).view(B, T, *x.shape[1:])
