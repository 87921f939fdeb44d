"""Vectorised recurrent path: many users with different positions and lengths, one time
step per iteration, all users and heads at once. The CPU path for ingest and ranking.

Same signature and semantics as ``naive.memory_scan_reference``. Padding events (index >=
lengths[b]) get an all-zero Proteus mask, which makes them exact no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from models.memory.naive import l2norm
from models.memory.proteus import proteus_row_mask

_process_flushes_denormals = False


def flush_denormals() -> bool:
    """Opt this process in to flushing denormal floats to zero on the CPU.

    Memory states decay towards zero (forget gate, momentum), and x86 arithmetic on
    denormals is about 100x slower (docs/ingest.md has the measured effect on CPU ingest).
    Values under 1.2e-38 become 0, far below what the model can tell apart. The processor
    flag belongs to a thread: the CPU scan sets it in whatever thread runs it and keeps it
    only in processes that opted in (the ``recmem`` command does at start); elsewhere it
    restores the default after each scan, so a library user's other float code is not
    affected. Returns False where the CPU does
    not support it."""
    global _process_flushes_denormals
    _process_flushes_denormals = True
    return bool(torch.set_flush_denormal(True))


def process_flushes_denormals() -> bool:
    """Whether this process opted in (``flush_denormals``): threads it starts to compute
    memories should then flush too, before their first parallel operation (the workers of a
    thread's OpenMP team copy its floating-point flags when they are created)."""
    return _process_flushes_denormals


@contextlib.contextmanager
def _denormals_flushed(device: torch.device) -> Iterator[None]:
    """Flush denormals in this thread while the CPU scan runs (decayed states would crawl);
    afterwards restore the default unless the process opted in (``flush_denormals``)."""
    on_cpu = device.type == "cpu"
    if on_cpu:
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if on_cpu and not _process_flushes_denormals:
            torch.set_flush_denormal(False)


def event_positions(pos0: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] lifetime positions of the new events; 0 marks padding."""
    steps = torch.arange(T, device=pos0.device)
    pos = pos0[:, None] + steps[None, :] + 1
    return torch.where(steps[None, :] < lengths[:, None], pos, torch.zeros_like(pos))


def at_last_event(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x[b, lengths[b] - 1] for right-padded x [B, T, ...] (row 0 where lengths[b] is 0)."""
    last = torch.clamp(lengths - 1, min=0)
    return x[torch.arange(x.shape[0], device=x.device), last]


def masked_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the Proteus mask (then the optional L2 norm) to q, k: [B, T, H, K].

    Returns (q~, k~, m) with m: [B, T, K].
    """
    m = proteus_row_mask(positions, q.shape[-1], n_blocks, horizon, dtype=q.dtype)
    qt, kt = q * m[:, :, None, :], k * m[:, :, None, :]
    if qk_l2norm:
        qt, kt = l2norm(qt), l2norm(kt)
    return qt, kt, m


def memory_scan_recurrent(
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
    T = q.shape[1]
    positions = event_positions(pos0, lengths, T)
    qt, kt, m = masked_qk(q, k, positions, n_blocks, horizon, qk_l2norm)
    inputs = [q, k, v, theta, alpha, S0] + [t for t in (eta, M0) if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        with _denormals_flushed(q.device):
            return _scan_in_place(qt, kt, m, v, theta, eta, alpha, S0, M0)
    S, M = S0, M0
    ys = []
    for i in range(T):
        open_row = m[:, i, None, :, None] > 0  # [B, 1, K, 1]
        ki = kt[:, i]
        pred = torch.einsum("bhk,bhkv->bhv", ki, S)
        u = ki[..., None] * (pred - v[:, i])[:, :, None, :]
        th = theta[:, i, :, None, None]
        if eta is None or M is None:
            step = -th * u
        else:
            step = eta[:, i, :, None, None] * M - th * u
            M = torch.where(open_row, step, M)
        S_next = (1 - alpha[:, i, :, None, None] * m[:, i, None, :, None]) * S + step
        S = torch.where(open_row, S_next, S)
        ys.append(torch.einsum("bhk,bhkv->bhv", qt[:, i], S))
    y = torch.stack(ys, dim=1) if ys else v.new_zeros(v.shape)
    return y, S, M


def _scan_in_place(
    qt: torch.Tensor,
    kt: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    S0: torch.Tensor,
    M0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same rule without autograd (ingest, ranking, evaluation): updates copies of the
    state in place with per-row factors instead of building full-state temporaries.

    On a locked row the factors are exactly 1 (decay, momentum) and 0 (adding M), and k~ is
    0 there, so the row keeps its bits; a padding event locks every row: a no-op.
    """
    B, T, H, K = kt.shape
    V = v.shape[-1]
    BH = B * H
    S = S0.clone(memory_format=torch.contiguous_format)
    momentum = eta is not None and M0 is not None
    M = M0.clone(memory_format=torch.contiguous_format) if momentum and M0 is not None else M0
    S_bh = S.view(BH, K, V)
    M_bh = M.view(BH, K, V) if momentum and M is not None else None

    # Everything that does not depend on the state, for all steps at once, time-major.
    def steps(x: torch.Tensor, *shape: int) -> torch.Tensor:
        return x.transpose(0, 1).reshape(T, *shape).contiguous()

    mh = m[:, :, None, :]  # [B, T, 1, K]
    k_t = steps(kt, BH, 1, K)
    q_t = steps(qt, BH, 1, K)
    neg_v = steps(-v, BH, 1, V)
    thk_t = steps(theta[..., None] * kt, BH, K, 1)
    decay_t = steps(1 - alpha[..., None] * mh, B, H, K, 1)  # 1 - alpha open, 1 locked
    open_t = steps(mh.expand(B, T, 1, K), B, 1, K, 1)
    eta_t = steps(1 + (eta[..., None] - 1) * mh, B, H, K, 1) if eta is not None else None
    y_t = v.new_empty(T, BH, 1, V)
    for i in range(T):
        w = torch.baddbmm(neg_v[i], k_t[i], S_bh)  # k~^T S - v
        if M_bh is not None and M is not None and eta_t is not None:
            M.mul_(eta_t[i])
            M_bh.baddbmm_(thk_t[i], w, alpha=-1.0)
            S.mul_(decay_t[i]).addcmul_(M, open_t[i])
        else:
            S.mul_(decay_t[i])
            S_bh.baddbmm_(thk_t[i], w, alpha=-1.0)
        torch.bmm(q_t[i], S_bh, out=y_t[i])
    y = y_t.view(T, B, H, V).transpose(0, 1).contiguous()
    return y, S, M
