"""The adaptive unlock schedules (``surprise``, ``drift``) in one chunked scan per call:
the training path of ``schedule.adaptive_scan`` (same arguments and result, autograd).

``adaptive_scan`` runs any backend piece by piece: every decision interval is one backend
call (its set-up and, in training, its backward included) plus, for ``surprise``, a second
gradient-free scan that reads the surprise. On a GPU each of those is dozens of small
kernels, so a 200-event segment cost several times the uniform schedule's single call. Here
the whole call is one pass over chunks, built on the scalar-gate algebra of
``chunk_aligned.py``:

- **Windows.** Each user's events are shifted right by ``pos0 mod Delta`` (``WindowLayout``),
  so every user's decision positions (multiples of Delta) end a window of Delta columns. A
  window holds events of one mask per user; it is cut into chunks of C columns (C divides
  Delta, ``aligned_chunk_size``).
- **Scalar gates.** Inside a window a row is open or locked for all its events, so the gate
  products (1 - alpha, eta, the write indicator) are scalars per (event, head) and do not
  depend on the mask at all: they are formed for every chunk at once. What the mask changes
  is k~, q~ (masked, normalised), their products, the chunk's triangular solve and which
  rows keep their state (decay factors 1 and 0 on locked rows, where k~ is exactly 0: they
  keep their bits).
- **Surprise for free.** The chunked form solves for w_i = S_{i-1}^T k~_i - v_i, the
  prediction error before each write: exactly the surprise's error. No second scan.
- **Decisions.** ``surprise`` decides after each window from its w (a handful of tensor
  operations on [B], no host synchronisation); the next window's mask follows. ``drift``'s
  signal is given, so all its decisions are made first (in bulk) and every chunk's
  mask-dependent part is formed at once, as in the uniform scan.

The definition is ``naive.memory_scan_scheduled_reference``; tests compare outputs, states,
decisions and every gradient with it and with ``adaptive_scan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from models.memory.chunk_aligned import aligned_chunk_size
from models.memory.naive import SURPRISE_EPS, l2norm
from models.memory.schedule import AdaptiveResult, UnlockSchedule, decision_pieces


@dataclass(frozen=True)
class WindowLayout:
    """Where the events of a call go: event t of user b takes column shift[b] + t,
    shift = pos0 mod Delta, so that window j (columns j * Delta .. (j + 1) * Delta - 1) ends
    at a decision position of every user. Shared by the layers of a call."""

    delta: int
    n_windows: int
    """Windows the call spans (a host number: the loop runs this often)."""
    src: torch.Tensor
    """[B, n_windows * Delta] the event index t each column holds (clamped on padding)."""
    ok: torch.Tensor
    """[B, n_windows * Delta] whether the column holds an event."""
    dst: torch.Tensor
    """[B, T] the column of each event (clamped on padding)."""
    valid: torch.Tensor
    """[B, T] whether event t is one (t < lengths)."""
    level_div: torch.Tensor
    """[B, n_windows] the number j of the decision that ends window j (its position over
    Delta: the divisor of the running level)."""

    @classmethod
    def build(
        cls,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        T: int,
        delta: int,
        host: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> WindowLayout:
        """The layout of new events [B, T] (right-padded) for users at ``pos0`` [B] with
        ``lengths`` [B] events. ``host``: the same (pos0, lengths) on the host, when the
        caller has them; without, they are read once from the device."""
        pos_h, len_h = host if host is not None else (_host(pos0), _host(lengths))
        span = np.where(len_h > 0, pos_h % delta + len_h, 0)
        n_windows = -(-int(span.max()) // delta) if len(span) else 0
        dev = pos0.device
        shift = torch.remainder(pos0, delta)
        col = torch.arange(n_windows * delta, device=dev)
        t = col[None, :] - shift[:, None]
        ok = (t >= 0) & (t < lengths[:, None])
        steps = torch.arange(T, device=dev)
        dst = torch.clamp(shift[:, None] + steps[None, :], max=max(n_windows * delta - 1, 0))
        window = torch.arange(n_windows, device=dev)
        level_div = torch.div(pos0, delta, rounding_mode="floor")[:, None] + window + 1
        return cls(
            delta, n_windows, torch.clamp(t, 0, max(T - 1, 0)), ok, dst,
            steps[None, :] < lengths[:, None], level_div,
        )  # fmt: skip

    def to_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> [B, columns, ...], zeros on columns without an event."""
        idx = self.src.view(*self.src.shape, *([1] * (x.dim() - 2)))
        out = torch.gather(x, 1, idx.expand(-1, -1, *x.shape[2:]))
        return out * self.ok.view(*self.ok.shape, *([1] * (x.dim() - 2))).to(x.dtype)

    def to_events(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, columns, ...] -> [B, T, ...], zeros at padding."""
        idx = self.dst.view(*self.dst.shape, *([1] * (x.dim() - 2)))
        out = torch.gather(x, 1, idx.expand(-1, -1, *x.shape[2:]))
        return torch.where(self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2))), out, 0)


class AdaptiveCall:
    """The positions of one call's new events under an adaptive schedule, shared by its
    layers: pos0 [B] and lengths [B] are read to the host at most once (not at all when the
    caller gives them, as training does), and the pieces of ``adaptive_scan`` and the
    layout of ``adaptive_scan_chunk`` are each formed at most once."""

    def __init__(
        self,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        T: int,
        delta: int,
        host: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.pos0, self.lengths, self.T, self.delta = pos0, lengths, T, delta
        self._given = host

    @cached_property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """(pos0, lengths) as numpy arrays."""
        if self._given is not None:
            return self._given
        return _host(self.pos0), _host(self.lengths)

    @cached_property
    def pieces(self) -> list[tuple[int, int]]:
        return decision_pieces(*self.host, self.delta)

    @cached_property
    def layout(self) -> WindowLayout:
        return WindowLayout.build(self.pos0, self.lengths, self.T, self.delta, self.host)


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def adaptive_scan_chunk(
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
    sched: UnlockSchedule,
    qk_l2norm: bool,
    signal: torch.Tensor | None = None,
    chunk_size: int = 16,
    layout: WindowLayout | None = None,
) -> AdaptiveResult:
    """``schedule.adaptive_scan`` (prefix order) as one chunked scan: chunks of the largest
    C <= ``chunk_size`` dividing Delta, a decision after each window of Delta columns.
    ``layout``: the call's ``WindowLayout`` (built here when not given, reading pos0 and
    lengths from the device once). ``unlocks0`` must lie in [0, E - 1], as the schedule
    keeps it."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    E, delta = sched.n_blocks, sched.delta
    lay = layout if layout is not None else WindowLayout.build(pos0, lengths, T, delta)
    if lay.n_windows == 0:
        zeros = torch.zeros(B, T, dtype=torch.int64, device=q.device)
        return AdaptiveResult(
            v.new_zeros(v.shape), S0, M0, unlocks0, acc0, zeros, acc0.new_zeros(B, T)
        )
    momentum = eta is not None and M0 is not None
    C = aligned_chunk_size(chunk_size, E, sched.horizon)
    per, W = delta // C, lay.n_windows
    Nc, BH, dev = W * per, B * H, q.device

    # Every input in columns, chunk-major: [Nc, B, H, C, ...]; padding columns are zeros.
    gates = [theta, alpha] + ([eta] if momentum and eta is not None else [])
    cols = lay.to_columns(torch.cat([k, q, v, torch.stack(gates, -1)], -1))
    cols = cols.view(B, Nc, C, H, -1).permute(1, 0, 3, 2, 4)
    k_raw, q_raw, vc, g = cols.split([K, K, V, len(gates)], -1)
    kq_raw = torch.cat([k_raw, q_raw], -2)  # [Nc, B, H, 2C, K]: the chunk's keys, then queries
    on = lay.ok.view(B, Nc, C).transpose(0, 1)[:, :, None, :].to(q.dtype)  # [Nc, B, 1, C]
    th = g[..., 0]
    a = 1 - g[..., 1]  # padding: 1
    e = 1 + (g[..., 2] - 1) * on if momentum else (1 - on).expand_as(th)  # no momentum: M restarts

    # The gate algebra of chunk_aligned.py for every chunk at once: it holds no mask.
    A, Ep = _pair_products(torch.stack([a, e]))  # [Nc, B, H, C(i), C(s)]
    a_pre, e_pre = _prefix_products(torch.stack([a, e]))  # A_{i,0}: the product through i
    Ao = A * on[..., None, :]
    G = Ao @ Ep  # G_{i,s} = sum_r A_{i,r} o_r E_{r,s}
    G_prev = F.pad(G[..., :-1, :], (0, 0, 1, 0))
    a_prev = F.pad(a_pre[..., :-1], (1, 0), value=1.0)
    g_S = G[..., -1, :] * th  # S -= k~^T (G_{C-1,s} theta_s w_s)
    # The state of a (user, head) is Z = [S | M], [K, P V] (P = 2 with momentum, else Z = S):
    # one matmul reads both, one P x P map per row carries them across a chunk.
    if momentum:
        assert M0 is not None
        Fv = (Ao @ e_pre[..., None]).squeeze(-1)  # F_i = sum_{r<=i} A_{i,r} o_r E_{r,0}
        coef_k = torch.stack([a_prev, F.pad(Fv[..., :-1], (1, 0))], 1)  # w from k~ S, k~ M
        coef_q = torch.stack([a_pre, Fv], -1)[..., None]  # y from q~ S, q~ M: [.., C, P, 1]
        g_w = torch.stack([g_S, Ep[..., -1, :] * th], -1)[..., None]  # M -= k~^T (E_{C-1,s} ..)
        last = [a_pre[..., -1], Fv[..., -1], torch.zeros_like(th[..., -1]), e_pre[..., -1]]
        carry = torch.stack(last, -1).view(Nc, B, H, 1, 2, 2)  # [S; M] <- [[A, F], [0, E]] [S; M]
        Z = torch.cat([S0, M0], -1)
    else:
        coef_k, coef_q, g_w = a_prev[:, None], a_pre[..., None, None], g_S[..., None, None]
        carry = a_pre[..., -1, None, None, None]
        Z = S0
    P = 2 if momentum else 1
    locked = torch.eye(P, dtype=q.dtype, device=dev)  # rows a chunk does not open keep Z
    eye = torch.eye(C, dtype=q.dtype, device=dev)
    open_f, open_b = _open_rows(K, E, q.dtype, dev)
    # Chunks are taken apart with split / unbind, never sliced one by one: the backward of
    # a slice is a zero tensor of the whole (one per use), of a split one concatenation.
    stepwise = signal is None  # surprise: window by window; drift: all chunks at once
    bulk = (kq_raw, th, G_prev, G, vc, coef_k, carry)
    groups = [x.split(per) if stepwise else [x] for x in bulk]
    coef_q_c, g_w_c = coef_q.unbind(0), g_w.unbind(0)

    def masked(j: int, u: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """The mask-dependent part of the chunks of group j whose users hold ``u`` [n, B]
        unlocks, per chunk: k~ (rows 0..C-1) and q~ (C..2C-1), k~ transposed, the chunk
        solve and its products, and each row's carry map (the identity on locked rows,
        where k~ is exactly 0)."""
        kq, th_j, G_prev_j, G_j, vc_j, coef_k_j, carry_j = (x[j] for x in groups)
        kq = kq * open_f[u][:, :, None, None, :]
        if qk_l2norm:
            kq = l2norm(kq)
        kc = kq.split(C, -2)[0]
        dots_k, dots_q = ((kq @ kc.transpose(-1, -2)) * th_j[..., None, :]).split(C, -2)
        inv = torch.linalg.solve_triangular(
            dots_k * G_prev_j + eye, eye.expand_as(G_prev_j), upper=False, unitriangular=True
        )
        rows = open_b[u][:, :, None, :, None, None]  # [n, B, 1, K, 1, 1]
        kc_t = kc.transpose(-1, -2).reshape(-1, BH, K, C)
        parts = (
            kq, kc_t, inv[:, None] * coef_k_j[..., None, :], inv @ vc_j, dots_q * G_j,
            torch.where(rows, carry_j, locked),
        )  # fmt: skip
        return list(zip(*(x.unbind(0) for x in parts), strict=True))

    ys: list[torch.Tensor] = []
    surprises: list[torch.Tensor] = []
    vden = (vc.detach() * vc.detach()).sum(-1) + SURPRISE_EPS  # [Nc, B, H, C]

    def run(c: int, part: tuple[torch.Tensor, ...]) -> None:
        """Chunk c: read the state, solve for w, write."""
        nonlocal Z
        kq, kc_t, inv_k, inv_v, Pm, carry_c = part
        xk, xq = (kq @ Z).split(C, -2)  # [B, H, C, P V] each: k~ [S | M], q~ [S | M]
        # w_i = S_{i-1}^T k~_i - v_i = inv (A_{i-1,0} k~_i S + F_{i-1} k~_i M - v_i)
        w = inv_v.view(BH, C, V)
        for p, (inv_p, xk_p) in enumerate(zip(inv_k.unbind(0), xk.split(V, -1), strict=True)):
            w = torch.baddbmm(
                w, inv_p.view(BH, C, C), xk_p.reshape(BH, C, V), beta=-1.0 if p == 0 else 1.0
            )
        yq = (xq.reshape(B, H, C, P, V) * coef_q_c[c]).sum(-2)
        ys.append(torch.baddbmm(yq.view(BH, C, V), Pm.view(BH, C, C), w, alpha=-1))
        gw = (g_w_c[c] * w.view(B, H, C, 1, V)).view(BH, C, P * V)
        Zv = Z.reshape(B, H, K, P, V)
        mapped = carry_c @ Zv if P > 1 else carry_c * Zv
        Z = torch.baddbmm(mapped.view(BH, K, P * V), kc_t, gw, alpha=-1).view(B, H, K, P * V)
        if stepwise:
            with torch.no_grad():  # the surprise: ||w||^2 / (||v||^2 + eps), mean over heads
                err = (w * w).sum(-1).view(B, H, C)
                surprises.append((err / vden[c]).mean(1))

    at_grid = lay.ok[:, delta - 1 :: delta]  # [B, W]: a decision ends window j
    if signal is not None:
        # drift: the decisions need only the signal; then every chunk's mask is known
        sig = lay.to_columns(signal.detach().to(acc0.dtype)[..., None])[..., 0]
        u_w, unlocks, acc = _drift_decisions(
            sig.view(B, W, delta).sum(-1), at_grid, lay.level_div, unlocks0, acc0, sched
        )
        for c, part in enumerate(masked(0, u_w.repeat_interleave(per, 1).transpose(0, 1))):
            run(c, part)
        signals = sig
    else:
        unlocks, now, past = unlocks0, acc0[:, 0], acc0[:, 1]
        zero = torch.zeros((), dtype=acc0.dtype, device=dev)
        held = []
        for j in range(W):
            held.append(unlocks)
            for i, part in enumerate(masked(j, unlocks.expand(per, B))):
                run(j * per + i, part)
            with torch.no_grad():
                s = surprises[-1] if per == 1 else torch.cat(surprises[-per:], 1)
                at = at_grid[:, j]
                now = now + s.to(acc0.dtype).sum(1)
                mean = now / delta
                level_sum = past + mean
                fire = at & (mean >= sched.threshold * (level_sum / lay.level_div[:, j]))
                unlocks = torch.where(fire, torch.clamp(unlocks + 1, max=E - 1), unlocks)
                now = torch.where(at, zero, now)
                past = torch.where(at, level_sum, past)
        u_w = torch.stack(held, 1)
        acc = torch.stack([now, past], 1)
        signals = torch.stack(surprises, 1).reshape(B, Nc * C).to(acc0.dtype)

    y = torch.stack(ys).view(Nc, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, Nc * C, H, V)
    n_open = torch.clamp(u_w + 1, max=E)
    vpos = (n_open[:, :, None] - 1) * delta + torch.arange(delta, device=dev) + 1  # [B, W, Delta]
    return AdaptiveResult(
        lay.to_events(y), Z[..., :V], Z[..., V:] if momentum else M0, unlocks, acc,
        lay.to_events(vpos.view(B, Nc * C)), lay.to_events(signals),
    )  # fmt: skip


def _prefix_products(g: torch.Tensor) -> torch.Tensor:
    """The running product along the last dimension, g_0 g_1 ... g_i at i, in log2 steps of
    multiplications: ``cumprod``'s backward checks its input for zeros on the host (torch
    2.11 on the H200, models/train_step.py), a synchronisation this path avoids."""
    n, d = g.shape[-1], 1
    while d < n:
        g = g * F.pad(g[..., :-d], (d, 0), value=1.0)
        d *= 2
    return g


def _pair_products(g: torch.Tensor) -> torch.Tensor:
    """P[..., i, s] = prod_{r=s+1..i} g[..., r] for i >= s, 0 above the diagonal (as
    ``chunk_aligned._pair_products``, through ``_prefix_products``). g: [..., C] -> [..., C, C]."""
    C = g.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    # x[..., s, i] = g_i for i > s, else 1: the running product along i starts after s
    x = torch.where(~lower, g[..., None, :], torch.ones((), dtype=g.dtype, device=g.device))
    return _prefix_products(x).transpose(-1, -2) * lower


def _open_rows(
    key_dim: int, n_blocks: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, K] the rows open for a user holding u unlocks (row u; min(E, u + 1) blocks, all K
    rows once every block is open), as 0/1 of ``dtype`` and as bool."""
    n = torch.arange(1, n_blocks + 1, device=device)
    rows = torch.where(n >= n_blocks, key_dim, n * (key_dim // n_blocks))
    is_open = torch.arange(key_dim, device=device) < rows[:, None]
    return is_open.to(dtype), is_open


def _drift_decisions(
    window_sum: torch.Tensor,
    at_grid: torch.Tensor,
    level_div: torch.Tensor,
    unlocks0: torch.Tensor,
    acc0: torch.Tensor,
    sched: UnlockSchedule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every decision of a call from the given signal's sums per window [B, W] at once:
    (the unlocks held in each window [B, W], unlocks [B] and acc [B, 2] after the call). A
    user's windows end at a decision up to its last full window (``at_grid`` [B, W] is true
    on a prefix), so a decided window's interval is its own events (the first window's
    also the sum carried in) and the rest accumulate after the last decision."""
    E, delta = sched.n_blocks, sched.delta
    first = torch.zeros_like(at_grid)
    first[:, 0] = True
    now = window_sum + torch.where(first, acc0[:, :1], 0.0)
    mean = now / delta
    past = acc0[:, 1:] + torch.cumsum(torch.where(at_grid, mean, 0.0), 1)
    fire = at_grid & (mean >= sched.threshold * (past / level_div))
    fired = torch.cumsum(fire.to(torch.int64), 1)

    def after(n: torch.Tensor) -> torch.Tensor:
        return torch.where(n > 0, torch.clamp(unlocks0[:, None] + n, max=E - 1), unlocks0[:, None])

    held = after(F.pad(fired[:, :-1], (1, 0)))  # the decisions fired before each window
    decided = at_grid.any(1)
    rest = torch.where(at_grid, 0.0, window_sum).sum(1)
    acc_now = torch.where(decided, rest, acc0[:, 0] + rest)
    return held, after(fired[:, -1:])[:, 0], torch.stack([acc_now, past[:, -1]], 1)
