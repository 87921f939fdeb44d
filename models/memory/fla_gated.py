"""The gated delta rule (eta None) on flash-linear-attention's kernels.

fla's per-key gated delta rule decays first and predicts with the decayed state:

    S' = diag(exp gk) S,    S_new = S' + beta k_f (v - S'^T k_f)^T,    o = S_new^T (scale q).

Ours predicts with the undecayed state: S_new = diag(a) S + theta k~ (v - S^T k~)^T with
a = 1 - alpha * m. Setting exp gk = a, k_f = k~ / (1 - alpha) (so diag(a) k_f = k~ on open
rows, and both are 0 on locked rows), beta = theta * (1 - alpha), q = q~ and scale = 1 makes
the two identical: beta k_f = theta k~ and S'^T k_f = S^T k~. This needs alpha < 1.

Variable lengths go in packed (B = 1, ``cu_seqlens``); users with no new events keep S0.
fla's kernels need CUDA; this module only imports fla when called. fla has no momentum
rule we can use, so eta must be None here.

Training (``memory_scan_fla_chunk_train``) keeps the padded [B, T] layout instead: a padding
event has k~ = q~ = 0 and gk = 0, which is an exact no-op in fla's rule too, so nothing is
packed, no value is read back to the host and fla's backward gives every gradient (q, k,
v, gk, beta, the initial state). 1 - alpha is clamped at ``KEEP_MIN`` there (the forward
form above refuses alpha = 1 instead): alpha is a sigmoid, which float32 rounds to 1 for
large logits.

Precision: fla's chunk kernels multiply float32 through Triton's default dot precision,
TF32, which put ``chunk_kda`` at 1.25e-3 relative error against the float64 reference on an
H200 (bench/results/memory_gpu_h200.json), over our 1e-3 bar. With three-pass TF32
(``TRITON_F32_DEFAULT=tf32x3``) or IEEE fp32 it is 9.9e-5 (memory_gpu_h200_fla_*.json), so
the chunk path sets ``TRITON_F32_DEFAULT=tf32x3`` for the process before its first launch
(forward and backward kernels compile after it) unless the variable is already set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from models.memory.recurrent import event_positions, masked_qk

F32_DOTS_ENV = "TRITON_F32_DEFAULT"
F32_DOTS = "tf32x3"
"""Triton's float32 dot precision for fla's chunk kernels (see the module docstring)."""


def precise_f32_dots() -> str:
    """Set ``TRITON_F32_DEFAULT`` to tf32x3 unless the user chose a value; returns it."""
    return os.environ.setdefault(F32_DOTS_ENV, F32_DOTS)


def _fla_scan(
    mode: str,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if eta is not None:
        raise ValueError(
            "fla backends cover only the gated delta rule (eta None); "
            "use backend 'triton' or 'chunk' for the momentum rule"
        )
    if mode == "chunk":
        precise_f32_dots()
    B, T, H, K = q.shape
    V = v.shape[-1]
    y = v.new_zeros(B, T, H, V)
    S = S0.clone()
    positions = event_positions(pos0, lengths, T)
    valid = (positions > 0).reshape(-1)
    busy = lengths > 0
    if not bool(busy.any()):
        return y, S, M0
    qt, kt, m = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
    keep = 1 - alpha  # [B, T, H]
    if bool((keep[positions > 0] <= 0).any()):
        raise ValueError("fla backends need alpha < 1 on every event")
    gk = torch.log1p(-alpha[..., None] * m[:, :, None, :])  # 0 on locked rows
    k_f = kt / keep[..., None]
    beta = theta * keep

    def pack(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B * T, *x.shape[2:])[valid].unsqueeze(0).float().contiguous()

    cu = torch.zeros(int(busy.sum()) + 1, dtype=torch.int64, device=q.device)
    cu[1:] = torch.cumsum(lengths[busy], 0)
    h0 = S0[busy].float().contiguous()
    args: dict[str, Any] = dict(
        q=pack(qt),
        k=pack(k_f),
        v=pack(v),
        beta=pack(beta),
        scale=1.0,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu,
    )
    if mode == "chunk":
        from fla.ops.kda import chunk_kda

        o, ht = chunk_kda(g=pack(gk), **args)
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        o, ht = fused_recurrent_gated_delta_rule(gk=pack(gk), **args)
    y.reshape(B * T, H, V)[valid] = o[0].to(y.dtype)
    S[busy] = ht.to(S.dtype)
    return y, S, M0


KEEP_MIN = 1e-6
"""Smallest 1 - alpha the training path passes to fla (k~ is divided by it)."""


def memory_scan_fla_chunk_train(
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
    kda: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gated delta rule through fla's ``chunk_kda`` with its backward pass, padded layout,
    no host synchronisation (the training path). ``kda`` replaces ``chunk_kda`` (tests pass
    fla's naive recurrent form to check the mapping); fla computes in float32."""
    if eta is not None:
        raise ValueError(
            "fla backends cover only the gated delta rule (eta None); "
            "use train backend 'triton' or 'chunk' for the momentum rule"
        )
    if kda is None:
        from fla.ops.kda import chunk_kda

        precise_f32_dots()
        kda = chunk_kda
    T = q.shape[1]
    if T == 0:
        return v.new_zeros(v.shape), S0, M0
    positions = event_positions(pos0, lengths, T)
    qt, kt, m = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
    keep = torch.clamp(1 - alpha, min=KEEP_MIN)[..., None]  # [B, T, H, 1]
    gk = torch.log(keep) * m[:, :, None, :]  # 0 on locked rows and padding
    o, ht = kda(
        q=qt.float(),
        k=(kt / keep).float(),
        v=v.float(),
        g=gk.float(),
        beta=(theta * keep[..., 0]).float(),
        scale=1.0,
        initial_state=S0.float(),
        output_final_state=True,
    )
    return o.to(v.dtype), ht.to(S0.dtype), M0


def memory_scan_fla_chunk(
    *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gated delta rule through fla's ``chunk_kda`` (autograd works through it)."""
    return _fla_scan("chunk", *args, **kwargs)


def memory_scan_fla_recurrent(
    *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gated delta rule through fla's ``fused_recurrent_gated_delta_rule`` (forward only)."""
    return _fla_scan("recurrent", *args, **kwargs)
