"""Fused Triton kernels for training: the memory rule's forward AND backward pass.

Same signature and semantics as ``naive.memory_scan_reference``, with autograd. The
Proteus mask and the L2 norm of k and q run in PyTorch before the kernel (``masked_qk``:
autograd takes their gradients); the kernel gets k~, q~, v, the gates and the number of
open rows per event, and computes the recurrence

    w   = S^T k~ - v
    M_t = e M - theta k~ w^T,   S_t = a S + o M_t      (open rows; eta None: S_t = a S - theta k~ w^T)
    y   = S_t^T q~

with a = 1 - alpha, e = eta, o = 1 on open rows and a = e = 1, o = 0 (the row kept) on
locked rows. One program owns one (user, head, block of BV value columns): the V columns
evolve independently, so K x BV tiles of S and M stay in registers while the program walks
the user's events, as in ``triton_momentum.py``.

Backward. The state cannot be run backwards (gates can be 0), so the forward kernel stores
S and M every ``checkpoint`` events ([B, H, ceil(T / checkpoint), K, V]); the backward
kernel walks these chunks of events last to first: it re-runs a chunk from its stored
state, writing the state before each event to a per-program scratch buffer ([checkpoint,
K, BV], read back by the same program, so it stays in L2), then walks the chunk's events in
reverse with the adjoints dS, dM in registers:

    dS  += q~ dy^T;  dq~ = S_t dy                       (y = S_t^T q~)
    dM  += o dS                                         (S_t = a S + o M_t)
    dalpha = -sum_open dS * S,   deta = sum_open dM * M
    dU  = -theta dM on open rows (0 on locked rows),  dtheta = -sum_open dM * k~ w^T
    dk~ = dU w + S dw,   dw = dU^T k~,   dv = -dw
    dS <- a dS + k~ dw^T,   dM <- e dM

(eta None: dU = -theta dS, no M). Gradients of k~, q~ and the gates sum over the value
blocks; each block writes its own partial sums ([NV, ...]) and PyTorch adds them. Padding
events (past ``lengths``) are skipped; their outputs and gradients are zero.

The kernels compute in the inputs' dtype (float32 in training; float64 for the exactness
tests, which run the kernels under ``TRITON_INTERPRET=1`` on the CPU). Triton is imported on
first use. ``training.py`` guards it: a kernel that fails to compile or run, forward or
backward, hands the step to the eager chunked form.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from models.memory.proteus import open_rows_tensor
from models.memory.recurrent import event_positions, masked_qk

DEFAULT_CHECKPOINT = 16
"""Events between two stored states in the forward pass (the backward re-runs each chunk)."""
Launch = tuple[int, int]
"""(value columns per program BV, warps per program) of one kernel."""
FWD_LAUNCH: Launch = (32, 4)
BWD_LAUNCH: Launch = (8, 2)
"""Compiled for an H100/H200 (sm_90) at K = V = 32 (ptxas, no GPU needed): the forward at
(32, 4) takes 127 registers per thread, so all 250 programs of an ML-1M batch (125 users x
2 heads) run at once; the backward keeps more live (dS, dM, S, M, the gate products) and
takes 167 registers at (8, 2), 213 at (32, 8), 215 at (16, 4), with spills at (32, 4).
bench/bench_train.py times alternatives (``SWEEP``). The two launches are independent: the
checkpoints hold whole K x V tiles."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@cache
def _kernels() -> tuple[Any, Any]:
    """Compile-on-demand: build the @triton.jit kernels the first time they are needed.

    K and V are compile-time constants (one compilation per layer size; the masks of a
    power-of-two K and V fold away), and the gates act through [BK] row vectors (a, e, o
    per row), which keeps fewer K x BV tiles live than 2-D selects."""
    import triton
    import triton.language as tl

    @triton.jit
    def train_fwd_kernel(
        k_ptr,
        q_ptr,
        v_ptr,
        theta_ptr,
        eta_ptr,
        alpha_ptr,
        rows_ptr,
        len_ptr,
        S0_ptr,
        M0_ptr,
        y_ptr,
        ST_ptr,
        MT_ptr,
        cS_ptr,
        cM_ptr,
        T,
        H,
        NC,
        K: tl.constexpr,
        V: tl.constexpr,
        HAS_MOMENTUM: tl.constexpr,
        CK: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n = tl.load(len_ptr + b).to(tl.int64)
        rk = tl.arange(0, BK)
        rv = tl.program_id(2) * BV + tl.arange(0, BV)
        mask_k = rk < K
        mask_v = rv < V
        tile = mask_k[:, None] & mask_v[None, :]
        # 64-bit scalar bases, 32-bit offsets within a tile (fewer registers)
        tile_off = rk[:, None] * V + rv[None, :]
        st_base = (b * H + h) * K * V
        S = tl.load(S0_ptr + st_base + tile_off, mask=tile, other=0.0)
        if HAS_MOMENTUM:
            M = tl.load(M0_ptr + st_base + tile_off, mask=tile, other=0.0)
        n_chunks = (n + CK - 1) // CK
        for c in range(0, n_chunks):
            ck_base = ((b * H + h) * NC + c) * K * V
            tl.store(cS_ptr + ck_base + tile_off, S, mask=tile)
            if HAS_MOMENTUM:
                tl.store(cM_ptr + ck_base + tile_off, M, mask=tile)
            t0 = c * CK
            t1 = tl.minimum(t0 + CK, n)
            for i in range(t0, t1):
                ev = b * T + i
                g = ev * H + h
                is_open = rk < tl.load(rows_ptr + ev)
                kk = tl.load(k_ptr + g * K + rk, mask=mask_k, other=0.0)
                qq = tl.load(q_ptr + g * K + rk, mask=mask_k, other=0.0)
                vv = tl.load(v_ptr + g * V + rv, mask=mask_v, other=0.0)
                th = tl.load(theta_ptr + g)
                a = tl.where(is_open, 1.0 - tl.load(alpha_ptr + g), 1.0)
                w = tl.sum(kk[:, None] * S, axis=0) - vv
                if HAS_MOMENTUM:
                    e = tl.where(is_open, tl.load(eta_ptr + g), 1.0)
                    o = tl.where(is_open, 1.0, 0.0)
                    M = e[:, None] * M - (th * kk)[:, None] * w[None, :]
                    S = a[:, None] * S + o[:, None] * M
                else:
                    S = a[:, None] * S - (th * kk)[:, None] * w[None, :]
                y = tl.sum(qq[:, None] * S, axis=0)
                tl.store(y_ptr + g * V + rv, y, mask=mask_v)
        tl.store(ST_ptr + st_base + tile_off, S, mask=tile)
        if HAS_MOMENTUM:
            tl.store(MT_ptr + st_base + tile_off, M, mask=tile)

    @triton.jit
    def train_bwd_kernel(
        k_ptr,
        q_ptr,
        v_ptr,
        theta_ptr,
        eta_ptr,
        alpha_ptr,
        rows_ptr,
        len_ptr,
        cS_ptr,
        cM_ptr,
        dy_ptr,
        dST_ptr,
        dMT_ptr,
        dk_ptr,
        dq_ptr,
        dv_ptr,
        dth_ptr,
        deta_ptr,
        dal_ptr,
        dS0_ptr,
        dM0_ptr,
        scS_ptr,
        scM_ptr,
        B,
        T,
        H,
        NC,
        NV,
        K: tl.constexpr,
        V: tl.constexpr,
        HAS_MOMENTUM: tl.constexpr,
        CK: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        n = tl.load(len_ptr + b).to(tl.int64)
        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        mask_k = rk < K
        mask_v = rv < V
        tile = mask_k[:, None] & mask_v[None, :]
        tile_off = rk[:, None] * V + rv[None, :]
        st_base = (b * H + h) * K * V
        dS = tl.load(dST_ptr + st_base + tile_off, mask=tile, other=0.0)
        if HAS_MOMENTUM:
            dM = tl.load(dMT_ptr + st_base + tile_off, mask=tile, other=0.0)
        sc_off = rk[:, None] * BV + tl.arange(0, BV)[None, :]
        sc_base = ((b * H + h) * NV + vb) * CK * BK * BV  # this program's scratch
        part = vb * B * T * H  # this value block's partial sums
        n_chunks = (n + CK - 1) // CK
        for cc in range(0, n_chunks):
            c = n_chunks - 1 - cc
            ck_base = ((b * H + h) * NC + c) * K * V
            S = tl.load(cS_ptr + ck_base + tile_off, mask=tile, other=0.0)
            if HAS_MOMENTUM:
                M = tl.load(cM_ptr + ck_base + tile_off, mask=tile, other=0.0)
            t0 = c * CK
            t1 = tl.minimum(t0 + CK, n)
            # Re-run the chunk, keeping the state before each event.
            for i in range(t0, t1):
                sc = sc_base + (i - t0) * BK * BV
                tl.store(scS_ptr + sc + sc_off, S)
                if HAS_MOMENTUM:
                    tl.store(scM_ptr + sc + sc_off, M)
                ev = b * T + i
                g = ev * H + h
                is_open = rk < tl.load(rows_ptr + ev)
                kk = tl.load(k_ptr + g * K + rk, mask=mask_k, other=0.0)
                vv = tl.load(v_ptr + g * V + rv, mask=mask_v, other=0.0)
                th = tl.load(theta_ptr + g)
                a = tl.where(is_open, 1.0 - tl.load(alpha_ptr + g), 1.0)
                w = tl.sum(kk[:, None] * S, axis=0) - vv
                if HAS_MOMENTUM:
                    e = tl.where(is_open, tl.load(eta_ptr + g), 1.0)
                    o = tl.where(is_open, 1.0, 0.0)
                    M = e[:, None] * M - (th * kk)[:, None] * w[None, :]
                    S = a[:, None] * S + o[:, None] * M
                else:
                    S = a[:, None] * S - (th * kk)[:, None] * w[None, :]
            tl.debug_barrier()
            # Walk the chunk backwards. S_t and M_t are never formed: only their products
            # with dy are needed (dq~), and the gate gradients are reductions.
            for j in range(0, t1 - t0):
                i = t1 - 1 - j
                sc = sc_base + (i - t0) * BK * BV
                S = tl.load(scS_ptr + sc + sc_off)
                ev = b * T + i
                g = ev * H + h
                is_open = rk < tl.load(rows_ptr + ev)
                kk = tl.load(k_ptr + g * K + rk, mask=mask_k, other=0.0)
                qq = tl.load(q_ptr + g * K + rk, mask=mask_k, other=0.0)
                vv = tl.load(v_ptr + g * V + rv, mask=mask_v, other=0.0)
                dy = tl.load(dy_ptr + g * V + rv, mask=mask_v, other=0.0)
                th = tl.load(theta_ptr + g)
                al = tl.load(alpha_ptr + g)
                w = tl.sum(kk[:, None] * S, axis=0) - vv
                # dq~ = S_t dy, S_t = a S + o M_t, M_t = e M - theta k~ w^T on open rows
                S_dy = tl.sum(S * dy[None, :], axis=1)
                Mt_dy = -th * kk * tl.sum(w * dy, axis=0)
                if HAS_MOMENTUM:
                    M = tl.load(scM_ptr + sc + sc_off)
                    et = tl.load(eta_ptr + g)
                    Mt_dy += et * tl.sum(M * dy[None, :], axis=1)
                dq = tl.where(is_open, (1.0 - al) * S_dy + Mt_dy, S_dy)
                dS += qq[:, None] * dy[None, :]
                open2 = is_open[:, None]
                dal = -tl.sum(tl.sum(tl.where(open2, dS * S, 0.0), axis=1), axis=0)
                if HAS_MOMENTUM:
                    dM += tl.where(open2, dS, 0.0)
                    G = tl.where(open2, dM, 0.0)
                    de = tl.sum(tl.sum(G * M, axis=1), axis=0)
                    tl.store(deta_ptr + part + g, de)
                else:
                    G = tl.where(open2, dS, 0.0)
                Gw = tl.sum(G * w[None, :], axis=1)  # G w: [BK]
                dth = -tl.sum(kk * Gw, axis=0)
                dw = -th * tl.sum(G * kk[:, None], axis=0)
                dk = -th * Gw + tl.sum(S * dw[None, :], axis=1)
                tl.store(dk_ptr + (part + g) * K + rk, dk, mask=mask_k)
                tl.store(dq_ptr + (part + g) * K + rk, dq, mask=mask_k)
                tl.store(dv_ptr + g * V + rv, -dw, mask=mask_v)
                tl.store(dth_ptr + part + g, dth)
                tl.store(dal_ptr + part + g, dal)
                a = tl.where(is_open, 1.0 - al, 1.0)
                dS = a[:, None] * dS + kk[:, None] * dw[None, :]
                if HAS_MOMENTUM:
                    dM = tl.where(is_open, et, 1.0)[:, None] * dM
            tl.debug_barrier()
        tl.store(dS0_ptr + st_base + tile_off, dS, mask=tile)
        if HAS_MOMENTUM:
            tl.store(dM0_ptr + st_base + tile_off, dM, mask=tile)

    return train_fwd_kernel, train_bwd_kernel


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton training kernels need CUDA tensors (got one on {x.device}); "
            "use train backend 'chunk' on CPU"
        )


def _blocks(K: int, V: int, block_v: int) -> tuple[int, int, int]:
    """(BK, BV, number of value blocks)."""
    BV = min(_next_pow2(V), block_v)
    return _next_pow2(K), BV, -(-V // BV)


class TrainScanFn(torch.autograd.Function):
    """(k~, q~, v, theta, eta, alpha, S0, M0, rows, lengths) -> (y, S, M) on the
    kernels; eta, M0 None for the gated delta rule (M is then returned as None). All float
    inputs share one dtype; ``rows`` [B, T] (int32) is the number of open rows per event
    (0 at padding)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kt: torch.Tensor,
        qt: torch.Tensor,
        v: torch.Tensor,
        theta: torch.Tensor,
        eta: torch.Tensor | None,
        alpha: torch.Tensor,
        S0: torch.Tensor,
        M0: torch.Tensor | None,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        checkpoint: int,
        fwd: Launch,
        bwd: Launch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        B, T, H, K = kt.shape
        V = v.shape[-1]
        momentum = eta is not None and M0 is not None
        BK, BV, NV = _blocks(K, V, fwd[0])
        NC = max(1, -(-T // checkpoint))
        y = torch.zeros_like(v)
        S = torch.empty_like(S0)
        M = torch.empty_like(S0) if momentum else None
        cS = S0.new_empty(B, H, NC, K, V)
        cM = S0.new_empty(B, H, NC, K, V) if momentum else None
        fwd_kernel, _ = _kernels()
        fwd_kernel[(B, H, NV)](
            kt, qt, v, theta, eta if momentum else theta, alpha, rows, lengths,
            S0, M0 if momentum else S0, y, S, M if momentum else S,
            cS, cM if momentum else cS,
            T, H, NC,
            K=K, V=V, HAS_MOMENTUM=momentum, CK=checkpoint, BK=BK, BV=BV, num_warps=fwd[1],
        )  # fmt: skip
        ctx.save_for_backward(kt, qt, v, theta, eta, alpha, S0, M0, rows, lengths, cS, cM)
        ctx.sizes = (checkpoint, NC, bwd)
        return y, S, M

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dy: torch.Tensor | None, dS: torch.Tensor | None, dM: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        kt, qt, v, theta, eta, alpha, S0, M0, rows, lengths, cS, cM = ctx.saved_tensors
        checkpoint, NC, bwd = ctx.sizes
        momentum = eta is not None and M0 is not None
        B, T, H, K = kt.shape
        V = v.shape[-1]
        BK, BV, NV = _blocks(K, V, bwd[0])
        dy = torch.zeros_like(v) if dy is None else dy.contiguous()
        dS = torch.zeros_like(S0) if dS is None else dS.contiguous()
        dM = dS if not momentum else torch.zeros_like(S0) if dM is None else dM.contiguous()
        # Per value block partial sums of the k~, q~ and gate gradients; zero at padding.
        dk = kt.new_zeros(NV, B, T, H, K)
        dq = kt.new_zeros(NV, B, T, H, K)
        dth = theta.new_zeros(NV, B, T, H)
        dal = theta.new_zeros(NV, B, T, H)
        deta = theta.new_zeros(NV, B, T, H) if momentum else dth
        dv = torch.zeros_like(v)
        dS0 = torch.empty_like(S0)
        dM0 = torch.empty_like(S0) if momentum else dS0
        scS = S0.new_empty(B * H * NV, checkpoint, BK, BV)
        scM = S0.new_empty(B * H * NV, checkpoint, BK, BV) if momentum else scS
        _, bwd_kernel = _kernels()
        bwd_kernel[(B, H, NV)](
            kt, qt, v, theta, eta if momentum else theta, alpha, rows, lengths,
            cS, cM if momentum else cS, dy, dS, dM,
            dk, dq, dv, dth, deta, dal, dS0, dM0, scS, scM,
            B, T, H, NC, NV,
            K=K, V=V, HAS_MOMENTUM=momentum, CK=checkpoint, BK=BK, BV=BV, num_warps=bwd[1],
        )  # fmt: skip
        return (
            dk.sum(0),
            dq.sum(0),
            dv,
            dth.sum(0),
            deta.sum(0) if momentum else None,
            dal.sum(0),
            dS0,
            dM0 if momentum else None,
            None,
            None,
            None,
            None,
            None,
        )


def memory_scan_triton_train(
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
    checkpoint: int = DEFAULT_CHECKPOINT,
    fwd: Launch = FWD_LAUNCH,
    bwd: Launch = BWD_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The common backend signature on the training kernels, with autograd. Computes in
    float64 when any float input is float64, else in float32; returns y in v's dtype and
    S, M in S0's. No host synchronisation. ``checkpoint`` (events between stored states),
    ``fwd`` and ``bwd`` (value columns per program, warps) tune the launches."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if S0.shape != (B, H, K, V):
        raise ValueError(f"S0 must be [B={B}, H={H}, K={K}, V={V}], got {tuple(S0.shape)}")
    if checkpoint < 1 or min(*fwd, *bwd) < 1:
        raise ValueError("checkpoint and the launch sizes must be >= 1")
    _check_device(q)
    momentum = eta is not None and M0 is not None
    if T == 0:
        return v.new_zeros(v.shape), S0, M0
    floats = [x for x in (q, k, v, theta, eta, alpha, S0, M0) if x is not None]
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in floats) else torch.float32
    positions = event_positions(pos0, lengths, T)
    qt, kt, _ = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
    rows = open_rows_tensor(positions, K, n_blocks, horizon).to(torch.int32).contiguous()

    def prep(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(dtype).contiguous()

    y, S, M = TrainScanFn.apply(
        prep(kt), prep(qt), prep(v), prep(theta), prep(eta) if momentum else None,
        prep(alpha), prep(S0), prep(M0) if momentum else None, rows,
        lengths.clamp(0, T).to(torch.int32).contiguous(), checkpoint, fwd, bwd,
    )  # fmt: skip
    return y.to(v.dtype), S.to(S0.dtype), (M.to(M0.dtype) if momentum and M0 is not None else M0)
