"""The memory recommender (SPEC section 4): event embeddings, L per-user memory layers, a
read-out giving the user vector, scores against the tied item embedding table.

The engine drives it through ``advance`` (new events for a batch of users, carrying a
``MemoryState``), ``init_state`` and ``score``; offline evaluation through the Scorer
protocol (``user_vectors`` and ``item_matrix``). Padding events (index >= lengths[b]) are
exact no-ops on the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from models.config import MemoryConfig, ModelConfig
from models.embeddings import EventEmbeddings
from models.features import previous_ts, time_gap_buckets
from models.fusion import ReplayFusion, RouteProjection, check_fusion_config
from models.hybrid import ReadHead
from models.memory.adaptive_chunk import AdaptiveCall, adaptive_scan_chunk
from models.memory.chunk_aligned import EAGER_CHUNK_OPS, ChunkOps, compiled_chunk_ops
from models.memory.compiled import RowsDynamic
from models.memory.ops import memory_readout, memory_scan, resolve_backend
from models.memory.packed import memory_scan_packed
from models.memory.recurrent import at_last_event, event_positions, masked_qk
from models.memory.schedule import (
    UnlockSchedule,
    adaptive_scan,
    block_order,
    check_schedule_config,
    drift_signal,
    order_keys,
    permute_rows,
    row_order,
)
from models.memory.training import check_train_backend
from models.sequences import EventSeqs
from models.state import NO_ITEM, MemoryState


@dataclass
class AdvanceResult:
    """What ``advance`` returns: the new state, the memory layers' read-out after each event
    [B, T, D] (zeros at padding), optionally the masked/normalised (k~, q~), each
    [B, T, L, H, K], and, when request times were given, the user vector after each event
    [B, T, D] (``ReadHead``)."""

    state: MemoryState
    outputs: torch.Tensor
    kq: tuple[torch.Tensor, torch.Tensor] | None = None
    user: torch.Tensor | None = None


@dataclass
class LayerPlan:
    """One call's unlock-schedule inputs of a layer (models/memory/schedule.py): ``rows``
    [B, K] each user's key rows in opening order (block orders; None: as they are);
    ``unlocks`` [B], ``acc`` [B, 2] the layer's unlock count and signal sums (surprise |
    drift);
    ``signal`` [B, T] the drift of the new events (None: surprise); ``call`` the call's
    positions (adaptive schedules; shared by the layers)."""

    rows: torch.Tensor | None = None
    unlocks: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    signal: torch.Tensor | None = None
    call: AdaptiveCall | None = None


@dataclass
class LayerScan:
    """A layer's memory scan: read y [B, T, H, V], state after it, the positions whose
    uniform-schedule mask each event ran with ([B, T], 0 at padding) and that mask's horizon,
    and the new unlock count and signal sum (adaptive schedules, else None)."""

    y: torch.Tensor
    S: torch.Tensor
    M: torch.Tensor | None
    positions: torch.Tensor
    horizon: int
    unlocks: torch.Tensor | None = None
    acc: torch.Tensor | None = None


class MemoryLayer(nn.Module):
    """One layer: projections to q, k, v and gates per head, the memory scan, then output
    projection + residual + LayerNorm and a small feed-forward block."""

    def __init__(self, mem: MemoryConfig, model: ModelConfig) -> None:
        super().__init__()
        D, H, K, V = model.embed_dim, mem.n_heads, mem.key_dim, mem.value_dim
        self.H, self.K, self.V = H, K, V
        self.mem = mem
        check_train_backend(mem.train_backend, mem.momentum)
        window = model.window if model.hybrid != "none" else 0
        check_schedule_config(mem.unlock, mem.block_order, K, mem.n_blocks, window)
        self.sched = UnlockSchedule.from_config(mem)
        self.qkv = nn.Linear(D, H * (2 * K + V))
        n_gates = 3 if mem.momentum else 2
        self.gates = nn.Linear(D, H * n_gates)
        with torch.no_grad():
            # theta starts near theta_max / 2, alpha (forget) small, eta (momentum) ~ 0.5.
            bias = self.gates.bias.view(n_gates, H)
            bias[0].fill_(0.0)
            bias[1].fill_(-4.0)
            if mem.momentum:
                bias[2].fill_(0.0)
        self.out = nn.Linear(H * V, D)
        self.norm1 = nn.LayerNorm(D)
        self.ffn: nn.Module | None = None
        if model.ffn_mult > 0:
            self.ffn = nn.Sequential(
                nn.Linear(D, model.ffn_mult * D),
                nn.GELU(),
                nn.Linear(model.ffn_mult * D, D),
            )
            self.norm2 = nn.LayerNorm(D)
        self.dropout = nn.Dropout(model.dropout)

    def project(
        self, x: torch.Tensor
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor
    ]:
        """x [B, T, D] -> q, k [B, T, H, K], v [B, T, H, V], theta, eta (or None), alpha."""
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        q, k, v = self.qkv(x).split([H * K, H * K, H * V], dim=-1)
        g = self.gates(x).view(B, T, -1, H)
        theta = self.mem.theta_max * torch.sigmoid(g[:, :, 0])
        alpha = torch.sigmoid(g[:, :, 1])
        eta = torch.sigmoid(g[:, :, 2]) if self.mem.momentum else None
        return (
            q.reshape(B, T, H, K),
            k.reshape(B, T, H, K),
            v.reshape(B, T, H, V),
            theta,
            eta,
            alpha,
        )

    def project_keys(
        self, x: torch.Tensor, plan: LayerPlan | None
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor
    ]:
        """``project`` with each user's key rows in its block order (``plan.rows``)."""
        q, k, v, theta, eta, alpha = self.project(x)
        if plan is not None and plan.rows is not None:
            q, k = permute_rows(q, plan.rows), permute_rows(k, plan.rows)
        return q, k, v, theta, eta, alpha

    def scan(
        self,
        qkv: tuple[
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor | None,
            torch.Tensor,
        ],
        S0: torch.Tensor,
        M0: torch.Tensor | None,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        plan: LayerPlan | None,
        backend: str,
        training: bool,
    ) -> LayerScan:
        """The memory scan of projected events under the layer's unlock schedule. An
        adaptive schedule on the chunked form (the default training path) runs as one
        chunked scan (``adaptive_scan_chunk``), on any other backend piece by piece."""
        mem = self.mem
        sched = self.sched
        if sched.adaptive:
            assert plan is not None and plan.unlocks is not None and plan.acc is not None
            assert plan.call is not None
            if resolve_backend(backend, qkv[0].device, training) == "chunk":
                res = adaptive_scan_chunk(
                    *qkv, S0, M0, pos0, lengths, plan.unlocks, plan.acc,
                    sched=sched, qk_l2norm=mem.qk_l2norm, signal=plan.signal,
                    chunk_size=mem.chunk_size, layout=plan.call.layout,
                )  # fmt: skip
            else:
                res = adaptive_scan(
                    *qkv, S0, M0, pos0, lengths, plan.unlocks, plan.acc,
                    sched=sched, qk_l2norm=mem.qk_l2norm,
                    scan=partial(memory_scan, backend=backend, training=training,
                                 chunk_size=mem.chunk_size),
                    probe=partial(memory_scan, backend=mem.backend, chunk_size=mem.chunk_size),
                    signal=plan.signal, pieces=plan.call.pieces,
                )  # fmt: skip
            return LayerScan(res.y, res.S, res.M, res.positions, sched.horizon,
                             res.unlocks, res.acc)  # fmt: skip
        y, S, M = memory_scan(
            *qkv, S0, M0, pos0, lengths,
            n_blocks=mem.n_blocks, horizon=sched.scan_horizon, qk_l2norm=mem.qk_l2norm,
            backend=backend, training=training, chunk_size=mem.chunk_size,
        )  # fmt: skip
        T = qkv[0].shape[1]
        return LayerScan(y, S, M, event_positions(pos0, lengths, T), sched.scan_horizon)

    def forward(
        self,
        x: torch.Tensor,
        S0: torch.Tensor,
        M0: torch.Tensor | None,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        return_kq: bool = False,
        plan: LayerPlan | None = None,
    ) -> tuple[torch.Tensor, LayerScan, tuple[torch.Tensor, torch.Tensor] | None]:
        """(layer output [B, T, D], the scan, (k~, q~) when asked)."""
        qkv = self.project_keys(x, plan)
        training = self.training and torch.is_grad_enabled()
        backend = self.mem.train_backend if training else self.mem.backend
        res = self.scan(qkv, S0, M0, pos0, lengths, plan, backend, training)
        kq = None
        if return_kq:
            mem = self.mem
            qt, kt, _ = masked_qk(
                qkv[0], qkv[1], res.positions, mem.n_blocks, res.horizon, mem.qk_l2norm
            )
            kq = (kt.detach(), qt.detach())
        return self._mix(x, res.y), res, kq

    def forward_packed(
        self,
        x: torch.Tensor,
        S0: torch.Tensor,
        M0: torch.Tensor | None,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        positions: torch.Tensor,
        return_kq: bool = False,
        ops: PackedOps | None = None,
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None
    ]:
        """``forward`` on packed events (``models/memory/packed.py``), no autograd, uniform
        schedule in prefix order: x [N, D], their lifetime ``positions`` [N]. Returns the
        output [N, D], S, M after the events and (k~, q~) [N, H, K] when asked."""
        ops = ops or EAGER_PACKED_OPS
        q, k, v, theta, eta, alpha, kq = ops.layer_in(self, x, positions, return_kq)
        mem = self.mem
        y, S, M = memory_scan_packed(
            q, k, v, theta, eta, alpha, S0, M0, pos0, lengths,
            n_blocks=mem.n_blocks, horizon=self.sched.scan_horizon, qk_l2norm=mem.qk_l2norm,
            chunk_size=mem.chunk_size, ops=ops.chunk,
        )  # fmt: skip
        return ops.layer_out(self, x, y), S, M, kq

    def forward_readout(
        self,
        x: torch.Tensor,
        S0: torch.Tensor,
        M0: torch.Tensor | None,
        pos0: torch.Tensor,
        lengths: torch.Tensor,
        last_only: bool = False,
        plan: LayerPlan | None = None,
    ) -> torch.Tensor:
        """``forward``'s output [B, T, D] without the state after the events (no autograd;
        ``memory_readout``): what a replay on a copy of the state needs. ``last_only``:
        only each user's output at its last event, [B, 1, D]. Under an adaptive schedule
        the read-out runs the schedule's scan (its decisions need the states)."""
        qkv = self.project_keys(x, plan)
        mem = self.mem
        if self.sched.adaptive:
            y = self.scan(qkv, S0, M0, pos0, lengths, plan, mem.backend, False).y
            if last_only:
                y = at_last_event(y, lengths)[:, None]
        else:
            y = memory_readout(
                *qkv, S0, M0, pos0, lengths,
                n_blocks=mem.n_blocks, horizon=self.sched.scan_horizon,
                qk_l2norm=mem.qk_l2norm, backend=mem.backend, chunk_size=mem.chunk_size,
                last_only=last_only,
            )  # fmt: skip
        if last_only:
            x = at_last_event(x, lengths)[:, None]
        return self._mix(x, y.to(x.dtype))

    def _mix(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Output projection + residual + LayerNorm (+ feed-forward) of the memory read y
        [B, T, H, V] on top of the layer input x [B, T, D]."""
        B, T, _ = x.shape
        h = self.norm1(x + self.dropout(self.out(y.reshape(B, T, -1))))
        if self.ffn is not None:
            h = self.norm2(h + self.dropout(self.ffn(h)))
        return h

    def read(
        self,
        x: torch.Tensor,
        S: torch.Tensor,
        positions: torch.Tensor,
        plan: LayerPlan | None = None,
    ) -> torch.Tensor:
        """Read-only pass of one event per user: x [B, D], S [B, H, K, V], positions [B]
        (lifetime position the event is read at, >= 1; under an adaptive schedule a
        position whose uniform mask is the user's, ``MemoryRecommender.read_only``). The
        layer's q is masked and normalised exactly as the scan does (``masked_qk``), the
        read is y = S^T q~ and no state changes. Equals the scan's output for an event
        whose write is a no-op (theta = 0, alpha = 0, no momentum step). Returns the layer
        output [B, D]."""
        q = self.project_keys(x[:, None], plan)[0]  # [B, 1, H, K]
        mem = self.mem
        horizon = mem.horizon if self.sched.adaptive else self.sched.scan_horizon
        qt, _, _ = masked_qk(q, q, positions[:, None], mem.n_blocks, horizon, mem.qk_l2norm)
        y = torch.einsum("bthk,bhkv->bthv", qt, S.to(qt.dtype))
        return self._mix(x[:, None], y)[:, 0]


def _packed_layer_in(
    layer: MemoryLayer, x: torch.Tensor, positions: torch.Tensor, return_kq: bool
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor,
    tuple[torch.Tensor, torch.Tensor] | None,
]:  # fmt: skip
    """A layer's projections of packed events x [N, D] (q, k [N, H, K], v [N, H, V], the
    gates [N, H]) and, when asked, (k~, q~) [N, H, K] under the uniform schedule's mask at
    their lifetime ``positions`` [N]."""
    q, k, v, theta, eta, alpha = layer.project(x[:, None])
    kq = None
    if return_kq:
        mem = layer.mem
        qt, kt, _ = masked_qk(
            q, k, positions[:, None], mem.n_blocks, layer.sched.scan_horizon, mem.qk_l2norm
        )
        kq = (kt[:, 0], qt[:, 0])
    return (
        q[:, 0], k[:, 0], v[:, 0], theta[:, 0], None if eta is None else eta[:, 0], alpha[:, 0],
        kq,
    )  # fmt: skip


def _packed_layer_out(layer: MemoryLayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A layer's output [N, D] from its input x [N, D] and the memory reads y [N, H, V]."""
    return layer._mix(x[:, None], y[:, None])[:, 0]


@dataclass(frozen=True)
class PackedOps:
    """The functions of ``advance_packed`` around the scan's data-dependent layout: the
    plain ones (``EAGER_PACKED_OPS``) or graphs compiled once for every batch size
    (``compiled_packed_ops``, models/memory/compiled.py)."""

    layer_in: Callable[..., Any]
    layer_out: Callable[..., torch.Tensor]
    chunk: ChunkOps


EAGER_PACKED_OPS = PackedOps(_packed_layer_in, _packed_layer_out, EAGER_CHUNK_OPS)


def compiled_packed_ops(*, cpp_wrapper: bool = True) -> PackedOps:
    """``PackedOps`` compiled once for every batch (models/memory/compiled.py); one set per
    process, which every model shares (a new torch.compile wrapper would compile anew).
    Made while torch.compile is disabled (``TORCH_COMPILE_DISABLE=1``), they run plainly."""
    return _compiled_packed_ops(cpp_wrapper, bool(torch._dynamo.config.disable))


@cache
def _compiled_packed_ops(cpp_wrapper: bool, disabled: bool) -> PackedOps:
    # ``disabled`` only keys the cache: ops made while torch.compile was off are not
    # handed out once it is on
    return PackedOps(
        RowsDynamic(_packed_layer_in, cpp_wrapper=cpp_wrapper),
        RowsDynamic(_packed_layer_out, cpp_wrapper=cpp_wrapper),
        compiled_chunk_ops(cpp_wrapper=cpp_wrapper),
    )


class MemoryRecommender(nn.Module):
    """Event embedding -> L memory layers -> read-out head (models/hybrid.py: optional
    attention over the latest W events and the request's time) -> user vector; scores =
    user vector dot the tied item embedding rows 0 .. n_items-1 (the TRAIN items).

    The state after a user's events (``advance``) holds the memory read-out ``h`` and the
    window; the user vector needs the request's time and is read from the state by
    ``read_user``, the same head ``advance`` applies to every event given request times."""

    def __init__(
        self, n_items: int, n_oov_buckets: int, mem: MemoryConfig, model: ModelConfig
    ) -> None:
        super().__init__()
        if n_items < 1:
            raise ValueError("MemoryRecommender needs at least one item")
        self.n_items = n_items
        self.mem_cfg = mem
        self.model_cfg = model
        D = model.embed_dim
        self.embed = EventEmbeddings(n_items + n_oov_buckets, model.n_time_buckets, D)
        self.embed_norm = nn.LayerNorm(D)
        self.embed_dropout = nn.Dropout(model.dropout)
        self.layers = nn.ModuleList([MemoryLayer(mem, model) for _ in range(mem.n_layers)])
        self.sched = UnlockSchedule.from_config(mem)
        self.head = ReadHead(model)
        self.use_kjt = False
        """Look event features up through torchrec's KJT path (see EventEmbeddings)."""
        self.packed_ops = EAGER_PACKED_OPS
        """The functions ``advance_packed`` runs around its scan's layout: the plain ones, or
        compiled ones (``compile_packed``)."""
        check_fusion_config(model.replay_fusion, model.replay_rank, model.route_dim, mem.key_dim)
        self.fusion: ReplayFusion | None = None
        self.route_proj: RouteProjection | None = None
        # drawn from a fork of the random state: the base model and its training draw the
        # same numbers with or without these modules (replay off is the same model)
        with torch.random.fork_rng(devices=[]):
            if model.replay_fusion != "none":
                self.fusion = ReplayFusion(model.replay_fusion, D, model.replay_rank)
            if model.route_dim > 0:
                self.route_proj = RouteProjection(
                    mem.n_layers * mem.n_heads, mem.key_dim, model.route_dim
                )

    @property
    def embed_dim(self) -> int:
        return self.model_cfg.embed_dim

    def init_state(self, batch: int, device: torch.device | str) -> MemoryState:
        m = self.mem_cfg
        return MemoryState.zeros(
            batch,
            m.n_layers,
            m.n_heads,
            m.key_dim,
            m.value_dim,
            m.momentum,
            self.embed_dim,
            window=self.head.window,
            device=device,
            dtype=self.embed.item_weight().dtype,
            adaptive=self.sched.adaptive,
            keyed_order=self.sched.keyed,
        )

    def item_weight(self) -> torch.Tensor:
        """[n_items, D] the tied output embeddings of the TRAIN items."""
        return self.embed.item_weight()[: self.n_items]

    def advance(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
        *,
        return_kq: bool = False,
        request_ts: torch.Tensor | None = None,
        host_positions: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> AdvanceResult:
        """Apply new events ([B, T], right-padded; ``lengths`` [B] valid counts) to ``state``.
        With ``request_ts`` [B, T] (the time each event's next-item question is asked:
        offline, the next event's timestamp) also the user vector after each event.
        ``host_positions``: (``state.pos``, ``lengths``) as numpy arrays, when the caller
        has them on the host (training does): an adaptive schedule then places its
        decisions without reading the device (else it reads them once per call)."""
        B, T = items.shape
        if T == 0:
            z = state.h.new_zeros(B, 0, self.embed_dim)
            return AdvanceResult(state, z, None, None if request_ts is None else z)
        x, valid, gaps = self._event_inputs(items, actions, ts_ms, lengths, state)
        tokens = x
        plans, order_key = self._schedule_plans(state, items, ts_ms, lengths, host_positions)
        Ss, Ms, ks, qs, unlocks, accs = [], [], [], [], [], []
        for li, layer in enumerate(self.layers):
            M0 = None if state.M is None else state.M[:, li]
            plan = None if plans is None else plans[li]
            x, res, kq = layer(x, state.S[:, li], M0, state.pos, lengths, return_kq, plan)
            Ss.append(res.S)
            Ms.append(res.M)
            unlocks.append(res.unlocks)
            accs.append(res.acc)
            if kq is not None:
                ks.append(kq[0])
                qs.append(kq[1])
        out = x * valid[..., None]
        new_state = self._state_after(
            state, items, actions, ts_ms, lengths, valid, gaps, at_last_event(out, lengths),
            (Ss, Ms, _stacked(unlocks), _stacked(accs), order_key),
        )  # fmt: skip
        kq_out = (torch.stack(ks, dim=2), torch.stack(qs, dim=2)) if return_kq else None
        user = None
        if request_ts is not None:
            user = self._head(out, ts_ms, request_ts, state, tokens, valid, ts_ms)
        return AdvanceResult(new_state, out, kq_out, user)

    @property
    def packs(self) -> bool:
        """Whether ``advance_packed`` applies: the uniform schedule in prefix order (the
        adaptive and keyed schedules run ``advance``) and ``memory.backend`` auto (a named
        backend runs ``advance``, on that backend)."""
        sched = self.sched
        return not sched.adaptive and sched.order == "prefix" and self.mem_cfg.backend == "auto"

    def compile_packed(self, *, cpp_wrapper: bool = True) -> None:
        """Run ``advance_packed``'s dense parts and chunk algebra as torch.compile graphs
        (``compiled_packed_ops``); ``warm_up_packed`` then makes the graphs."""
        self.packed_ops = compiled_packed_ops(cpp_wrapper=cpp_wrapper)

    @torch.no_grad()
    def warm_up_packed(self, device: torch.device | str, max_rounds: int = 6) -> int:
        """Run ``advance_packed`` on made-up batches of changing sizes (users of 1 to 40
        events at positions across the schedule's unlocks) until one adds no compiled
        graph, so that a compiled model (``compile_packed``) compiles now and not on the
        first real batch; returns the rounds run. Leaves no trace in the model."""
        from torch._dynamo.utils import counters

        gen = torch.Generator().manual_seed(0)
        horizon = max(1, self.sched.scan_horizon)
        for r in range(max_rounds):
            graphs = counters["stats"]["unique_graphs"]
            B = 23 + 9 * r
            lengths = torch.randint(1, 41, (B,), generator=gen)
            lengths[: B // 3] = torch.randint(1, 4, (B // 3,), generator=gen)
            T = int(lengths.max())
            items = torch.randint(0, self.n_items, (B, T), generator=gen)
            ts = torch.cumsum(torch.randint(1, 10**6, (B, T), generator=gen), 1)
            state = self.init_state(B, device)
            state.pos = torch.randint(0, 2 * horizon, (B,), generator=gen).to(device)
            self.advance_packed(
                items.to(device), torch.zeros_like(items).to(device), ts.to(device),
                lengths.to(device), state, return_kq=True,
            )  # fmt: skip
            if r > 0 and counters["stats"]["unique_graphs"] == graphs:
                return r + 1
        return max_rounds

    @torch.no_grad()
    def advance_packed(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
        *,
        return_kq: bool = False,
    ) -> AdvanceResult:
        """``advance`` (no autograd, no request times; ``packs`` must hold) computing only the
        events: the embeddings, projections and feed-forward blocks run on the N valid events
        of the right-padded [B, T] batch, the memory scan on packed events
        (``models/memory/packed.py``: one aligned chunked scan for the users with a few
        events or more, one recurrent scan for the others). For an ingest batch of users of very different lengths
        this is a few dozen large operations instead of hundreds of small ones per length
        bucket. ``outputs`` [N, D] and (k~, q~) [N, L, H, K] are packed: user b's events
        are rows sum(lengths[:b]) ... in order. Same results as ``advance`` (within float
        rounding: the sums run in another order)."""
        if not self.packs:
            raise ValueError(
                "advance_packed needs the uniform schedule in prefix order and memory.backend auto"
            )
        B, T = items.shape
        valid, gaps = self._valid_gaps(items, ts_ms, lengths, state)
        flat = valid.flatten().nonzero().flatten()  # row-major: user by user, in order
        n = flat.shape[0]
        ones = torch.ones(n, dtype=lengths.dtype, device=items.device)

        def packed(a: torch.Tensor) -> torch.Tensor:
            return a.flatten().index_select(0, flat)

        x = self.embed(
            packed(items)[:, None], packed(actions)[:, None], packed(gaps)[:, None], ones,
            use_kjt=self.use_kjt,
        )[:, 0]  # fmt: skip
        x = self.embed_dropout(self.embed_norm(x))
        positions = packed(state.pos[:, None] + torch.arange(1, T + 1, device=items.device))
        Ss, Ms, ks, qs = [], [], [], []
        for li, layer in enumerate(self.layers):
            assert isinstance(layer, MemoryLayer)
            M0 = None if state.M is None else state.M[:, li]
            x, S, M, kq = layer.forward_packed(
                x, state.S[:, li], M0, state.pos, lengths, positions, return_kq, self.packed_ops
            )
            Ss.append(S)
            Ms.append(M)
            if kq is not None:
                ks.append(kq[0])
                qs.append(kq[1])
        last = torch.clamp(torch.cumsum(lengths, 0) - 1, min=0)
        new_state = self._state_after(
            state, items, actions, ts_ms, lengths, valid, gaps, x[last] if n else state.h,
            (Ss, Ms, state.unlocks, state.unlock_acc, state.order_key),
        )  # fmt: skip
        kq_out = (torch.stack(ks, dim=1), torch.stack(qs, dim=1)) if return_kq else None
        return AdvanceResult(new_state, x, kq_out)

    def _state_after(
        self,
        state: MemoryState,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        valid: torch.Tensor,
        gaps: torch.Tensor,
        last_out: torch.Tensor,
        layers: tuple[
            list[torch.Tensor], list[torch.Tensor | None], torch.Tensor | None,
            torch.Tensor | None, torch.Tensor | None,
        ],
    ) -> MemoryState:  # fmt: skip
        """The state after new events [B, T]: ``last_out`` [B, D] the read-out at each
        user's last event, ``layers`` the layers' S and M, unlock counts and signal sums
        ([B, L] or None) and the block-order keys."""
        Ss, Ms, unlocks, unlock_acc, order_key = layers
        has = lengths > 0
        return MemoryState(
            S=torch.stack(Ss, dim=1),
            M=None if state.M is None else torch.stack([m for m in Ms if m is not None], dim=1),
            pos=state.pos + lengths,
            last_ts=torch.where(has, at_last_event(ts_ms, lengths), state.last_ts),
            h=torch.where(has[:, None], last_out, state.h),
            **self._shift_window(state, items, actions, gaps, ts_ms, valid, lengths),
            unlocks=unlocks,
            unlock_acc=unlock_acc,
            order_key=order_key,
        )

    def _valid_gaps(
        self, items: torch.Tensor, ts_ms: torch.Tensor, lengths: torch.Tensor, state: MemoryState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """valid [B, T] and the events' time-gap buckets [B, T] (0 at padding) of new events."""
        T = items.shape[1]
        valid = torch.arange(T, device=items.device)[None, :] < lengths[:, None]
        gaps = time_gap_buckets(
            ts_ms, previous_ts(ts_ms, state.last_ts), self.model_cfg.n_time_buckets
        )
        return valid, torch.where(valid, gaps, 0)

    def _schedule_plans(
        self,
        state: MemoryState,
        items: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        host_positions: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[list[LayerPlan] | None, torch.Tensor | None]:
        """Each layer's unlock-schedule inputs for new events [B, T] (None: the uniform
        schedule in prefix order needs none) and the users' block-order keys after them
        (a user's first event sets its key)."""
        sched = self.sched
        key = state.order_key
        if not sched.adaptive and sched.order == "prefix":
            return None, key
        B = items.shape[0]
        if sched.keyed:
            assert key is not None, "the state lacks its block-order keys"
            fresh = (state.pos == 0) & (lengths > 0)
            key = torch.where(fresh, order_keys(items[:, 0], ts_ms[:, 0]), key)
        blocks = block_order(sched, key, B, items.device)
        rows = None if blocks is None else row_order(blocks, self.mem_cfg.key_dim)
        signal = self._drift(state, items, lengths) if sched.unlock == "drift" else None
        call = None
        if sched.adaptive:
            call = AdaptiveCall(state.pos, lengths, items.shape[1], sched.delta, host_positions)
        plans = []
        for li in range(len(self.layers)):
            plans.append(
                LayerPlan(
                    rows,
                    None if state.unlocks is None else state.unlocks[:, li],
                    None if state.unlock_acc is None else state.unlock_acc[:, li],
                    signal,
                    call,
                )
            )
        return plans, key

    @torch.no_grad()
    def _drift(
        self, state: MemoryState, items: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """[B, T] interest drift of new events against the state's window and the new events
        before them (``schedule.drift_signal``), on the item embedding table."""
        table = self.embed.item_weight()
        T = items.shape[1]
        valid = torch.arange(T, device=items.device)[None, :] < lengths[:, None]
        new = F.embedding(torch.where(valid, items, 0), table)
        ok = state.win_items != NO_ITEM
        old = F.embedding(torch.where(ok, state.win_items, 0), table)
        return drift_signal(new, valid, old, ok)

    def _window_tokens(self, state: MemoryState) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, W, D] of the state's window events (as the memory layers took them
        in) and their validity [B, W]."""
        ok = state.win_items != NO_ITEM
        x = self.embed(
            torch.where(ok, state.win_items, 0),
            state.win_actions,
            state.win_gaps,
            torch.full_like(state.pos, state.window),
        )
        return self.embed_dropout(self.embed_norm(x)) * ok[..., None], ok

    def _head(
        self,
        mem: torch.Tensor,
        last_ts: torch.Tensor,
        request_ts: torch.Tensor,
        state: MemoryState,
        new_tokens: torch.Tensor,
        new_ok: torch.Tensor,
        new_ts: torch.Tensor,
    ) -> torch.Tensor:
        """The head at each new event ([B, T]): its window is the state's window followed by
        the new events."""
        if self.head.window == 0:
            return self.head(mem, last_ts, request_ts)
        old, old_ok = self._window_tokens(state)
        tokens = torch.cat([old, new_tokens], dim=1)
        token_ts = torch.cat([state.win_ts, new_ts], dim=1)
        token_ok = torch.cat([old_ok, new_ok], dim=1)
        return self.head(mem, last_ts, request_ts, tokens, token_ts, token_ok, state.window)

    def _shift_window(
        self,
        state: MemoryState,
        items: torch.Tensor,
        actions: torch.Tensor,
        gaps: torch.Tensor,
        ts_ms: torch.Tensor,
        valid: torch.Tensor,
        lengths: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The window after the new events: the last W of (old window, new valid events)."""
        W = state.window
        if W == 0:
            return {k: v for k, v in state.to_fields().items() if k.startswith("win_")}
        idx = lengths[:, None] + torch.arange(W, device=items.device)[None, :]  # [B, W]
        out = {}
        for name, new, empty in (
            ("win_items", items, NO_ITEM),
            ("win_actions", actions, 0),
            ("win_gaps", gaps, 0),
            ("win_ts", ts_ms, -1),
        ):
            new = torch.where(valid, new, empty)
            both = torch.cat([getattr(state, name), new], dim=1)
            out[name] = torch.gather(both, 1, idx)
        return out

    def push_window(
        self,
        state: MemoryState,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
    ) -> MemoryState:
        """``state`` with new events ([B, T], right-padded) in its window and last event
        time, the memory untouched: a rank request's context events, whose memory read-out
        comes from a replay on a copy (``replay_read``)."""
        T = items.shape[1]
        valid, gaps = self._valid_gaps(items, ts_ms, lengths, state)
        window = self._shift_window(state, items, actions, gaps, ts_ms, valid, lengths)
        fields = state.to_fields()
        fields.update(window)
        if T:
            has = lengths > 0
            fields["last_ts"] = torch.where(has, at_last_event(ts_ms, lengths), state.last_ts)
        return MemoryState.from_fields(fields)

    def read_user(
        self,
        state: MemoryState,
        request_ts: torch.Tensor,
        mem: torch.Tensor | None = None,
        replayed: torch.Tensor | None = None,
        replayed_ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """User vectors [B, D] of ``state`` for requests at ``request_ts`` [B] (ms): the head
        over the stored memory read-out (or ``mem`` [B, D], e.g. after a request's context
        events) and the stored window; what ``advance`` gives for the latest event at the
        same request time. ``replayed`` [B, D]: the read-out after a NoteBank replay, for the
        rows ``replayed_ok`` [B] (default all), combined with the live one by ``fuse``."""
        m = state.h if mem is None else mem
        if replayed is not None:
            fused = self.fuse(m, replayed)
            m = fused if replayed_ok is None else torch.where(replayed_ok[:, None], fused, m)
        m = m[:, None]
        req = request_ts[:, None]
        last = state.last_ts[:, None]
        if self.head.window == 0:
            return self.head(m, last, req)[:, 0]
        tokens, ok = self._window_tokens(state)
        return self.head(m, last, req, tokens, state.win_ts, ok, state.window - 1)[:, 0]

    def fuse(self, live: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
        """The memory read-out the head reads after a replay: the learned fusion of the live
        and the replayed read-out (``model.replay_fusion``), or without one the replayed."""
        return replayed if self.fusion is None else self.fusion(live, replayed)

    @property
    def route_dim(self) -> int:
        """Dimensions of the routing queries ``route_features`` gives (K without a learned
        projection)."""
        return self.mem_cfg.key_dim if self.route_proj is None else self.model_cfg.route_dim

    def route_features(self, q_tilde: torch.Tensor) -> torch.Tensor:
        """The NoteBank's query features of masked queries q~ [..., L, H, K]: q~ itself, or
        its learned projection (``model.route_dim``) [..., L, H, d]."""
        return q_tilde if self.route_proj is None else self.route_proj(q_tilde)

    def _event_inputs(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input x [B, T, D] for new events, valid [B, T] and the events'
        time-gap buckets [B, T]."""
        valid, gaps = self._valid_gaps(items, ts_ms, lengths, state)
        x = self.embed(
            torch.where(valid, items, 0),
            torch.where(valid, actions, 0),
            gaps,
            lengths,
            use_kjt=self.use_kjt,
        )
        return self.embed_dropout(self.embed_norm(x)), valid, gaps

    @torch.no_grad()
    def replay_read(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
    ) -> torch.Tensor:
        """``advance(...).state.h`` without computing the state after the events: the memory
        read-outs [B, D] after running new events ([B, T], right-padded) on a copy of
        ``state`` (rows with no events keep ``state.h``); ``read_user`` with ``mem`` turns
        them into user vectors. Each layer takes the read-out-only
        form of the rule (``memory_readout``). The rank path's replay; no autograd, and on
        CUDA no host synchronisation (``models.graphs`` captures it)."""
        T = items.shape[1]
        if T == 0:
            return state.h.clone()
        x, _, _ = self._event_inputs(items, actions, ts_ms, lengths, state)
        plans, _ = self._schedule_plans(state, items, ts_ms, lengths)
        top = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            assert isinstance(layer, MemoryLayer)
            M0 = None if state.M is None else state.M[:, li]
            # the last layer is only read at each user's last event
            x = layer.forward_readout(
                x, state.S[:, li], M0, state.pos, lengths, last_only=li == top,
                plan=None if plans is None else plans[li],
            )  # fmt: skip
        return torch.where((lengths > 0)[:, None], x[:, 0], state.h)

    def read_only(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        state: MemoryState,
        *,
        prev_ts: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Memory read-outs [B, D] of ``state`` for one event per user (items, actions,
        ts_ms [B]) WITHOUT writing it: each layer reads its state with the event's q~
        (``MemoryLayer.read``), the next layer takes the previous layer's output as in
        ``advance``. ``state`` is not changed.

        The event's time-gap feature is measured from ``prev_ts`` [B] (the ts of the event
        before it in the user's history, -1 for none; default ``state.last_ts``); it is read
        at lifetime ``positions`` [B] (default ``state.pos``, at least 1). For the user's
        latest applied event with its own previous ts, on the live state, this equals the
        read-out ``advance`` gave for it (the rule reads after the write). Tried as the
        NoteBank replay read-out on the replayed copy instead of re-running the event
        (offline_eval.notebank_eval final_pass "read_only"); on ML-100K VALID it scored
        lower than the re-run (reports/ml-100k-notebank-tuning/README.md, section
        "Read-only read-out after replay"), so the rank path keeps the re-run."""
        prev = state.last_ts if prev_ts is None else prev_ts
        pos = state.pos if positions is None else positions
        pos = torch.clamp(pos, min=1)
        gaps = time_gap_buckets(ts_ms, prev, self.model_cfg.n_time_buckets)
        ones = torch.ones_like(items)
        x = self.embed(items[:, None], actions[:, None], gaps[:, None], ones, use_kjt=self.use_kjt)
        x = self.embed_dropout(self.embed_norm(x))[:, 0]
        plans, _ = self._schedule_plans(
            state, items[:, None], ts_ms[:, None], torch.zeros_like(items)
        )
        sched = self.sched
        for li, layer in enumerate(self.layers):
            assert isinstance(layer, MemoryLayer)
            at = pos
            if sched.adaptive and state.unlocks is not None:
                # a position whose uniform mask is the layer's open blocks
                n_open = torch.clamp(state.unlocks[:, li] + 1, max=sched.n_blocks)
                at = (n_open - 1) * sched.delta + 1
            x = layer.read(x, state.S[:, li], at, None if plans is None else plans[li])
        return x

    def score(self, user_vec: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n_items] over the TRAIN catalog, or [B, C] for candidate indices [B, C]."""
        if items is None:
            return user_vec @ self.item_weight().T
        cand = F.embedding(items, self.embed.item_weight())
        return torch.einsum("bd,bcd->bc", user_vec, cand)

    # Scorer protocol (offline_eval.evaluate) -------------------------------------------

    def item_matrix(self) -> torch.Tensor:
        return self.item_weight().detach()

    @torch.no_grad()
    def user_vectors(
        self,
        seqs: EventSeqs,
        query_rows: np.ndarray,
        request_ts: np.ndarray | None = None,
        batch_users: int = 256,
    ) -> torch.Tensor:
        """[n, D] user vector after event row r (the user's events up to and including r),
        for each r in ``query_rows``, asked at ``request_ts`` (ms; default: the time of the
        user's next event, else of r itself); each batch of users runs once through
        ``advance``."""
        was_training = self.training
        self.eval()
        try:
            rows = np.asarray(query_rows, dtype=np.int64)
            req = next_event_ts(seqs, rows) if request_ts is None else np.asarray(request_ts)
            return _gather_user_vectors(self, seqs, rows, req, batch_users)
        finally:
            self.train(was_training)


def _stacked(per_layer: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[B, L] from one [B] tensor per layer, or None when the layers have none."""
    kept = [t for t in per_layer if t is not None]
    return torch.stack(kept, dim=1) if kept else None


def next_event_ts(seqs: EventSeqs, rows: np.ndarray) -> np.ndarray:
    """Time of the event after each row in its user's sequence (the row's own time for a
    user's last event): offline, the time a next-item question about that row is asked."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return np.zeros(0, dtype=np.int64)
    end = seqs.offsets[seqs.user_of_event()[rows] + 1]
    return seqs.ts_ms[np.where(rows + 1 < end, rows + 1, rows)]


def _gather_user_vectors(
    model: MemoryRecommender,
    seqs: EventSeqs,
    rows: np.ndarray,
    request_ts: np.ndarray,
    batch_users: int,
) -> torch.Tensor:
    weight = model.embed.item_weight()
    device = weight.device
    result = torch.zeros(len(rows), model.embed_dim, device=device, dtype=weight.dtype)
    if len(rows) == 0:
        return result
    user_of = seqs.user_of_event()[rows]
    pos_in = rows - seqs.offsets[user_of]
    users = np.unique(user_of)
    # Only the events up to each user's last query row are needed.
    need = np.zeros(seqs.n_users, dtype=np.int64)
    np.maximum.at(need, user_of, pos_in + 1)
    order = users[np.argsort(need[users], kind="stable")]
    for start in range(0, len(order), batch_users):
        batch = order[start : start + batch_users]
        items, actions, ts, lengths = padded_batch(seqs, batch, need[batch], device)
        slot = np.full(seqs.n_users, -1, dtype=np.int64)
        slot[batch] = np.arange(len(batch))
        sel = np.nonzero(slot[user_of] >= 0)[0]
        # every event is asked at its next event's time, the queries at theirs
        req = np.zeros(items.shape, dtype=np.int64)
        valid = np.arange(items.shape[1])[None, :] < need[batch][:, None]
        ev_rows = seqs.offsets[batch][:, None] + np.arange(items.shape[1])[None, :]
        req[valid] = next_event_ts(seqs, ev_rows[valid])
        req[slot[user_of[sel]], pos_in[sel]] = request_ts[sel]
        res = model.advance(
            items, actions, ts, lengths, model.init_state(len(batch), device),
            request_ts=torch.as_tensor(req, device=device),
            host_positions=(np.zeros(len(batch), dtype=np.int64), need[batch]),
        )  # fmt: skip
        assert res.user is not None
        b_idx = torch.as_tensor(slot[user_of[sel]], device=device)
        t_idx = torch.as_tensor(pos_in[sel], device=device)
        result[torch.as_tensor(sel, device=device)] = res.user[b_idx, t_idx]
    return result


def padded_batch(
    seqs: EventSeqs,
    users: np.ndarray,
    lengths: np.ndarray,
    device: torch.device | str,
    start: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] items, actions, ts_ms and lengths [B] of events
    ``start[b] .. start[b] + lengths[b]`` (relative to each user's first event)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B, T = len(users), int(lengths.max()) if len(users) else 0
    first = seqs.offsets[users] + (0 if start is None else start)
    cols = np.arange(T)[None, :]
    mask = cols < lengths[:, None]
    idx = np.where(mask, first[:, None] + cols, 0)

    def take(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.where(mask, a[idx], 0).astype(np.int64), device=device)

    del B
    return (
        take(seqs.items),
        take(seqs.actions),
        take(seqs.ts_ms),
        torch.as_tensor(lengths, device=device),
    )
