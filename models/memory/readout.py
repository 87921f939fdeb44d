"""Read-out-only form of the memory rule: the outputs y of a short run of events, without
the state after them (rank-time replay on a throw-away copy of a user's state).

Same inputs as ``naive.memory_scan_reference``; returns only its y [B, T, H, V] (zeros at
padding). The rank path replays a few notes and the user's latest events on a COPY of the
state and reads one vector: the state after the run is never needed. So instead of walking
the events and rewriting the [K, V] state per event (``recurrent``) or per chunk
(``chunk_aligned``), this form reads the initial state ONCE and does everything else on
[T, T] matrices of scalars per (user, head): one chunk spanning the whole run.

Derivation (one user and head; events i = 0..T-1, a_i = 1 - alpha_i, e_i = eta_i, th_i =
theta_i, k_i, q_i the masked and normalised k~, q~; products of gates are cumulative
products, never ratios, since gates may be 0):

    A[i, s] = prod_{t=s+1..i} a_t,   E[i, s] = prod_{t=s+1..i} e_t     (1 for s = i)
    G[i, s] = sum_{r=s..i} A[i, r] E[r, s]                              (s <= i)

Row r of the state is open from event o_r on (Proteus opens rows, never closes them; o_r =
0 for rows open at the first event). Before o_r the row keeps S0, M0 and k, q are 0 on it,
so for i >= o_r - 1:

    S_r(i) = A[i, o_r - 1] S0_r + F_i(o_r) M0_r - sum_{s <= i} G[i, s] th_s k_s[r] w_s^T
    F_i(o) = sum_{r=o..i} A[i, r] E[r, o - 1]

(terms with s < o_r vanish because k_s[r] = 0 there). With the surprise w_i = S_{i-1}^T k_i
- v_i and the read y_i = S_i^T q_i, per (user, head):

    (I + L) W = cA' (k) S0 + cF' (k) M0 - V,  L[i, s] = G[i-1, s] th_s (k_i . k_s), s < i
    Y = cA (q) S0 + cF (q) M0 - (G o th_s (q_i . k_s)) W

where cA (x) scales each x_i[r] by A[i, o_r - 1] (cA' by A[i-1, o_r - 1]) and likewise
cF with F. The state is read by one [2T, K] x [K, V] product for S0 and one for M0; W is one
unit-lower-triangular solve. Without momentum (eta None) E is the identity (e = 0): F = 0,
G = A. The algebra is that of ``chunk_aligned`` with the mask handled per row instead of by
aligning chunks, and without the state update. Runs stay short (``READOUT_MAX_EVENTS``):
the [T, T] products and the solve are exact in exact arithmetic but accumulate rounding
like any long chunk.
"""

from __future__ import annotations

import torch

from models.memory.chunk_aligned import _pair_products
from models.memory.proteus import open_rows_tensor
from models.memory.recurrent import _denormals_flushed, event_positions, masked_qk

READOUT_MAX_EVENTS = 64
"""Longest run ``memory_readout_chunk`` takes; longer runs go through the scan."""


def _extended_products(g: torch.Tensor) -> torch.Tensor:
    """g [..., T] -> P [..., T, T + 1], P[..., i, c] = prod_{t=c..i} g_t (c = s + 1, so
    column 0 is "from the start"); 1 for c = i + 1, 0 for c > i + 1."""
    ones = torch.ones_like(g[..., :1])
    return _pair_products(torch.cat([ones, g], -1))[..., 1:, :]


