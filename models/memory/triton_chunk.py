"""Chunked Triton kernel for the memory rule (forward only: ingest and ranking reads).

Measured on an H200 (bench/results/chunk_kernel_h200.json) it is slower than the
sequential ``triton_momentum`` kernel at these state sizes (0.46-0.91x), so ``auto`` never
picks it; it is available by name (``memory.backend = triton_chunk``).

The plain reference is ``naive.memory_scan_reference`` (one user, one event at a time);
the algebra is that of ``chunk_aligned.py`` (docs/memory.md, ``chunk_aligned``), here
inside one kernel:

    k~ = m * k, q~ = m * q (then L2 norm);  u = k~ (k~^T S - v)^T
    M <- eta M - theta u;  S <- (1 - alpha m) S + M;  y = S^T q~

One program owns one (user, head, block of BV value columns), as in ``triton_momentum.py``,
and keeps the K x BV tiles of S and M in registers (fp32; fp64 for float64 inputs, which
only the interpreter tests use). It walks the user's events in chunks of at most C: a chunk
also ends where the Proteus mask changes (the position t reaches 1 + j Delta), so inside a
chunk every row is open for all events or locked for all. The gates are then scalars per
event: a = 1 - alpha, e = eta (0 without momentum), o = 1, and slots past the chunk's end
are no-ops (a = e = 1, o = 0, k~ = q~ = 0). Per chunk, with K, Q, V its [C, K|V] rows,
A_{i,s} = prod_{r=s+1..i} a_r and E likewise (cumulative products, never ratios),
G = (A diag(o)) E, F_i = sum_r A_{i,r} o_r prod_{r'<=r} e_{r'}:

    W   = (I + L)^-1 (diag(A_{i-1,0}) K S0 + diag(F_{i-1}) K M0 - V),  L = (K K^T) . G_prev . theta
    Y   = diag(A_{i,0}) Q S0 + diag(F_i) Q M0 - (Q K^T . G . theta) W
    S_C = A_{C-1,0} S0 + F_{C-1} M0 - K^T (G_{C-1,s} theta_s w_s)
    M_C = E_{C-1,0} M0 - K^T (E_{C-1,s} theta_s w_s)

(locked rows: factors 1, 1 and 0, and k~ = 0 there, so they keep their bits). The [C, C]
gate algebra and the triangular solve run on registers; the state reads (K S, Q S, K M,
Q M) and the rank-C writes are ``tl.dot`` (tensor cores on the GPU). The solve is forward
substitution (``solve="subst"``: C - 1 row steps) or doubling (``"doubling"``: L is
nilpotent, so (I + L)^-1 = prod_m (I + (-L)^(2^m)) over m < log2 C, 2 log2(C) - 2 [C, C]
matmuls); both are exact algebra, and under the interpreter (float32 dots computed exactly
in float32) both are about 2e-7 relative from the float64 oracle. On the GPU float32 dots
run at ``input_precision``: tf32x3 (default; three TF32 passes, about float32 accuracy),
tf32x3m (the same three passes with the operands split in the kernel, ``dot``: a split
used by several products is computed once, about 15 % fewer instructions per chunk) or
tf32 (one pass, faster, less precise: the GPU benchmark checks it). One warp per program
by default: the dots have 16 rows, and more warps mostly repeat the same work.

``memory_scan_triton_chunk`` has the common backend signature (padded [B, T, ...], S0/M0).
Triton is imported on first use; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from models.memory.naive import L2_EPS
from models.memory.proteus import schedule_delta
from models.memory.triton_momentum import _next_pow2, check_scan_inputs

DEFAULT_CHUNK = 16
DOT_PRECISIONS = ("tf32x3", "tf32", "ieee", "tf32x3m")
SOLVES = ("subst", "doubling")
"""The chunk's unit lower-triangular solve: forward substitution (C - 1 row steps on
registers) or doubling (2 log2(C) - 2 [C, C] matmuls)."""
LAST_LAUNCH: dict[str, Any] = {}
"""Registers and spills per thread of the last launch's compiled kernel (where Triton
reports them; the benchmark records them)."""
MIN_DOT = 16
"""tl.dot wants every dimension >= 16: K, V blocks and the chunk are padded up to it."""


dot: Any = None
"""The kernel's dot product (a @ b at a precision), a @triton.jit function built with it."""


