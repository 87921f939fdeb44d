"""The memory model's training step at fixed shapes, replayed through a CUDA graph.

A training step of the memory model is a few thousand small kernels (two memory layers in
the chunked form, forward and backward, the read-out head, the loss, AdamW); on a GPU it is
bound by their launches, not by arithmetic. ``StaticSegmentStep`` runs one truncated-BPTT
segment at a fixed batch shape [B, T]: the batch is padded with users without events, the
segment with padding events, and the loss is the mean cross-entropy over a weight mask
(1 at real targets) instead of a gather of the real ones, so that no shape and no value
read on the host depends on the data. On CUDA the whole step (forward, backward, gradient
clipping and a capturable AdamW whose learning rate is a device tensor) is captured once in
a CUDA graph after a few eager warm-up steps on a side stream, and every later step copies
its inputs into the graph's buffers and replays it.

The same function runs eagerly on the CPU (tests compare it with the plain step); a capture
that fails logs one warning and the step stays eager. The capture needs the fused training
kernels (``memory.train_backend`` auto or triton on CUDA, the default): with the eager
chunked form it fails, because cumprod's backward checks its input for zeros on the host.
With the Triton kernels it was captured on the H200 (bench/results/train_h200_identity.json).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.recommender import MemoryRecommender
from models.state import MemoryState

log = logging.getLogger(__name__)

WARMUP_STEPS = 3
"""Eager steps on a side stream before the capture (lazy initialisation, AdamW state)."""
MAX_LOGIT_ELEMENTS = 600_000_000
"""The static step scores every position of the batch against the whole catalog: above
this many logits (B * T * items) it is not used (the plain step gathers the real targets)."""


@dataclass
class SegmentBatch:
    """One segment of a batch on the host, [B, T] right-padded: inputs, request times,
    next-item targets and the target weights (1 = a real target), lengths [B]."""

    items: np.ndarray
    actions: np.ndarray
    ts: np.ndarray
    request_ts: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    lengths: np.ndarray
    norm: float = 0.0
    """The loss is sum(weights * cross-entropy) / norm (0: the sum of the weights, the mean
    over the real targets)."""


def static_step_fits(batch: int, segment: int, n_items: int) -> bool:
    return batch * segment * n_items <= MAX_LOGIT_ELEMENTS


class StaticSegmentStep:
    """Training steps of ``model`` at the fixed shape [B, T]; see the module docstring."""

    def __init__(
        self,
        model: MemoryRecommender,
        optim: torch.optim.Optimizer,
        B: int,
        T: int,
        device: torch.device,
        graph: bool,
    ) -> None:
        self.model, self.optim, self.B, self.T, self.device = model, optim, B, T, device
        z = torch.zeros

        def ints() -> torch.Tensor:
            return z(B, T, dtype=torch.int64, device=device)

        self.items, self.actions, self.ts, self.request_ts = ints(), ints(), ints(), ints()
        self.targets = ints()
        self.weights = z(B, T, device=device)
        self.lengths = z(B, dtype=torch.int64, device=device)
        self.norm = torch.ones((), device=device)
        self.state = model.init_state(B, device)
        self.loss = z((), device=device)
        self.out_state: MemoryState | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.want_graph = graph and device.type == "cuda"
        self.eager_steps = 0

    # the step itself ---------------------------------------------------------------------

    def _forward_backward(self) -> tuple[torch.Tensor, MemoryState]:
        model = self.model
        res = model.advance(
            self.items, self.actions, self.ts, self.lengths, self.state,
            request_ts=self.request_ts,
        )  # fmt: skip
        assert res.user is not None
        logits = res.user.reshape(-1, res.user.shape[-1]) @ model.item_weight().T
        ce = F.cross_entropy(logits, self.targets.reshape(-1), reduction="none")
        w = self.weights.reshape(-1)
        loss = (ce * w).sum() / self.norm
        self.optim.zero_grad(set_to_none=False)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.optim.step()
        return loss.detach(), res.state.detach()

    def _load(self, seg: SegmentBatch, state: MemoryState | None) -> None:
        """Copy a segment (padded to [B, T]) and the incoming state into the buffers."""
        b, t = seg.items.shape
        if b > self.B or t > self.T:
            raise ValueError(f"segment [{b}, {t}] exceeds the static shape [{self.B}, {self.T}]")
        for buf, arr in (
            (self.items, seg.items),
            (self.actions, seg.actions),
            (self.ts, seg.ts),
            (self.request_ts, seg.request_ts),
            (self.targets, seg.targets),
            (self.weights, seg.weights),
        ):
            host = np.zeros(buf.shape, dtype=arr.dtype)
            host[:b, :t] = arr
            buf.copy_(_pinned(host), non_blocking=True)
        norm = seg.norm if seg.norm > 0 else max(float(seg.weights.sum()), 1.0)
        self.norm.copy_(_pinned(np.asarray(norm, dtype=np.float32)), non_blocking=True)
        lengths = np.zeros(self.B, dtype=np.int64)
        lengths[:b] = seg.lengths
        self.lengths.copy_(_pinned(lengths), non_blocking=True)
        src = state if state is not None else self.model.init_state(self.B, self.device)
        for name, dst in self.state.to_fields().items():
            dst.copy_(src.to_fields()[name])

    def run(self, seg: SegmentBatch, state: MemoryState | None) -> tuple[torch.Tensor, MemoryState]:
        """One optimizer step on ``seg`` from ``state`` (None = new users). Returns the loss
        (a device scalar) and the state after the segment ([B, ...], padded rows included;
        valid until the next call)."""
        self._load(seg, state)
        if self.graph is not None:
            self.graph.replay()
            assert self.out_state is not None
            return self.loss, self.out_state
        if not self.want_graph:
            return self._forward_backward()
        if self.eager_steps < WARMUP_STEPS:
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss, out = self._forward_backward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.eager_steps += 1
            return loss, out
        return self._capture()

    def _capture(self) -> tuple[torch.Tensor, MemoryState]:
        """Capture the step (its first replay is this step); on failure stay eager."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                loss, out = self._forward_backward()
                self.loss.copy_(loss)
        except Exception as e:  # noqa: BLE001 - any capture failure: keep training eagerly
            log.warning("CUDA graph capture of the training step failed (%s); eager steps", e)
            self.want_graph = False
            torch.cuda.synchronize(self.device)
            return self._forward_backward()
        self.graph, self.out_state = graph, out
        log.info("training step captured in a CUDA graph at [%d, %d]", self.B, self.T)
        graph.replay()
        return self.loss, out


def _pinned(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.pin_memory() if torch.cuda.is_available() else t
