"""Chunked form for inference on CPU: chunks aligned to the Proteus schedule, scalar gates.

Same signature and semantics as ``naive.memory_scan_reference``, no autograd (ingest,
ranking, evaluation). The general chunked form (``chunk.py``) carries every gate per key
row, [C, C, K] products per chunk, because the Proteus mask makes the gates differ by row.
But the mask only changes where the position t crosses 1 + j Delta (``proteus.py``). Shift
each user whose events cross such a change right by ``pos0 mod C`` padding events (exact
no-ops), C a divisor of Delta: then every chunk holds events of one mask state, and per
chunk a row is either open for all its events or locked for all of them. Open rows see
scalar gates per (event, head); padding events inside a chunk are the scalar gates
a = e = 1, o = 0 with k~ = q~ = 0. So the chunk algebra of ``chunk.py`` runs on [C, C]
scalars, and locked rows only need the chunk's decay factors replaced by 1 (S, M) and 0
(M into S); k~ is exactly 0 on them, so the rank-C update writes exact zeros there and
they keep their bits.

With S and M side by side as one [K, 2V] matrix per (user, head), a chunk is one matmul
that reads the state ([k~; q~] of the chunk's events times [S | M]), three row scalings and
one rank-C update through k~^T: the state is touched a few times per chunk instead of
several times per event. The derivation and the measured costs are in docs/memory.md
(``chunk_aligned``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.memory.compiled import RowsDynamic, scripted
from models.memory.naive import L2_EPS
from models.memory.proteus import open_rows_tensor, schedule_delta
from models.memory.recurrent import _denormals_flushed, event_positions


def aligned_chunk_size(chunk_size: int, n_blocks: int, horizon: int) -> int:
    """The largest chunk size <= ``chunk_size`` that divides Delta (mask changes then fall
    on chunk boundaries once events are shifted by ``pos0 mod C``)."""
    delta = schedule_delta(n_blocks, horizon)
    return max(c for c in range(1, max(1, chunk_size) + 1) if delta % c == 0)


def _pair_products(g: torch.Tensor) -> torch.Tensor:
    """P[..., i, s] = prod_{r=s+1..i} g[..., r] for i >= s, 0 above the diagonal.

    g: [..., C] -> [..., C, C]; cumulative products, never ratios (gates may be 0).
    """
    C = g.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    # x[..., s, i] = g_i for i > s, else 1: the running product along i starts after s
    x = torch.where(~lower, g[..., None, :], torch.ones((), dtype=g.dtype, device=g.device))
    return x.cumprod(-1).transpose(-1, -2) * lower


@dataclass
class _Layout:
    """Where each event goes. Event (b, t) takes column shift[b] + t: slot c of chunk n. A
    user whose events cross a mask change is shifted by pos0 mod C (the change then opens a
    chunk); the others keep one mask throughout and are not shifted. Chunk n runs on the
    users up to the last one that still has events in it (callers that list users longest
    first, as the engine does, waste nothing), so the (chunk, user, head) matrices are
    stored ragged, [R, C, ...], chunk n's from row offset[n] * H on. Padding cells stay 0.
    The inputs are right-padded [B, T, H, D] (``src`` = ``events``) or packed [N, H, D], the
    rows of the real events only (``src``: starts[b] + t)."""

    C: int
    H: int
    R: int
    active: list[int]
    offset: list[int]
    events: torch.Tensor  # [E] flat b * T + t of the real events
    src: torch.Tensor  # [E] the input row of each real event
    chunk_user: torch.Tensor  # [E] (chunk, user) pair of each event
    cell: torch.Tensor  # [E * H] matrix * C + slot of each (event, head)

    def place(
        self, x: torch.Tensor, rows: int, at: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, H, D] (or packed [N, H, D]) -> [R, rows, D] (zeros, or ``out``): the
        events' rows at slot + ``at`` of their (chunk, user, head) matrix of ``rows`` rows."""
        H, D = x.shape[-2:]
        src = x.reshape(-1, H * D).index_select(0, self.src).view(-1, D)
        dst = self.cell + (self.cell // self.C) * (rows - self.C) + at
        if out is None:
            out = x.new_zeros(self.R, rows, D)
        out.view(-1, D).index_copy_(0, dst, src)
        return out


def _layout(
    positions: torch.Tensor, pos0: torch.Tensor, lengths: torch.Tensor, H: int, K: int, C: int,
    n_blocks: int, horizon: int, starts: torch.Tensor | None = None,
) -> _Layout | None:  # fmt: skip
    B, T = positions.shape
    dev = positions.device
    first, last = (open_rows_tensor(pos0 + d, K, n_blocks, horizon) for d in (1, lengths))
    shift = torch.where((first != last) & (lengths > 0), torch.remainder(pos0, C), 0)
    n_chunks = torch.div(shift + lengths + C - 1, C, rounding_mode="floor")
    N = int(n_chunks.max())
    if N == 0:
        return None
    users = torch.arange(1, B + 1, device=dev)
    active_t = ((n_chunks[None, :] > torch.arange(N, device=dev)[:, None]) * users).amax(1)
    offset_t = torch.cumsum(active_t, 0) - active_t
    b_idx, t_idx = (positions > 0).nonzero(as_tuple=True)
    col = shift[b_idx] + t_idx
    chunk_user = offset_t[torch.div(col, C, rounding_mode="floor")] + b_idx
    matrix = chunk_user[:, None] * H + torch.arange(H, device=dev)
    cell = (matrix * C + torch.remainder(col, C)[:, None]).flatten()
    active, offset = active_t.tolist(), offset_t.tolist()
    R = (offset[-1] + active[-1]) * H
    events = b_idx * T + t_idx
    src = events if starts is None else starts[b_idx] + t_idx
    return _Layout(C, H, R, active, offset, events, src, chunk_user, cell)


@dataclass
class _Prepared:
    """The per-(chunk, user, head) matrices of ``_prepare``: ``step`` the chunk loop's
    operands (row-sliced per chunk), ``tail`` those of the reads after the loop."""

    step: tuple[torch.Tensor, ...]
    tail: tuple[torch.Tensor, ...]


def _prepare(
    kq: torch.Tensor, vc: torch.Tensor, g: torch.Tensor, open_n: torch.Tensor, *,
    momentum: bool, qk_l2norm: bool,
) -> _Prepared:  # fmt: skip
    """The chunk algebra that does not need the state, for R' (chunk, user) pairs of H
    heads: kq [R', H, 2C, K] (k then q, unmasked), vc [R', H, C, V], g [R', H, C, 3|4] the
    gates (on, theta, alpha[, eta]; all 0 at padding), ``open_n`` [R'] the pair's open key
    rows. The inputs are not changed (a compiled graph then needs no copy-back)."""
    Rp, H, C2, K = kq.shape
    C = C2 // 2
    R = Rp * H
    row_open = torch.arange(K, device=kq.device) < open_n[:, None, None, None]  # [R', 1, 1, K]
    kq = (kq * row_open).view(R, C2, K)  # mask, then normalise
    if qk_l2norm:
        norm = torch.linalg.vector_norm(kq, dim=-1, keepdim=True)
        kq = kq * torch.rsqrt(norm.square() + L2_EPS)
    kc = kq[:, :C]
    vc = vc.reshape(R, C, -1)
    g = g.reshape(R, C, -1)
    on, th = g[..., 0], g[..., 1]
    a = 1 - g[..., 2]  # padding: 1
    e = 1 + (g[..., 3] - 1) * on if momentum else 1 - on  # no momentum: M restarts
    row_open = row_open.view(Rp, 1, K, 1).expand(Rp, H, K, 1).reshape(R, K, 1)

    A, Ep = _pair_products(torch.stack([a, e]))  # [R, C(i), C(s)] each
    a_pre, e_pre = torch.stack([a, e]).cumprod(-1)  # A_{i,0}: prod of a through i
    Ao = A * on[..., None, :]
    G = Ao @ Ep  # G_{i,s} = sum_r A_{i,r} o_r E_{r,s}; 0 for s > i
    a_prev = F.pad(a_pre[..., :-1], (1, 0), value=1.0)
    dots = torch.bmm(kq, kc.transpose(-1, -2)).mul_(th[:, None, :])  # [k~; q~] . th_s k~_s
    G_prev = F.pad(G[..., :-1, :], (0, 0, 1, 0))  # 0 for s >= i
    eye = torch.eye(C, dtype=kq.dtype, device=kq.device)
    inv = torch.linalg.solve_triangular(
        dots[:, :C] * G_prev + eye, eye.expand(R, C, C), upper=False, unitriangular=True
    )
    P = dots[:, C:] * G
    inv_a = inv * a_prev[..., None, :]  # w = inv (a_prev k S + F_prev k M - v)
    inv_v = inv @ vc
    keep_S = torch.where(row_open, a_pre[..., -1, None, None], 1.0)
    gw_S = G[..., -1, :, None] * th[..., None]  # S -= k~^T (G_{C-1,s} theta_s w_s)
    step = [kq, kc.transpose(-1, -2), inv_v, inv_a, gw_S, keep_S]
    tail = [a_pre[..., None], P]
    if momentum:
        Fv = (Ao @ e_pre[..., None]).squeeze(-1)  # F_i
        inv_F = inv * F.pad(Fv[..., :-1], (1, 0))[..., None, :]
        S_from_M = torch.where(row_open, Fv[..., -1, None, None], 0.0)
        keep_M = torch.where(row_open, e_pre[..., -1, None, None], 1.0)
        gw_M = Ep[..., -1, :, None] * th[..., None]  # M -= k~^T (E_{C-1,s} ...)
        step += [inv_F, gw_M, S_from_M, keep_M]
        tail.append(Fv[..., None])
    return _Prepared(tuple(step), tuple(tail))


def _step(
    state: torch.Tensor, reads: torch.Tensor, W: torch.Tensor, kq: torch.Tensor,
    kc_t: torch.Tensor, inv_v: torch.Tensor, inv_a: torch.Tensor, gw_S: torch.Tensor,
    keep_S: torch.Tensor, momentum: list[torch.Tensor],
) -> None:  # fmt: skip
    """One chunk for its rows (user, head): ``state`` [rows, K, V | 2V] = [S | M] in
    place; the state's reads [k~; q~] [S | M] go to ``reads``, the chunk's corrected writes
    w to ``W``. ``momentum``: (inv_F, gw_M, S_from_M, keep_M) of the momentum rule, or
    empty."""
    V = W.shape[-1]
    C = W.shape[-2]
    S, M = state[:, :, :V], state[:, :, V:]
    x = torch.bmm(kq, state, out=reads)
    w = torch.baddbmm(inv_v, inv_a, x[:, :C, :V], beta=-1.0, out=W)
    gw = state.new_empty([state.shape[0], C, state.shape[-1]])
    if len(momentum) > 0:
        w.baddbmm_(momentum[0], x[:, :C, V:])
        torch.mul(w, momentum[1], out=gw[:, :, V:])
    torch.mul(w, gw_S, out=gw[:, :, :V])
    S.mul_(keep_S)
    if len(momentum) > 0:
        S.addcmul_(M, momentum[2])
        M.mul_(momentum[3])
    state.baddbmm_(kc_t, gw, alpha=-1.0)


def _chunk_loop(
    state: torch.Tensor, reads: torch.Tensor, W: torch.Tensor, bounds: list[int],
    kq: torch.Tensor, kc_t: torch.Tensor, inv_v: torch.Tensor, inv_a: torch.Tensor,
    gw_S: torch.Tensor, keep_S: torch.Tensor, momentum: list[torch.Tensor],
) -> None:  # fmt: skip
    """``_step`` for each chunk, in order: chunk n's rows are bounds[n] .. bounds[n + 1]
    of the operands ([R, ...], ``_Prepared.step``), ``state``'s first bounds[n + 1] -
    bounds[n] rows (its users come longest first)."""
    for n in range(len(bounds) - 1):
        lo, hi = bounds[n], bounds[n + 1]
        _step(
            state[: hi - lo], reads[lo:hi], W[lo:hi], kq[lo:hi], kc_t[lo:hi], inv_v[lo:hi],
            inv_a[lo:hi], gw_S[lo:hi], keep_S[lo:hi], [t[lo:hi] for t in momentum],
        )  # fmt: skip


def _chunk_reads(
    reads: torch.Tensor, W: torch.Tensor, a_pre: torch.Tensor, P: torch.Tensor,
    *Fv: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """y of every (chunk, user, head) [R, C, V]: A_{i,0} q S + F_i q M - P W."""
    C, V = W.shape[-2:]
    Y = reads[:, C:, :V] * a_pre
    if Fv:
        Y.addcmul_(reads[:, C:, V:], Fv[0])
    return Y.baddbmm_(P, W, alpha=-1.0)


@dataclass(frozen=True)
class ChunkOps:
    """The chunked scan's algebra: ``prepare`` (``_prepare``, before the loop over chunks),
    ``loop`` (``_chunk_loop``) and ``reads`` (``_chunk_reads``, after it), plain
    (``EAGER_CHUNK_OPS``) or compiled (``compiled_chunk_ops``: the loop as TorchScript, the
    same operations; compiled by inductor, its in-place writes to a slice of the state
    became masked writes of the whole state, several times slower)."""

    prepare: Callable[..., _Prepared]
    loop: Callable[..., None]
    reads: Callable[..., torch.Tensor]


EAGER_CHUNK_OPS = ChunkOps(_prepare, _chunk_loop, _chunk_reads)


def compiled_chunk_ops(*, cpp_wrapper: bool) -> ChunkOps:
    """``ChunkOps`` compiled once for every batch (models/memory/compiled.py)."""
    return ChunkOps(
        RowsDynamic(_prepare, cpp_wrapper=cpp_wrapper),
        scripted(_chunk_loop),
        RowsDynamic(_chunk_reads, cpp_wrapper=cpp_wrapper),
    )


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
    """The reference's function without autograd, in chunks of the largest C <=
    ``chunk_size`` that divides Delta; the inputs are not changed."""
    B, T = q.shape[:2]
    y = v.new_zeros(v.shape)
    if T == 0 or B == 0:
        return y, S0.clone(), None if M0 is None else M0.clone()
    S, M = _scan(
        q, k, v, theta, eta, alpha, S0, M0, pos0, lengths, T, None, y.view(B * T, *v.shape[2:]),
        n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm, chunk_size=chunk_size,
    )  # fmt: skip
    return y, S, M


@torch.no_grad()
def memory_scan_chunk_aligned_packed(
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
    starts: torch.Tensor,
    y: torch.Tensor,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
    chunk_size: int = 16,
    ops: ChunkOps = EAGER_CHUNK_OPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``memory_scan_chunk_aligned`` on packed events: q, k [N, H, K], v [N, H, V], gates
    [N, H] hold the events of B users (S0, M0, pos0, lengths [B]) with user b's t-th event
    in row starts[b] + t. Writes each event's read into ``y`` [N, H, V] (other rows are
    left as they are) and returns the states after the events (new tensors)."""
    B = lengths.shape[0]
    T = int(lengths.max()) if B else 0
    if T == 0:
        return S0.clone(), None if M0 is None else M0.clone()
    return _scan(
        q, k, v, theta, eta, alpha, S0, M0, pos0, lengths, T, starts, y,
        n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm, chunk_size=chunk_size, ops=ops,
    )  # fmt: skip


def _scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
    eta: torch.Tensor | None, alpha: torch.Tensor, S0: torch.Tensor, M0: torch.Tensor | None,
    pos0: torch.Tensor, lengths: torch.Tensor, T: int, starts: torch.Tensor | None,
    y: torch.Tensor, *, n_blocks: int, horizon: int, qk_l2norm: bool, chunk_size: int,
    ops: ChunkOps = EAGER_CHUNK_OPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The chunked scan of B users' events, T wide: inputs right-padded [B, T, H, .]
    (``starts`` None) or packed [N, H, .]; the reads go to the events' rows of ``y`` [rows,
    H, V]; returns S, M after the events."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B = lengths.shape[0]
    H, K = q.shape[-2:]
    V = v.shape[-1]
    momentum = eta is not None and M0 is not None
    with _denormals_flushed(q.device):
        C = aligned_chunk_size(chunk_size, n_blocks, horizon)
        positions = event_positions(pos0, lengths, T)
        lay = _layout(positions, pos0, lengths, H, K, C, n_blocks, horizon, starts)
        if lay is None:
            return S0.clone(), None if M0 is None else M0.clone()
        R = lay.R
        kq = lay.place(q, 2 * C, C, out=lay.place(k, 2 * C))  # rows 0..C-1: k, C..2C-1: q
        # The Proteus mask is one per (chunk, user).
        rows_open = open_rows_tensor(positions.flatten()[lay.events], K, n_blocks, horizon)
        open_n = rows_open.new_zeros(R // H).scatter_reduce_(0, lay.chunk_user, rows_open, "amax")
        vc = lay.place(v, C)
        ones = torch.ones_like(theta)
        gates = [ones, theta, alpha] + ([eta] if momentum and eta is not None else [])
        g = lay.place(torch.stack(gates, -1), C)  # padding: all 0
        prep = ops.prepare(
            kq.view(R // H, H, 2 * C, K), vc.view(R // H, H, C, V), g.view(R // H, H, C, -1),
            open_n, momentum=momentum, qk_l2norm=qk_l2norm,
        )  # fmt: skip

        # State per (user, head): [K, 2V] = [S | M]; reads and writes share k~.
        if momentum and M0 is not None:
            state = torch.cat([S0, M0], -1)
        else:
            state = S0.clone(memory_format=torch.contiguous_format)
        state = state.reshape(B * H, K, -1)
        reads = v.new_empty(R, 2 * C, state.shape[-1])
        W = v.new_empty(R, C, V)
        bounds = [o * H for o in lay.offset] + [(lay.offset[-1] + lay.active[-1]) * H]
        ops.loop(state, reads, W, bounds, *prep.step[:6], list(prep.step[6:]))
        Y = ops.reads(reads, W, *prep.tail)
        event_reads = Y.view(-1, V).index_select(0, lay.cell).view(-1, H, V)
        y.index_copy_(0, lay.src, event_reads)
        state = state.view(B, H, K, -1)
        S_out = state[..., :V]
        M_out = state[..., V:] if momentum else M0
        return S_out, M_out