@cache
def _kernel() -> Any:
    """Compile-on-demand: build the @triton.jit kernel the first time it is needed."""
    import triton
    import triton.language as tl

    global dot  # the kernel calls it by its module-level name (the interpreter needs that)

    @triton.jit
    def dot(a, b, PREC: tl.constexpr, DT: tl.constexpr):
        """a @ b at PREC; "tf32x3m": three TF32 passes with the operands split here (hi: the
        float32 with its low 13 mantissa bits cleared, exact in TF32; lo = x - hi), so a
        split shared by several products is computed once."""
        if PREC == "tf32x3m":
            a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            out = tl.dot(a_hi, b - b_hi, input_precision="tf32", out_dtype=DT)
            out = tl.dot(a - a_hi, b_hi, out, input_precision="tf32", out_dtype=DT)
            return tl.dot(a_hi, b_hi, out, input_precision="tf32", out_dtype=DT)
        else:
            return tl.dot(a, b, input_precision=PREC, out_dtype=DT)

    @triton.jit
    def memory_chunk_fwd_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        theta_ptr,
        eta_ptr,
        alpha_ptr,
        y_ptr,
        S_ptr,
        M_ptr,
        seq_len_ptr,
        pos0_ptr,
        T,
        H,
        K,
        V,
        delta,
        d_rows,
        n_blocks,
        eps,
        HAS_MOMENTUM: tl.constexpr,
        QK_L2NORM: tl.constexpr,
        C: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        DT: tl.constexpr,
        PREC: tl.constexpr,
        DOUBLING: tl.constexpr,
        LOG_C: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        n = tl.load(seq_len_ptr + b).to(tl.int64)
        p0 = tl.load(pos0_ptr + b).to(tl.int64)
        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        rc = tl.arange(0, C)
        mask_k = rk < K
        mask_v = rv < V
        tile = mask_k[:, None] & mask_v[None, :]
        st_off = ((b * H + h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
        S = tl.load(S_ptr + st_off, mask=tile, other=0.0).to(DT)
        if HAS_MOMENTUM:
            M = tl.load(M_ptr + st_off, mask=tile, other=0.0).to(DT)
        lower = rc[:, None] >= rc[None, :]  # [C(i), C(s)]: s <= i
        after = rc[:, None] > rc[None, :]  # s < i
        eye = (rc[:, None] == rc[None, :]).to(DT)
        last = (rc == C - 1).to(DT)
        i0 = n * 0
        while i0 < n:
            # The chunk: at most C events, ending where the Proteus mask changes.
            t0 = p0 + i0 + 1
            kb = tl.minimum(1 + (t0 - 1) // delta, n_blocks)
            rows = tl.where(kb >= n_blocks, K, kb * d_rows)
            change = tl.where(kb >= n_blocks, C, 1 + kb * delta - t0)
            cl = tl.minimum(tl.minimum(n - i0, C), change)
            valid = rc < cl
            ev = b * T + i0 + rc  # [C] event rows (padded layout)
            gate = ev * H + h
            kq_mask = valid[:, None] & (rk < rows)[None, :]
            qk_off = gate[:, None] * K + rk[None, :]
            kc = tl.load(k_ptr + qk_off, mask=kq_mask, other=0.0).to(DT)
            qc = tl.load(q_ptr + qk_off, mask=kq_mask, other=0.0).to(DT)
            if QK_L2NORM:
                kc = kc * (1.0 / tl.sqrt(tl.sum(kc * kc, axis=1) + eps))[:, None]
                qc = qc * (1.0 / tl.sqrt(tl.sum(qc * qc, axis=1) + eps))[:, None]
            v_off = gate[:, None] * V + rv[None, :]
            vc = tl.load(v_ptr + v_off, mask=valid[:, None] & mask_v[None, :], other=0.0)
            vc = vc.to(DT)
            th = tl.load(theta_ptr + gate, mask=valid, other=0.0).to(DT)
            a = tl.where(valid, 1.0 - tl.load(alpha_ptr + gate, mask=valid, other=0.0).to(DT), 1.0)
            o = valid.to(DT)
            if HAS_MOMENTUM:
                e = tl.where(valid, tl.load(eta_ptr + gate, mask=valid, other=0.0).to(DT), 1.0)
            else:
                e = 1.0 - o  # M restarts at every event: S_t = a S - theta u
            # Pair products P[i, s] = prod_{r=s+1..i} g_r (0 above the diagonal).
            A = tl.where(lower, tl.cumprod(tl.where(after, a[:, None], 1.0), axis=0), 0.0)
            Ep = tl.where(lower, tl.cumprod(tl.where(after, e[:, None], 1.0), axis=0), 0.0)
            a_pre = tl.cumprod(a, axis=0)  # A_{i,0} incl. slot 0: prod_{r<=i} a_r
            Ao = A * o[None, :]
            G = dot(Ao, Ep, PREC, DT)
            # x_prev[i] = x[i - 1] for the [C] vectors: shift[i, s] = 1 iff s = i - 1.
            shift = (rc[:, None] == rc[None, :] + 1).to(DT)
            a_prev = tl.sum(shift * a_pre[None, :], axis=1) + (rc == 0).to(DT)
            kth = kc * th[:, None]
            dots_k = dot(kc, tl.trans(kth), PREC, DT)
            dots_q = dot(qc, tl.trans(kth), PREC, DT)
            # L[i, s] = dots_k[i, s] G[i - 1, s] (strictly lower); G[i - 1, s] from
            # A_prev[i, r] = A[i - 1, r] = prod_{r' = r+1..i-1} a_r' (r < i), a products too.
            a_sh = tl.sum(shift * a[None, :], axis=1) + (rc == 0).to(DT)  # a_{i-1}; 1 at 0
            A_prev = tl.cumprod(tl.where(rc[:, None] > rc[None, :] + 1, a_sh[:, None], 1.0), axis=0)
            A_prev = tl.where(after, A_prev, 0.0)
            G_prev = dot(A_prev * o[None, :], Ep, PREC, DT)
            Lm = dots_k * G_prev
            # (I + L)^-1
            if DOUBLING:
                # L is nilpotent (L^C = 0): (I + L)^-1 = prod_m (I + (-L)^(2^m)), m < log2 C.
                Nm = -Lm
                inv = eye + Nm
                for _ in tl.static_range(LOG_C - 1):
                    Nm = dot(Nm, Nm, PREC, DT)
                    inv += dot(inv, Nm, PREC, DT)
            else:
                # Forward substitution: row i of the inverse = e_i - sum_{s<i} L[i, s] inv[s].
                inv = eye
                for i in tl.static_range(1, C):
                    l_i = tl.sum(tl.where(rc[:, None] == i, Lm, 0.0), axis=0)  # [C(s)]
                    row = tl.sum(l_i[:, None] * inv, axis=0)
                    inv = tl.where(rc[:, None] == i, inv - row[None, :], inv)
            # The state reads and the chunk's corrected writes W.
            xk = dot(kc, S, PREC, DT)
            xq = dot(qc, S, PREC, DT)
            Rm = a_prev[:, None] * xk - vc
            Yq = a_pre[:, None] * xq
            if HAS_MOMENTUM:
                e_pre = tl.cumprod(e, axis=0)
                Fv = tl.sum(Ao * e_pre[None, :], axis=1)  # F_i
                F_prev = tl.sum(shift * Fv[None, :], axis=1)
                Rm += F_prev[:, None] * dot(kc, M, PREC, DT)
                Yq += Fv[:, None] * dot(qc, M, PREC, DT)
            W = dot(inv, Rm, PREC, DT)
            y = Yq - dot(dots_q * G, W, PREC, DT)
            y_mask = valid[:, None] & mask_v[None, :]
            tl.store(y_ptr + v_off, y.to(y_ptr.dtype.element_ty), mask=y_mask)
            # The state at the chunk's end.
            is_open = (rk < rows)[:, None]
            kt = tl.trans(kc)
            gS = tl.sum(G * last[:, None], axis=0) * th  # G_{C-1,s} theta_s
            a_all = tl.sum(a_pre * last, axis=0)
            S_next = tl.where(is_open, a_all * S, S)
            S_next -= dot(kt, gS[:, None] * W, PREC, DT)
            if HAS_MOMENTUM:
                gM = tl.sum(Ep * last[:, None], axis=0) * th  # E_{C-1,s} theta_s
                F_all = tl.sum(Fv * last, axis=0)
                e_all = tl.sum(e_pre * last, axis=0)
                S_next += tl.where(is_open, F_all * M, 0.0)
                M = tl.where(is_open, e_all * M, M)
                M -= dot(kt, gM[:, None] * W, PREC, DT)
            S = S_next
            i0 += cl
        tl.store(S_ptr + st_off, S.to(S_ptr.dtype.element_ty), mask=tile)
        if HAS_MOMENTUM:
            tl.store(M_ptr + st_off, M.to(M_ptr.dtype.element_ty), mask=tile)

    return memory_chunk_fwd_kernel


def memory_scan_triton_chunk(
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
    chunk_size: int = DEFAULT_CHUNK,
    block_v: int = 32,
    num_warps: int = 1,
    input_precision: str = "tf32x3",
    solve: str = "subst",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The common backend signature on the chunked kernel (no autograd).

    q, k: [B, T, H, K]; v: [B, T, H, V]; theta, eta, alpha: [B, T, H]; S0, M0: [B, H, K, V];
    pos0, lengths: [B]. eta (or M0) None: the gated delta rule, M0 returned as given.
    Computes in float32 (float64 for float64 inputs). ``chunk_size`` (a power of two, >= 16)
    is the most events per chunk, ``block_v`` the value columns per program,
    ``input_precision`` that of the float32 dots (``DOT_PRECISIONS``), ``solve`` the
    chunk's triangular solve (``SOLVES``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k [B, T, H, K] and v [B, T, H, V] disagree: {tuple(v.shape)}")
    for name, g in (("theta", theta), ("alpha", alpha), ("eta", eta)):
        if g is not None and g.shape != (B, T, H):
            raise ValueError(f"{name} must be [B={B}, T={T}, H={H}], got {tuple(g.shape)}")
    check_scan_inputs(q, k, v, S0, pos0, lengths, n_blocks, horizon)
    if chunk_size < MIN_DOT or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {MIN_DOT}, got {chunk_size}")
    if input_precision not in DOT_PRECISIONS:
        raise ValueError(f"input_precision must be one of {DOT_PRECISIONS}")
    if solve not in SOLVES:
        raise ValueError(f"solve must be one of {SOLVES}")
    momentum = eta is not None and M0 is not None
    wide = q.dtype == torch.float64
    dt = torch.float64 if wide else torch.float32
    S = S0.detach().to(dt).contiguous().clone()
    M = M0.detach().to(dt).contiguous().clone() if momentum and M0 is not None else None
    y = torch.zeros(B, T, H, V, dtype=dt, device=q.device)
    if B == 0 or T == 0:
        return y.to(v.dtype), S.to(S0.dtype), M.to(S0.dtype) if M is not None else M0
    import triton.language as tl

    BV = max(MIN_DOT, min(_next_pow2(V), _next_pow2(block_v)))
    grid = (B, H, -(-V // BV))
    c = [x.contiguous() for x in (q, k, v, theta, alpha)]
    compiled = _kernel()[grid](
        c[0], c[1], c[2], c[3], eta.contiguous() if momentum and eta is not None else c[3],
        c[4], y, S, M if M is not None else S,
        lengths.to(torch.int64).contiguous(), pos0.to(torch.int64).contiguous(),
        T, H, K, V, schedule_delta(n_blocks, horizon), K // n_blocks, n_blocks, L2_EPS,
        HAS_MOMENTUM=momentum, QK_L2NORM=qk_l2norm, C=chunk_size,
        BK=max(MIN_DOT, _next_pow2(K)), BV=BV, DT=tl.float64 if wide else tl.float32,
        PREC="ieee" if wide else input_precision, DOUBLING=solve == "doubling",
        LOG_C=chunk_size.bit_length() - 1, num_warps=num_warps,
    )  # fmt: skip
    LAST_LAUNCH.update(
        n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None)
    )
    return (
        y.to(v.dtype),
        S.to(S0.dtype),
        M.to(M0.dtype) if M is not None and M0 is not None else M0,
    )