@torch.no_grad()
def memory_readout_chunk(
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
    last_only: bool = False,
) -> torch.Tensor:
    """y [B, T, H, V] of ``memory_scan_reference`` (zeros at padding) in one chunk; the
    inputs are not changed and no host synchronisation happens (CUDA-graph safe). With
    ``last_only`` only each user's output at its last event, [B, 1, H, V] (zeros for a user
    without events): the reads of the state by q~ and the q~ . k~ products then take one row
    instead of T (the last layer of a replay needs nothing else)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0 or B == 0:
        return v.new_zeros(B, 1, H, V) if last_only else v.new_zeros(v.shape)
    if T > READOUT_MAX_EVENTS:
        raise ValueError(f"memory_readout_chunk takes at most {READOUT_MAX_EVENTS} events")
    dev, dt = q.device, q.dtype
    momentum = eta is not None and M0 is not None
    with _denormals_flushed(dev):
        positions = event_positions(pos0, lengths, T)
        qt, kt, _ = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
        # o_r: the first event at which row r is open (T or beyond: never in this run)
        rows = open_rows_tensor(positions, K, n_blocks, horizon)  # [B, T], 0 at padding
        real = (torch.arange(T, device=dev)[None, :] < lengths[:, None])[..., None]
        r_idx = torch.arange(K, device=dev)
        opens = ((rows[..., None] <= r_idx) & real).sum(1)  # [B, K] events before opening
        BH = B * H

        def bh(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B*H, T, ...]
            return x.transpose(1, 2).reshape(BH, T, *x.shape[3:])

        a = bh(1 - alpha)
        e = bh(eta) if momentum and eta is not None else torch.zeros_like(a)
        th = bh(theta)
        k_bh, q_bh = bh(kt), bh(qt)
        A_ext = _extended_products(a)  # [BH, T, T+1]: A[i, c-1]
        E_ext = _extended_products(e)
        A_T, E_T = A_ext[..., 1:], E_ext[..., 1:]  # A[i, s], E[i, s] for s = 0..T-1
        G = A_T @ E_T  # [BH, T, T], 0 above the diagonal
        # Coefficient matrices over (event i, column c = o - 1 + 1), stacked: A[i, c-1],
        # A[i-1, c-1] (row -1: 1 at column 0), then F_i(c) and F_{i-1}(c) (row -1: 0).
        parts = 4 if momentum else 2
        coef = A_ext.new_zeros(BH, parts, T, T + 1)
        coef[:, 0] = A_ext
        coef[:, 1, 1:] = A_ext[:, :-1]
        coef[:, 1, 0, 0] = 1.0
        if momentum:
            lower = torch.ones(T, T + 1, dtype=torch.bool, device=dev).tril()  # r >= c
            F_all = torch.matmul(A_T, E_ext * lower, out=coef[:, 2])  # F_i(o) at column o
            coef[:, 3, 1:] = F_all[:, :-1]
        # per row r the column o_r: one matmul with the one-hot [T+1, K] of each user
        onehot = opens.clamp(max=T)[:, None, :] == torch.arange(T + 1, device=dev)[:, None]
        per_row = torch.bmm(coef.view(B, H * parts * T, T + 1), onehot.to(dt))
        per_row = per_row.view(BH, parts, T, K)
        # the read rows: every event, or (last_only) each user's last one
        if last_only:
            last = (lengths - 1).clamp(min=0).repeat_interleave(H)  # [BH]
            pick = torch.arange(BH, device=dev)
            q_rows = q_bh[pick, last][:, None]  # [BH, 1, K]
            y_coef = per_row[pick, :, last][:, :, None]  # [BH, parts, 1, K]
            G_rows = G[pick, last][:, None]  # [BH, 1, T]
        else:
            q_rows, y_coef, G_rows = q_bh, per_row, G
        S0_bh = S0.reshape(BH, K, V)
        init_w = torch.bmm(k_bh * per_row[:, 1], S0_bh)  # A[i-1, o_r - 1] k_i S0
        init_y = torch.bmm(q_rows * y_coef[:, 0], S0_bh)  # A[i, o_r - 1] q_i S0
        if momentum and M0 is not None:
            M0_bh = M0.reshape(BH, K, V)
            init_w.baddbmm_(k_bh * per_row[:, 3], M0_bh)
            init_y.baddbmm_(q_rows * y_coef[:, 2], M0_bh)
        kk = k_bh @ k_bh.transpose(1, 2)  # [BH, T(i), T(s)]
        qk = q_rows @ k_bh.transpose(1, 2)
        L = kk.mul_(th[:, None, :])
        L[:, 1:] *= G[:, :-1]  # G[i-1, s] th_s (k_i . k_s)
        L[:, 0] = 0.0
        eye = torch.eye(T, dtype=dt, device=dev)
        rhs = init_w.sub_(bh(v))
        W = torch.linalg.solve_triangular(L + eye, rhs, upper=False, unitriangular=True)
        Y = init_y.baddbmm_(G_rows * qk * th[:, None, :], W, alpha=-1.0)  # [BH, T or 1, V]
        if last_only:
            has = (lengths > 0)[:, None, None, None].to(dt)
            return Y.view(B, H, 1, V).transpose(1, 2) * has
        y = Y.view(B, H, T, V).transpose(1, 2)
        return y * real[..., None].to(dt)
