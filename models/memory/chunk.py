"""Exact chunked form of the memory rule, for training on long sequences.

Same signature and semantics as ``naive.memory_scan_reference``; plain PyTorch, so autograd
gives the gradients on CPU and CUDA. Per row j of the K rows (all gates act row-wise) with
a_t = 1 - alpha_t, e_t = eta_t and o_t = 1 on open rows, a_t = e_t = 1, o_t = 0 on locked
rows, and w_t = S_{t-1}^T k_t - v_t (k already masked and normalised):

    M_t = e_t * M_{t-1} - theta_t k_t w_t^T,    S_t = a_t * S_{t-1} + o_t * M_t.

Without momentum (eta None) e_t = 0 on open rows and M starts at zero inside the scan, which
gives S_t = a_t * S_{t-1} - o_t theta_t k_t w_t^T. Unrolled over a chunk of C events that
starts from (S_0, M_0), with E_{i,s} = prod_{r=s+1..i} e_r, A_{i,s} = prod_{r=s+1..i} a_r,
G_{i,s} = sum_{r=s..i} A_{i,r} o_r E_{r,s} and F_i = sum_{r<=i} A_{i,r} o_r E_{r,0}:

    S_i = A_{i,0} S_0 + F_i M_0 - sum_{s<=i} G_{i,s} theta_s k_s w_s^T
    M_i = E_{i,0} M_0 - sum_{s<=i} E_{i,s} theta_s k_s w_s^T

so the chunk's w solve a unit lower-triangular system (I + L) W = R with
L_{i,s} = theta_s k_i^T (G_{i-1,s} k_s) and R_i = (A_{i-1,0} k_i)^T S_0 + (F_{i-1} k_i)^T M_0 - v_i.
All products are formed as cumulative products (never as ratios), so gates of 0 are fine.
The triangular solves run for all chunks at once; a loop over chunks then does matmuls only.
Padding events (mask all zero) are the identity, so T is padded up to a multiple of C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.memory.recurrent import event_positions, masked_qk

DEFAULT_CHUNK_SIZE = 16


def _pair_products(g: torch.Tensor) -> torch.Tensor:
    """P[..., i, s, j] = prod_{r=s+1..i} g[..., r, j] for i >= s, 0 above the diagonal.

    g: [..., C, K] -> [..., C, C, K].
    """
    C = g.shape[-2]
    idx = torch.arange(C, device=g.device)
    after = (idx[:, None] > idx[None, :])[..., None]  # [C(i), C(s), 1]: r = i > s
    x = torch.where(after, g.unsqueeze(-2), torch.ones_like(g).unsqueeze(-2))
    prod = torch.cumprod(x, dim=-3)
    lower = (idx[:, None] >= idx[None, :])[..., None]
    return torch.where(lower, prod, torch.zeros_like(prod))


def memory_scan_chunk(
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(v.shape), S0, M0
    momentum = eta is not None and M0 is not None
    C = chunk_size
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    positions = event_positions(pos0, lengths, T)
    qt, kt, m = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
    if pad:
        qt, kt, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qt, kt, v))
        m = F.pad(m, (0, 0, 0, pad))
        theta, alpha = F.pad(theta, (0, 0, 0, pad)), F.pad(alpha, (0, 0, 0, pad))
        if eta is not None:
            eta = F.pad(eta, (0, 0, 0, pad))

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """[B, T', H, ...] -> [B, H, N, C, ...]."""
        x = x.reshape(B, n_chunks, C, H, *x.shape[3:])
        return x.movedim(3, 1)

    qc, kc, vc = chunked(qt), chunked(kt), chunked(v)  # [B, H, N, C, K|V]
    th = chunked(theta)[..., None]  # [B, H, N, C, 1]
    o = chunked(m[:, :, None, :].expand(B, n_chunks * C, H, K))  # [B, H, N, C, K]
    is_open = o > 0
    one = torch.ones_like(o)
    a = torch.where(is_open, 1 - chunked(alpha)[..., None], one)
    if momentum:
        assert eta is not None
        e = torch.where(is_open, chunked(eta)[..., None].expand_as(o), one)
    else:
        e = torch.where(is_open, torch.zeros_like(o), one)

    A = _pair_products(a)  # [B, H, N, C(i), C(s), K]
    Ep = _pair_products(e)
    # G_{i,s} = sum_r A_{i,r} o_r E_{r,s}
    G = torch.einsum("bhnirj,bhnrj,bhnrsj->bhnisj", A, o, Ep)
    a_pre = torch.cumprod(a, dim=-2)  # A_{i,0}, the product through i (inclusive)
    ku = kc * th  # theta_s k_s
    # L_{i,s} = theta_s k_i^T G_{i-1,s} k_s for s < i.
    G_prev = F.pad(G[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
    Lmat = torch.einsum("bhnij,bhnisj,bhnsj->bhnis", kc, G_prev, ku)
    Lmat = torch.tril(Lmat, diagonal=-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    inv = torch.linalg.solve_triangular(
        Lmat + eye, eye.expand_as(Lmat), upper=False, unitriangular=True
    )
    a_prev = F.pad(a_pre[..., :-1, :], (0, 0, 1, 0), value=1.0)
    k_S = kc * a_prev  # (A_{i-1,0} k_i)
    q_S = qc * a_pre  # (A_{i,0} q_i)
    P = torch.tril(torch.einsum("bhnij,bhnisj,bhnsj->bhnis", qc, G, ku))
    U_S = G[..., -1, :, :] * ku  # rows G_{C-1,s} theta_s k_s: [B, H, N, C, K]
    if momentum:
        e_pre = torch.cumprod(e, dim=-2)
        # F_i = sum_{r<=i} A_{i,r} o_r E_{r,0}
        Fv = torch.einsum("bhnirj,bhnrj->bhnij", A, o * e_pre)
        F_prev = F.pad(Fv[..., :-1, :], (0, 0, 1, 0))
        k_M, q_M = kc * F_prev, qc * Fv
        U_M = Ep[..., -1, :, :] * ku  # rows E_{C-1,s} theta_s k_s

    S = S0
    M = M0 if momentum else None
    ys = []
    for n in range(n_chunks):
        R = k_S[:, :, n] @ S - vc[:, :, n]
        if M is not None:
            R = R + k_M[:, :, n] @ M
        W = inv[:, :, n] @ R  # [B, H, C, V]
        y = q_S[:, :, n] @ S - P[:, :, n] @ W
        S_next = a_pre[:, :, n, -1, :, None] * S - U_S[:, :, n].transpose(-1, -2) @ W
        if M is not None:
            y = y + q_M[:, :, n] @ M
            S_next = S_next + Fv[:, :, n, -1, :, None] * M
            M = e_pre[:, :, n, -1, :, None] * M - U_M[:, :, n].transpose(-1, -2) @ W
        S = S_next
        ys.append(y)
    y_all = torch.stack(ys, dim=2).reshape(B, H, n_chunks * C, V)[:, :, :T]
    y_all = y_all.movedim(1, 2)
    valid = (positions > 0)[..., None, None]
    y_all = torch.where(valid, y_all, torch.zeros_like(y_all))
    return y_all, S, (M if momentum else M0)
