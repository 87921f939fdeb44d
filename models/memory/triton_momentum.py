"""Fused Triton kernel for the memory rule (forward only: ingest and ranking reads).

One program owns one (sequence, head, block of BV value columns): the rule treats the V
columns independently, so the K x BV tiles of S and M stay in registers (fp32) while the
program walks the sequence's events in order. The Proteus mask is computed in the kernel
from the sequence's start position, t = pos0 + i + 1. Both the momentum rule and the gated
delta rule (eta None) are covered.

Two entry points:
- ``memory_ingest_triton``: packed variable-length events ([total, H, ...] with
  ``cu_seqlens``), state gathered from and written back IN PLACE to a slab
  [N_slab, H, K, V] through ``slots`` [B]. Slots must be distinct.
- ``memory_scan_triton``: the common backend signature (padded [B, T, ...], S0/M0).

Triton is imported on first use, so this module imports on machines without it. The
kernel runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from models.memory.naive import L2_EPS
from models.memory.proteus import schedule_delta


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@cache
def _kernel() -> Any:
    """Compile-on-demand: build the @triton.jit kernel the first time it is needed."""
    import triton
    import triton.language as tl

    @triton.jit
    def memory_fwd_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        theta_ptr,
        eta_ptr,
        alpha_ptr,
        y_ptr,
        S_ptr,
        M_ptr,
        seq_start_ptr,
        seq_len_ptr,
        pos0_ptr,
        slot_ptr,
        H,
        K,
        V,
        delta,
        d_rows,
        n_blocks,
        eps,
        HAS_MOMENTUM: tl.constexpr,
        QK_L2NORM: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        start = tl.load(seq_start_ptr + b).to(tl.int64)
        n = tl.load(seq_len_ptr + b).to(tl.int64)
        p0 = tl.load(pos0_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        mask_k = rk < K
        mask_v = rv < V
        tile = mask_k[:, None] & mask_v[None, :]
        st_off = ((slot * H + h) * K + rk[:, None]).to(tl.int64) * V + rv[None, :]
        S = tl.load(S_ptr + st_off, mask=tile, other=0.0).to(tl.float32)
        if HAS_MOMENTUM:
            M = tl.load(M_ptr + st_off, mask=tile, other=0.0).to(tl.float32)
        for i in range(0, n):
            ev = start + i
            t = p0 + i + 1
            kb = tl.minimum(1 + (t - 1) // delta, n_blocks)
            rows = tl.where(kb >= n_blocks, K, kb * d_rows)
            is_open = rk < rows
            gate = ev * H + h
            kk = tl.load(k_ptr + gate * K + rk, mask=is_open, other=0.0).to(tl.float32)
            qq = tl.load(q_ptr + gate * K + rk, mask=is_open, other=0.0).to(tl.float32)
            if QK_L2NORM:
                kk = kk * (1.0 / tl.sqrt(tl.sum(kk * kk, axis=0) + eps))
                qq = qq * (1.0 / tl.sqrt(tl.sum(qq * qq, axis=0) + eps))
            vv = tl.load(v_ptr + gate * V + rv, mask=mask_v, other=0.0).to(tl.float32)
            th = tl.load(theta_ptr + gate).to(tl.float32)
            al = tl.load(alpha_ptr + gate).to(tl.float32)
            w = tl.sum(kk[:, None] * S, axis=0) - vv
            u = kk[:, None] * w[None, :]
            if HAS_MOMENTUM:
                et = tl.load(eta_ptr + gate).to(tl.float32)
                M_new = et * M - th * u
                S_new = (1.0 - al) * S + M_new
                M = tl.where(is_open[:, None], M_new, M)
            else:
                S_new = (1.0 - al) * S - th * u
            S = tl.where(is_open[:, None], S_new, S)
            y = tl.sum(qq[:, None] * S, axis=0)
            tl.store(y_ptr + gate * V + rv, y, mask=mask_v)
        tl.store(S_ptr + st_off, S, mask=tile)
        if HAS_MOMENTUM:
            tl.store(M_ptr + st_off, M, mask=tile)

    return memory_fwd_kernel


def check_scan_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S0: torch.Tensor,
    pos0: torch.Tensor,
    lengths: torch.Tensor,
    n_blocks: int,
    horizon: int,
) -> None:
    """The padded backend signature's shapes, devices, lengths and schedule, checked before
    a Triton launch (``memory_scan_triton``, ``triton_chunk.memory_scan_triton_chunk``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if S0.shape != (B, H, K, V):
        raise ValueError(f"S0 must be [B={B}, H={H}, K={K}, V={V}], got {tuple(S0.shape)}")
    if lengths.shape != (B,) or pos0.shape != (B,):
        raise ValueError("pos0 and lengths must be [B]")
    _check_device(q, k, v, S0, pos0, lengths)
    if bool((lengths < 0).any()) or bool((lengths > T).any()):
        raise ValueError(f"lengths must lie in 0..T={T}")
    if not 1 <= n_blocks <= K or horizon < 1:
        raise ValueError(f"need 1 <= n_blocks <= K={K} and horizon >= 1")


def _check_device(*tensors: torch.Tensor) -> None:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for x in tensors:
        if x.device.type != "cuda" and not interpret:
            raise ValueError(
                f"the triton memory kernel needs CUDA tensors (got one on {x.device}); "
                "use backend 'recurrent' on CPU"
            )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    S_slab: torch.Tensor,
    M_slab: torch.Tensor | None,
    seq_start: torch.Tensor,
    seq_len: torch.Tensor,
    pos0: torch.Tensor,
    slots: torch.Tensor,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool,
    block_v: int,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Kernel launch on packed [total, H, ...] events; returns y [total, H, V] (fp32)."""
    total, H, K = q.shape
    V = v.shape[-1]
    y = torch.zeros(total, H, V, dtype=torch.float32, device=q.device)
    B = slots.shape[0]
    if B == 0 or total == 0:
        return y
    momentum = eta is not None and M_slab is not None
    BV = min(_next_pow2(V), block_v)
    if num_warps is None:
        # Measured on an H200 (bench/experiments/memory_gpu_h200_triton_sweep.json): one warp
        # per program wins for sequences of several events, two for single events.
        num_warps = 1 if total >= 4 * B else 2
    grid = (B, H, -(-V // BV))
    _kernel()[grid](
        q,
        k,
        v,
        theta,
        eta if momentum else theta,
        alpha,
        y,
        S_slab,
        M_slab if momentum else S_slab,
        seq_start,
        seq_len,
        pos0,
        slots,
        H,
        K,
        V,
        schedule_delta(n_blocks, horizon),
        K // n_blocks,
        n_blocks,
        L2_EPS,
        HAS_MOMENTUM=momentum,
        QK_L2NORM=qk_l2norm,
        BK=_next_pow2(K),
        BV=BV,
        num_warps=num_warps,
    )
    return y


def memory_ingest_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pos0: torch.Tensor,
    S_slab: torch.Tensor,
    M_slab: torch.Tensor | None,
    slots: torch.Tensor,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
    block_v: int = 32,
    num_warps: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Apply packed events of B users to their slab rows in place; returns y [total, H, V].

    q, k: [total, H, K]; v: [total, H, V]; theta, eta, alpha: [total, H]; cu_seqlens: [B+1]
    int (events of user b are cu_seqlens[b]:cu_seqlens[b+1]); pos0: [B] events already
    applied; S_slab, M_slab: [N_slab, H, K, V] float32 contiguous; slots: [B] distinct rows
    of the slab. eta None: gated delta rule, M_slab is not touched. ``validate=False``
    skips the checks that read values back from the device (slot range, distinctness).
    ``block_v`` (value columns per program) and ``num_warps`` (None: by events per user)
    tune the launch.
    """
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [total, H, K] alike, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    total, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (total, H):
        raise ValueError(f"v must be [total={total}, H={H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    for name, g in (("theta", theta), ("alpha", alpha), ("eta", eta)):
        if g is not None and g.shape != (total, H):
            raise ValueError(f"{name} must be [total={total}, H={H}], got {tuple(g.shape)}")
    if S_slab.dim() != 4 or S_slab.shape[1:] != (H, K, V):
        raise ValueError(f"S_slab must be [N, H={H}, K={K}, V={V}], got {tuple(S_slab.shape)}")
    if eta is not None and (M_slab is None or M_slab.shape != S_slab.shape):
        raise ValueError("the momentum rule (eta given) needs M_slab shaped like S_slab")
    for name, s in (("S_slab", S_slab), ("M_slab", M_slab)):
        if s is not None and (s.dtype != torch.float32 or not s.is_contiguous()):
            raise ValueError(f"{name} must be contiguous float32 (got {s.dtype})")
    B = slots.shape[0]
    if slots.dim() != 1 or pos0.shape != (B,) or cu_seqlens.shape != (B + 1,):
        raise ValueError(
            f"slots [B], pos0 [B] and cu_seqlens [B+1] disagree: {tuple(slots.shape)}, "
            f"{tuple(pos0.shape)}, {tuple(cu_seqlens.shape)}"
        )
    if not 1 <= n_blocks <= K or horizon < 1:
        raise ValueError(f"need 1 <= n_blocks <= K={K} and horizon >= 1")
    _check_device(q, k, v, S_slab, slots, cu_seqlens, pos0)
    if validate and B:
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
            raise ValueError(f"cu_seqlens must run from 0 to total={total}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        if int(slots.min()) < 0 or int(slots.max()) >= S_slab.shape[0]:
            raise ValueError(f"slots out of range for a slab of {S_slab.shape[0]} rows")
        if torch.unique(slots).numel() != B:
            raise ValueError("slots must be distinct (two programs would race on one row)")
        if bool((pos0 < 0).any()):
            raise ValueError("pos0 must be >= 0")
    seq_start = cu_seqlens[:-1].contiguous()
    seq_len = (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()
    c = [x.contiguous() for x in (q, k, v, theta, alpha)]
    return _launch(
        c[0], c[1], c[2], c[3], None if eta is None else eta.contiguous(), c[4],
        S_slab, M_slab, seq_start, seq_len, pos0.contiguous(), slots.contiguous(),
        n_blocks, horizon, qk_l2norm, block_v, num_warps,
    )  # fmt: skip


def memory_scan_triton(
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
    block_v: int = 32,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The common backend signature on the fused kernel (no autograd; fp32 inside)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_scan_inputs(q, k, v, S0, pos0, lengths, n_blocks, horizon)
    momentum = eta is not None and M0 is not None
    S = S0.detach().to(torch.float32).contiguous().clone()
    M = M0.detach().to(torch.float32).contiguous().clone() if momentum and M0 is not None else None
    dev = q.device
    # Padded layout: user b's events sit at b*T + i for i < lengths[b]; padding is skipped
    # and its y stays zero.
    seq_start = torch.arange(B, device=dev, dtype=torch.int64) * T
    gates = [x.reshape(B * T, H).contiguous() for x in (theta, alpha)]
    y = _launch(
        q.reshape(B * T, H, K).contiguous(),
        k.reshape(B * T, H, K).contiguous(),
        v.reshape(B * T, H, V).contiguous(),
        gates[0],
        eta.reshape(B * T, H).contiguous() if momentum and eta is not None else None,
        gates[1],
        S,
        M,
        seq_start,
        lengths.to(torch.int64).contiguous(),
        pos0.to(torch.int64).contiguous(),
        torch.arange(B, device=dev, dtype=torch.int64),
        n_blocks,
        horizon,
        qk_l2norm,
        block_v,
        num_warps,
    )
    return (
        y.reshape(B, T, H, V).to(v.dtype),
        S.to(S0.dtype),
        M.to(M0.dtype) if M is not None and M0 is not None else M0,
    )
