"""Unlock schedules of the Proteus row mask beyond the uniform one (SPEC section 3: the
optional adaptive schedule and the ablation controls). The definition, one event at a time,
is ``naive.memory_scan_scheduled_reference``; this module is the fast path, built on the
ordinary scan backends (every backend of ops.py works unchanged).

``memory.unlock`` (when blocks open):

- ``uniform``: at fixed positions, k(t) = min(E, 1 + floor((t - 1) / Delta)) (today);
- ``narrow``: never: one block (K / E rows) stays open for ever (the "fixed narrow
  capacity" control); the positional scan with a horizon no position reaches;
- ``surprise``: after every Delta-th event of the user's life (decision j = 1, 2, ...), one
  more block opens when m_j, the mean over those Delta events of the memory's surprise (its
  key-value loss on the event before the write, ||S^T k~ - v||^2 / ||v||^2, mean over
  heads), is at least ``memory.unlock_threshold`` times the user's running level
  (m_1 + ... + m_j) / j: "more surprising than usual for this user" at threshold 1, every
  time at 0 (the uniform schedule), never at infinity. Relative to the user's own level, a
  threshold means the same whatever scale a model's signal has;
- ``drift``: the same with interest drift as the signal: 1 - cos(item embedding of the
  event, sum of the item embeddings of the user's previous W events) (0 without history).

The adaptive pair keeps, per user and layer, the unlock count, the signal summed since the
last decision and the sum of the past interval means in the state (``MemoryState.unlocks``,
``unlock_acc``): streaming, checkpointed with the state, and k never decreases. Decisions fall only on multiples of Delta of the
user's own position, so the events of one decision interval all run with one mask; the fast
path cuts each call into pieces at every user's decision positions and runs each piece as an
ordinary scan whose positions are shifted into the open block count's band of the uniform
schedule ("virtual positions"): the uniform schedule's mask at those positions is the mask
of k open blocks. Surprise needs S_{t-1}^T k~_t: a second, gradient-free scan of the piece
with the next event's key as the query reads it (y'_t = S_t^T k~_{t+1}). On the chunked
form (training) ``adaptive_chunk.adaptive_scan_chunk`` runs instead: one chunked scan per
call, the surprise read from its own solve.

``memory.block_order`` (which blocks open, in what order):

- ``prefix``: 0, 1, 2, ... (today);
- ``reverse``: E - 1, E - 2, ...: the same schedule on relabelled key rows. The key rows are
  projections with independently initialised weights, so this is the uniform model in
  another parametrisation: it measures seed noise, not an effect of the order;
- ``random``: a random order per user (keyed on the user's first event; ``order_key`` in
  the state): users no longer share which rows early history lands in.

Orders are applied by permuting each user's key rows (q and k before the scan), so the mask
stays a prefix in the permuted coordinates and S is stored in them; the NoteBank's q~ are in
the same coordinates. They need K divisible by E.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.memory.naive import SURPRISE_EPS
from models.memory.proteus import schedule_delta
from models.memory.recurrent import event_positions, masked_qk

UNLOCKS = ("uniform", "surprise", "drift", "narrow")
BLOCK_ORDERS = ("prefix", "reverse", "random")
ADAPTIVE = ("surprise", "drift")
NARROW_DELTA = 2**26
"""``narrow`` runs the positional scan with horizon E * NARROW_DELTA: 67 million events
before a second block would open, so one block stays open (a power of two: the aligned
chunked CPU path keeps its chunk size, and it fits the Triton kernels' int32)."""


def check_schedule_config(
    unlock: str, order: str, key_dim: int, n_blocks: int, window: int
) -> None:
    """Reject schedule settings that cannot run, naming the field."""
    if unlock not in UNLOCKS:
        raise ValueError(f"memory.unlock {unlock!r} is not one of {'|'.join(UNLOCKS)}")
    if order not in BLOCK_ORDERS:
        raise ValueError(f"memory.block_order {order!r} is not one of {'|'.join(BLOCK_ORDERS)}")
    if order != "prefix" and key_dim % n_blocks:
        raise ValueError(
            f"memory.block_order = {order} needs memory.key_dim ({key_dim}) divisible by "
            f"memory.n_blocks ({n_blocks})"
        )
    if unlock == "drift" and window < 1:
        raise ValueError(
            "memory.unlock = drift measures drift against the window of latest events: it "
            "needs a hybrid head (model.hybrid mac or mag) with model.window >= 1"
        )


@dataclass(frozen=True)
class UnlockSchedule:
    """What the model needs to know of the schedule settings (``memory.unlock``,
    ``memory.block_order``, ``memory.unlock_threshold``, E, N)."""

    unlock: str
    order: str
    n_blocks: int
    horizon: int
    threshold: float

    @classmethod
    def from_config(cls, mem: Any) -> UnlockSchedule:
        return cls(mem.unlock, mem.block_order, mem.n_blocks, mem.horizon, mem.unlock_threshold)

    @property
    def adaptive(self) -> bool:
        """Unlocks decided by a signal, kept in the state."""
        return self.unlock in ADAPTIVE

    @property
    def keyed(self) -> bool:
        """A per-user block order, keyed on the user's first event (kept in the state)."""
        return self.order == "random"

    @property
    def delta(self) -> int:
        """Events between two decisions (and between two uniform unlocks)."""
        return schedule_delta(self.n_blocks, self.horizon)

    @property
    def scan_horizon(self) -> int:
        """The horizon of the positional scan (``narrow``: one no position reaches)."""
        return self.n_blocks * NARROW_DELTA if self.unlock == "narrow" else self.horizon

    def open_blocks(self, pos: int, unlocks: int = 0) -> int:
        """Blocks open for a user at lifetime position ``pos`` with ``unlocks`` (adaptive)."""
        if pos <= 0:
            return 0
        if self.unlock == "narrow":
            return 1
        if self.adaptive:
            return min(self.n_blocks, 1 + unlocks)
        return min(self.n_blocks, 1 + (pos - 1) // self.delta)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 values in [0, 2^32), computed
    in int64 without overflow (multipliers below 2^30), so every device agrees."""
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


def order_keys(first_item: torch.Tensor, first_ts: torch.Tensor) -> torch.Tensor:
    """A user's block-order key from its first event (item index, ts): int64 in [0, 2^32)."""
    return _mix32((first_item & 0xFFFFFFFF) ^ _mix32(first_ts & 0xFFFFFFFF))


def block_order(
    sched: UnlockSchedule, keys: torch.Tensor | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    """[B, E] the blocks in the order they open, per user; None for ``prefix``."""
    E = sched.n_blocks
    if sched.order == "prefix":
        return None
    if sched.order == "reverse":
        return torch.arange(E - 1, -1, -1, device=device).expand(batch, E)
    assert keys is not None, "a random block order needs the users' order keys"
    j = torch.arange(E, device=device, dtype=torch.int64)
    x = _mix32(((keys[:, None] << 7) + j[None, :]) & 0xFFFFFFFF)
    return torch.argsort(x * E + j[None, :], dim=1)  # distinct sort keys: no ties


def row_order(blocks: torch.Tensor, key_dim: int) -> torch.Tensor:
    """[B, K] the key rows in opening order for a block order [B, E] (K divisible by E)."""
    B, E = blocks.shape
    d = key_dim // E
    rows = blocks[:, :, None] * d + torch.arange(d, device=blocks.device)[None, None, :]
    return rows.reshape(B, key_dim)


def permute_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, K] with each user's key coordinates put in the order ``rows`` [B, K]."""
    B, T, H, K = x.shape
    return torch.gather(x, 3, rows[:, None, None, :].expand(B, T, H, K))


def drift_signal(
    new: torch.Tensor, new_ok: torch.Tensor, old: torch.Tensor, old_ok: torch.Tensor
) -> torch.Tensor:
    """[B, T] interest drift of each new event: 1 - cos(its item embedding, the sum of the
    item embeddings of the user's previous W events), 0 when it has none. ``new`` [B, T, D]
    with validity [B, T]; ``old`` [B, W, D] the window before them, validity [B, W]."""
    W = old.shape[1]
    x = torch.cat([old * old_ok[..., None], new * new_ok[..., None]], dim=1)
    c = torch.cat([old_ok, new_ok], dim=1).to(x.dtype)
    cs = torch.nn.functional.pad(torch.cumsum(x, dim=1), (0, 0, 1, 0))  # exclusive sums
    cc = torch.nn.functional.pad(torch.cumsum(c, dim=1), (1, 0))
    T = new.shape[1]
    j = W + torch.arange(T, device=new.device)
    if W == 0:
        return new.new_zeros(new.shape[:2])
    prev = cs[:, j] - cs[:, j - W]
    count = cc[:, j] - cc[:, j - W]
    cos = torch.nn.functional.cosine_similarity(new, prev, dim=-1, eps=1e-12)
    return torch.where((count > 0.5) & new_ok, 1.0 - cos, torch.zeros_like(cos))


def decision_pieces(pos0: np.ndarray, lengths: np.ndarray, delta: int) -> list[tuple[int, int]]:
    """Column ranges [c0, c1) of a right-padded batch such that no user has a decision
    position (a multiple of ``delta``) strictly inside a range: a cut after every column
    where some user's event lands on one."""
    T = int(lengths.max()) if len(lengths) else 0
    cuts = {T}
    for r in np.unique(pos0 % delta):
        longest = int(lengths[(pos0 % delta) == r].max())
        first = (delta - 1 - int(r)) % delta  # first column whose position is a multiple
        cuts.update(range(first + 1, longest + 1, delta))
    bounds = sorted(c for c in cuts if 0 < c <= T)
    return list(zip([0, *bounds[:-1]], bounds, strict=True))


ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass
class AdaptiveResult:
    y: torch.Tensor
    S: torch.Tensor
    M: torch.Tensor | None
    unlocks: torch.Tensor
    acc: torch.Tensor
    positions: torch.Tensor
    """[B, T] the virtual positions each event ran at (0 for padding): their uniform-schedule
    mask is the event's mask (for k~, q~ outside the scan)."""
    signals: torch.Tensor
    """[B, T] the signal each event added (0 for padding): diagnostics, e.g. for choosing
    a threshold's scale."""


def adaptive_scan(
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
    scan: ScanFn,
    probe: ScanFn,
    signal: torch.Tensor | None = None,
    pieces: list[tuple[int, int]] | None = None,
) -> AdaptiveResult:
    """``naive.memory_scan_scheduled_reference`` for ``surprise`` / ``drift`` (prefix order;
    orders are a permutation of q and k outside): piece by piece (``decision_pieces``), each
    piece one ``scan`` (the backend signature, keyword ``n_blocks``/``horizon`` filled in
    here) at virtual positions, the decisions between pieces. ``acc0`` [B, 2]: the signal
    summed since the last decision and the sum of the past interval means. ``probe``: the
    gradient-free scan that reads the surprise. ``signal`` [B, T]: the drift signal (None:
    surprise). ``pieces``: ``decision_pieces`` of the call when the caller has them (else
    pos0 and lengths are read from the device)."""
    B, T = q.shape[:2]
    E, N, delta = sched.n_blocks, sched.horizon, sched.delta
    if pieces is None:
        pos_h, len_h = pos0.detach().cpu().numpy(), lengths.detach().cpu().numpy()
        pieces = decision_pieces(pos_h, len_h, delta)
    S, M = S0, M0
    unlocks, acc = unlocks0, acc0
    ys, vpos_parts, sig_parts = [], [], []
    for c0, c1 in pieces:
        n = c1 - c0
        pl = torch.clamp(lengths - c0, min=0, max=n)
        n_open = torch.clamp(unlocks + 1, max=E)
        vp0 = (n_open - 1) * delta + torch.remainder(pos0 + c0, delta)
        part = [t[:, c0:c1] for t in (q, k, v, theta)]
        eta_p = None if eta is None else eta[:, c0:c1]
        alpha_p = alpha[:, c0:c1]
        y, S_next, M_next = scan(
            *part, eta_p, alpha_p, S, M, vp0, pl, n_blocks=E, horizon=N, qk_l2norm=qk_l2norm
        )
        positions = event_positions(vp0, pl, n)
        valid = positions > 0
        if signal is None:
            s = _surprise(part[1], part[2], part[3], eta_p, alpha_p, S, M, vp0, pl, positions,
                          sched, qk_l2norm, probe)  # fmt: skip
        else:
            s = signal[:, c0:c1].detach()
        s = torch.where(valid, s.to(acc.dtype), torch.zeros_like(acc[:, :1]))
        now = acc[:, 0] + s.sum(1)
        sig_parts.append(s)
        end = pos0 + c0 + pl
        at_grid = (pl > 0) & (torch.remainder(end, delta) == 0)
        mean = now / delta
        past = acc[:, 1] + mean
        level = past / torch.clamp(torch.div(end, delta, rounding_mode="floor"), min=1)
        fire = at_grid & (mean >= sched.threshold * level)
        unlocks = torch.where(fire, torch.clamp(unlocks + 1, max=E - 1), unlocks)
        acc = torch.stack(
            [torch.where(at_grid, torch.zeros_like(now), now),
             torch.where(at_grid, past, acc[:, 1])], dim=1,
        )  # fmt: skip
        S, M = S_next, M_next
        ys.append(y)
        vpos_parts.append(positions)
    done = sum(y.shape[1] for y in ys)
    if done < T:  # columns past every user's last event: padding
        ys.append(v.new_zeros(B, T - done, *v.shape[2:]))
        vpos_parts.append(torch.zeros(B, T - done, dtype=torch.int64, device=q.device))
        sig_parts.append(acc0.new_zeros(B, T - done))
    return AdaptiveResult(
        torch.cat(ys, dim=1), S, M, unlocks, acc, torch.cat(vpos_parts, dim=1),
        torch.cat(sig_parts, dim=1),
    )  # fmt: skip


def _surprise(
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor | None,
    alpha: torch.Tensor,
    S: torch.Tensor,
    M: torch.Tensor | None,
    vp0: torch.Tensor,
    pl: torch.Tensor,
    positions: torch.Tensor,
    sched: UnlockSchedule,
    qk_l2norm: bool,
    probe: ScanFn,
) -> torch.Tensor:
    """[B, n] the memory's surprise at each event of a piece, before its write: the first
    from the state before the piece, the others read by a scan whose query at event i is
    the key of event i + 1 (the mask is the same for the whole piece)."""
    with torch.no_grad():
        k, v, S = k.detach(), v.detach(), S.detach()
        _, kt, _ = masked_qk(k, k, positions, sched.n_blocks, sched.horizon, qk_l2norm)
        pred = torch.einsum("bhk,bhkv->bhv", kt[:, 0], S.to(kt.dtype))[:, None]
        if k.shape[1] > 1:
            q_next = torch.cat([k[:, 1:], torch.zeros_like(k[:, :1])], dim=1)
            y_next = probe(
                q_next, k, v, theta.detach(), None if eta is None else eta.detach(),
                alpha.detach(), S, None if M is None else M.detach(), vp0, pl,
                n_blocks=sched.n_blocks, horizon=sched.horizon, qk_l2norm=qk_l2norm,
            )[0]  # fmt: skip
            pred = torch.cat([pred, y_next[:, :-1].to(pred.dtype)], dim=1)
        err = pred - v
        return ((err * err).sum(-1) / ((v * v).sum(-1) + SURPRISE_EPS)).mean(-1)
