"""Chunked form for inference on CPU: chunks aligned to the Proteus schedule, scalar gates.

Same signature and semantics as ``naive.memory_scan_reference``, no autograd (ingest,
ranking, evaluation). The general chunked form (``chunk.py``) carries every gate per key
row, [C, C, K] products per chunk, because the Proteus mask makes the gates differ by row.
But the mask only changes when the position crosses a multiple of Delta (``proteus.py``).
Shift each user's events right by ``pos0 mod C`` padding events (exact no-ops) with C a
divisor of Delta: then every chunk holds events of one mask state, and per chunk a row is
either open for all its events or locked for all of them. Open rows see scalar gates per
(event, head); padding events inside a chunk are the scalar gates a = e = 1, o = 0 with
k~ = q~ = 0. So the chunk algebra of ``chunk.py`` runs on [C, C] scalars, and locked rows
only need the chunk's decay factors replaced by 1 (S, M) and 0 (M into S); k~ is exactly 0
on them, so the rank-C update writes exact zeros there and they keep their bits.

With S and M stacked as one [2K, V] matrix per (user, head), a chunk is one matmul that
reads the state (the chunk's w, before the triangular solve folded in, and its outputs), two
row-scalings and one rank-C update: the state is touched once per chunk instead of several
times per event. The derivation is in docs/memory.md ("Aligned chunks for inference").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.memory.chunk import _pair_products
from models.memory.naive import L2_EPS
from models.memory.proteus import open_rows_tensor, schedule_delta
from models.memory.recurrent import _denormals_flushed, event_positions


def aligned_chunk_size(chunk_size: int, n_blocks: int, horizon: int) -> int:
    """The largest chunk size <= ``chunk_size`` that divides Delta (mask changes then fall
    on chunk boundaries once events are shifted by ``pos0 mod C``)."""
    delta = schedule_delta(n_blocks, horizon)
    return max(c for c in range(1, max(1, chunk_size) + 1) if delta % c == 0)


@torch.no_grad()
def memory_scan_chunk_aligned(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0 or B == 0:
        return v.new_zeros(v.shape), S0.clone(), None if M0 is None else M0.clone()
    momentum = eta is not None and M0 is not None
    with _denormals_flushed(q.device):
        C = aligned_chunk_size(chunk_size, n_blocks, horizon)
        positions = event_positions(pos0, lengths, T)
        dev = q.device

        # Event (b, t) goes to column shift[b] + t: slot c of chunk n. A user whose events
        # cross a mask change is shifted by pos0 mod C (the change then opens a chunk); the
        # others keep one mask throughout and are not shifted. Per chunk the (user, head)
        # matrices are laid out [N, B*H, C, ...]; padding cells stay zero.
        first, last = (open_rows_tensor(pos0 + d, K, n_blocks, horizon) for d in (1, lengths))
        shift = torch.where(first != last, torch.remainder(pos0, C), 0)
        N = max(1, math.ceil(int((shift + lengths).max()) / C))
        BH = B * H
        b_idx, t_idx = (positions > 0).nonzero(as_tuple=True)
        col = shift[b_idx] + t_idx
        chunk_user = torch.div(col, C, rounding_mode="floor") * B + b_idx
        mat = chunk_user[:, None] * H + torch.arange(H, device=dev)  # [events, H]
        slot = torch.remainder(col, C)[:, None]

        def place(
            x: torch.Tensor, rows: int, offset: int = 0, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            """Scatter the events' [H, D] rows of x [B, T, H, D] into [N * BH * rows, D]."""
            if out is None:
                out = x.new_zeros(N * BH * rows, x.shape[-1])
            out[mat * rows + offset + slot] = x[b_idx, t_idx]
            return out

        kq = place(k, 2 * C)  # rows 0..C-1 of a chunk: k, C..2C-1: q
        kq = place(q, 2 * C, C, out=kq).view(N, BH, 2 * C, K)
        # The Proteus mask is one per (chunk, user): mask, then normalise, in place.
        rows_open = open_rows_tensor(positions[b_idx, t_idx], K, n_blocks, horizon)
        open_n = rows_open.new_zeros(N * B).scatter_reduce_(0, chunk_user, rows_open, "amax")
        row_open = torch.arange(K, device=dev) < open_n.view(N, B, 1, 1)  # [N, B, 1, K]
        kq.view(N, B, H * 2 * C, K).mul_(row_open)
        if qk_l2norm:
            kq.mul_(torch.rsqrt(torch.linalg.vecdot(kq, kq)[..., None] + L2_EPS))
        kc = kq[:, :, :C]
        vc = place(v, C).view(N, BH, C, V)
        ones = torch.ones_like(theta)
        gates = [ones, theta, alpha] + ([eta] if momentum and eta is not None else [])
        g = place(torch.stack(gates, -1), C).view(N, BH, C, len(gates))  # padding: all 0
        on, th = g[..., 0], g[..., 1]
        a = 1 - g[..., 2]  # padding: 1
        e = 1 + (g[..., 3] - 1) * on if momentum else 1 - on  # no momentum: M restarts
        row_open = row_open[..., None].expand(N, B, H, K, 1).reshape(N, BH, K, 1)

        A = _pair_products(a[..., None]).squeeze(-1)  # [N, BH, C(i), C(s)]
        Ep = _pair_products(e[..., None]).squeeze(-1)
        Ao = A * on[..., None, :]
        G = Ao @ Ep  # G_{i,s} = sum_r A_{i,r} o_r E_{r,s}
        a_pre = torch.cumprod(a, dim=-1)  # A_{i,0}: prod of a through i
        a_prev = F.pad(a_pre[..., :-1], (1, 0), value=1.0)
        dots = kq @ (kc * th[..., None]).transpose(-1, -2)  # [k~; q~] . theta_s k~_s
        G_prev = F.pad(G[..., :-1, :], (0, 0, 1, 0))
        Lmat = torch.tril(dots[:, :, :C] * G_prev, diagonal=-1)
        eye = torch.eye(C, dtype=q.dtype, device=dev)
        inv = torch.linalg.solve_triangular(
            Lmat + eye, eye.expand_as(Lmat), upper=False, unitriangular=True
        )
        P = torch.tril(dots[:, :, C:] * G)
        inv_a = inv * a_prev[..., None, :]  # w = inv (a_prev k S + F_prev k M - v)
        inv_v = inv @ vc
        keep_S = torch.where(row_open, a_pre[..., -1, None, None], 1.0)
        g_w = [G[..., -1, :, None] * th[..., None]]  # S -= k~^T (G_{C-1,s} theta_s w_s)
        if momentum:
            e_pre = torch.cumprod(e, dim=-1)
            Fv = (Ao @ e_pre[..., None]).squeeze(-1)  # F_i
            inv_F = inv * F.pad(Fv[..., :-1], (1, 0))[..., None, :]
            S_from_M = torch.where(row_open, Fv[..., -1, None, None], 0.0)
            keep_M = torch.where(row_open, e_pre[..., -1, None, None], 1.0)
            g_w.append(Ep[..., -1, :, None] * th[..., None])  # M -= k~^T (E_{C-1,s} ...)

        # State per (user, head): [K, 2V] = [S | M]; reads and writes share k~.
        state = (
            torch.cat([S0, M0], dim=-1)
            if momentum and M0 is not None
            else S0.clone(memory_format=torch.contiguous_format)
        )
        state = state.reshape(BH, K, -1)
        S, M = state[..., :V], state[..., V:]
        reads = v.new_empty(N, BH, 2 * C, state.shape[-1])
        W = v.new_empty(N, BH, C, V)
        gw = v.new_empty(BH, C, state.shape[-1])
        for n in range(N):
            x = torch.bmm(kq[n], state, out=reads[n])
            w = torch.baddbmm(inv_v[n], inv_a[n], x[:, :C, :V], alpha=1.0, beta=-1.0, out=W[n])
            if momentum:
                w.baddbmm_(inv_F[n], x[:, :C, V:])
            torch.mul(w, g_w[0][n], out=gw[..., :V])
            S.mul_(keep_S[n])
            if momentum:
                torch.mul(w, g_w[1][n], out=gw[..., V:])
                S.addcmul_(M, S_from_M[n])
                M.mul_(keep_M[n])
            state.baddbmm_(kc[n].transpose(-1, -2), gw, alpha=-1.0)

        Y = reads[:, :, C:, :V] * a_pre[..., None]  # y = A_{i,0} q S + F_i q M - P W
        if momentum:
            Y.addcmul_(reads[:, :, C:, V:], Fv[..., None])
        Y.view(N * BH, C, V).baddbmm_(P.reshape(N * BH, C, C), W.view(N * BH, C, V), alpha=-1.0)
        y = v.new_zeros(B, T, H, V)
        y[b_idx, t_idx] = Y.view(-1, V)[mat * C + slot]
        state = state.view(B, H, K, -1)
        S_out = state[..., :V]
        M_out = state[..., V:] if momentum else M0
        return y, S_out, M_out
