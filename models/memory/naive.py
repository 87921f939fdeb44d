"""The definition of the memory rule: one user, one event at a time, plain PyTorch.

This is the test oracle for every fast path and reads as SPEC section 3:

    k~ = m * k, q~ = m * q                  (Proteus row mask, then optional L2 norm)
    u  = k~ (k~^T S - v)^T                  (the surprise: gradient of 1/2 ||S^T k~ - v||^2)
    M <- eta * M - theta * u                (momentum; eta = None: the gated delta rule)
    S <- (1 - alpha * m) * S + M
    y  = S^T q~                             (read after the write)

Rows that the mask locks keep S and M exactly (bit for bit).
"""

from __future__ import annotations

import torch

from models.memory.proteus import proteus_row_mask

L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (an all-zero x stays zero)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def memory_step_reference(
    S: torch.Tensor,
    M: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    t: int,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Apply one event at lifetime position t (1-based) to one user's state, all heads.

    S, M: [H, K, V]; q, k: [H, K]; v: [H, V]; theta, eta, alpha: [H].
    eta None means no momentum (gated delta rule); M is then not used and returned as given.
    Returns (S_new, M_new, y) with y: [H, V].
    """
    K = S.shape[-2]
    m = proteus_row_mask(
        torch.tensor(t, device=S.device), K, n_blocks, horizon, dtype=S.dtype
    )  # [K]
    return memory_step_masked(S, M, q, k, v, theta, eta, alpha, m, qk_l2norm=qk_l2norm)


def memory_step_masked(
    S: torch.Tensor,
    M: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    m: torch.Tensor,
    *,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``memory_step_reference`` with an explicit row mask m [K] (1 = open): any set of rows,
    not only the schedule's prefix (the block-order controls open blocks in other orders)."""
    kt, qt = m * k, m * q
    if qk_l2norm:
        kt, qt = l2norm(kt), l2norm(qt)
    th, al = theta[:, None, None], alpha[:, None, None]
    pred = torch.einsum("hk,hkv->hv", kt, S)
    u = kt[:, :, None] * (pred - v)[:, None, :]
    if eta is None or M is None:
        step = -th * u
        M_new = M
    else:
        step = eta[:, None, None] * M - th * u
        M_new = step
    S_new = (1 - al * m[None, :, None]) * S + step
    open_row = m.bool()[None, :, None]
    S_new = torch.where(open_row, S_new, S)
    if M_new is not None and M is not None:
        M_new = torch.where(open_row, M_new, M)
    y = torch.einsum("hk,hkv->hv", qt, S_new)
    return S_new, M_new, y


def memory_scan_reference(
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
    """Batch of users, right-padded, one event at a time: the signature every path shares.

    q, k: [B, T, H, K]; v: [B, T, H, V]; theta, eta, alpha: [B, T, H];
    S0, M0: [B, H, K, V]; pos0: [B] events already applied; lengths: [B] new events.
    Returns (y [B, T, H, V] with zeros at padding, S, M).
    """
    B, T = q.shape[:2]
    y = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    S_out, M_out = S0.clone(), None if M0 is None else M0.clone()
    for b in range(B):
        S, M = S0[b].clone(), None if M0 is None else M0[b].clone()
        for i in range(int(lengths[b])):
            S, M, y[b, i] = memory_step_reference(
                S,
                M,
                q[b, i],
                k[b, i],
                v[b, i],
                theta[b, i],
                None if eta is None else eta[b, i],
                alpha[b, i],
                int(pos0[b]) + i + 1,
                n_blocks=n_blocks,
                horizon=horizon,
                qk_l2norm=qk_l2norm,
            )
        S_out[b] = S
        if M_out is not None and M is not None:
            M_out[b] = M
    return y, S_out, M_out


SURPRISE_EPS = 1e-6


def surprise_reference(
    S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, qk_l2norm: bool = True
) -> torch.Tensor:
    """The memory's surprise at one event, before its write: the key-value loss
    ||S^T k~ - v||^2 / (||v||^2 + eps) with k~ masked by m [K] (and normalised), the mean
    over heads. S [H, K, V], k [H, K], v [H, V] -> a scalar."""
    kt = m * k
    if qk_l2norm:
        kt = l2norm(kt)
    err = torch.einsum("hk,hkv->hv", kt, S) - v
    return ((err * err).sum(-1) / ((v * v).sum(-1) + SURPRISE_EPS)).mean()


def block_rows_mask(
    blocks: list[int], key_dim: int, n_blocks: int, dtype: torch.dtype
) -> torch.Tensor:
    """[K] 1 on the rows of the listed key blocks (block j: rows j*d .. (j+1)*d - 1, the last
    block to K), 0 elsewhere."""
    d = key_dim // n_blocks
    m = torch.zeros(key_dim, dtype=dtype)
    for j in blocks:
        m[j * d : key_dim if j == n_blocks - 1 else (j + 1) * d] = 1
    return m


def memory_scan_scheduled_reference(
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
    unlocks0: torch.Tensor,
    acc0: torch.Tensor,
    *,
    n_blocks: int,
    horizon: int,
    unlock: str,
    threshold: float = 0.0,
    order: torch.Tensor | None = None,
    signal: torch.Tensor | None = None,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The definition of the unlock schedules (models/memory/schedule.py), one user and one
    event at a time. At lifetime position t the user has k open blocks:

    - ``uniform``: k = k(t) of the positional schedule (SPEC section 3);
    - ``narrow``: k = 1 always (the fixed narrow capacity control);
    - ``surprise`` / ``drift``: k = min(E, 1 + unlocks). Every event adds its signal to
      ``acc[0]``: the memory's surprise before the write (``surprise_reference``) or the
      given ``signal`` [B, T] (drift). After the event at a position t = j * Delta (a
      multiple of Delta = max(1, N // E): decision j), m_j = acc[0] / Delta is the mean over
      the Delta events since the previous decision and acc[1] + m_j the sum of the means so
      far; the user unlocks one more block when m_j >= threshold * (acc[1] + m_j) / j (its
      running level). Then acc[0] restarts from 0 and m_j joins acc[1]. k never decreases.

    The open blocks are the first k of the user's block ``order`` [B, E] (None: 0, 1, ...).
    ``acc0`` [B, 2]. Returns (y, S, M, unlocks [B], acc [B, 2])."""
    B = q.shape[0]
    K = S0.shape[-2]
    delta = max(1, horizon // n_blocks)
    adaptive = unlock in ("surprise", "drift")
    y = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    S_out, M_out = S0.clone(), None if M0 is None else M0.clone()
    unlocks, acc = unlocks0.clone(), acc0.clone()
    for b in range(B):
        S, M = S0[b].clone(), None if M0 is None else M0[b].clone()
        un, a = int(unlocks0[b]), acc0[b].clone()
        blocks = list(range(n_blocks)) if order is None else [int(j) for j in order[b]]
        for i in range(int(lengths[b])):
            t = int(pos0[b]) + i + 1
            if unlock == "uniform":
                n_open = min(n_blocks, 1 + (t - 1) // delta)
            elif unlock == "narrow":
                n_open = 1
            else:
                n_open = min(n_blocks, 1 + un)
            m = block_rows_mask(blocks[:n_open], K, n_blocks, S.dtype)
            if adaptive:
                s = surprise_reference(S, k[b, i], v[b, i], m, qk_l2norm)
                a = a.clone()
                a[0] = a[0] + (s if signal is None else signal[b, i])
            S, M, y[b, i] = memory_step_masked(
                S, M, q[b, i], k[b, i], v[b, i], theta[b, i],
                None if eta is None else eta[b, i], alpha[b, i], m, qk_l2norm=qk_l2norm,
            )  # fmt: skip
            if adaptive and t % delta == 0:
                mean = a[0] / delta
                level = (a[1] + mean) / (t // delta)
                if mean >= threshold * level:
                    un = min(un + 1, n_blocks - 1)
                a = torch.stack([torch.zeros_like(mean), a[1] + mean])
        S_out[b] = S
        if M_out is not None and M is not None:
            M_out[b] = M
        unlocks[b], acc[b] = un, a
    return y, S_out, M_out, unlocks, acc
