"""The fixed-shape training step (models/train_step.py) equals the plain step: padding
users and events and weighting the loss instead of gathering targets change nothing."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from models.recommender import MemoryRecommender
from models.train_step import SegmentBatch, StaticSegmentStep
from recmem.config import Config

N_ITEMS = 25


def model_pair(hybrid: str) -> tuple[MemoryRecommender, MemoryRecommender]:
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_blocks, cfg.memory.horizon = 2, 6
    cfg.model.embed_dim, cfg.model.dropout = 16, 0.0
    cfg.model.hybrid, cfg.model.request_time, cfg.model.window = hybrid, "gap_clock", 4
    torch.manual_seed(0)
    a = MemoryRecommender(N_ITEMS, 3, cfg.memory, cfg.model).double()
    b = MemoryRecommender(N_ITEMS, 3, cfg.memory, cfg.model).double()
    b.load_state_dict(a.state_dict())
    return a, b


def segment(rng: np.random.Generator, b: int, t: int) -> SegmentBatch:
    items = rng.integers(0, N_ITEMS + 3, (b, t))
    ts = 10**12 + np.cumsum(rng.integers(0, 10**6, (b, t)), axis=1)
    lengths = rng.integers(1, t + 1, b)
    lengths[0] = t
    valid = np.arange(t)[None, :] < lengths[:, None]
    targets = rng.integers(0, N_ITEMS + 3, (b, t))
    weights = valid & (targets < N_ITEMS)
    return SegmentBatch(
        np.where(valid, items, 0), rng.integers(0, 6, (b, t)), np.where(valid, ts, 0),
        np.where(valid, ts + 5_000, 0), np.where(weights, targets, 0),
        weights.astype(np.float32), lengths,
    )  # fmt: skip


def plain_step(model, optim, seg, state, scale=1.0):
    """The gather form of the step (what MemoryEpoch._batch does); ``scale`` multiplies the
    loss that is back-propagated (train.loss_weight = target)."""
    t = lambda a: torch.as_tensor(a)  # noqa: E731
    res = model.advance(t(seg.items), t(seg.actions), t(seg.ts), t(seg.lengths), state,
                        request_ts=t(seg.request_ts))  # fmt: skip
    flat = torch.as_tensor(np.flatnonzero(seg.weights))
    user = res.user.reshape(-1, res.user.shape[-1]).index_select(0, flat)
    tgt = t(seg.targets).reshape(-1).index_select(0, flat)
    loss = F.cross_entropy(user @ model.item_weight().T, tgt)
    optim.zero_grad()
    (loss * scale).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    return (loss * scale).detach(), res.state.detach()


def test_static_step_equals_the_plain_step() -> None:
    rng = np.random.default_rng(0)
    for hybrid in ("none", "mac"):
        a, b = model_pair(hybrid)
        oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
        ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
        step = StaticSegmentStep(b, ob, B=5, T=9, device=torch.device("cpu"), graph=True)
        state_a = a.init_state(3, "cpu").map(lambda x: x.double() if x.is_floating_point() else x)
        state_b = None
        for _ in range(3):  # three segments: the state carries over, padded rows stay empty
            seg = segment(rng, 3, 7)
            la, state_a = plain_step(a, oa, seg, state_a)
            lb, out = step.run(seg, state_b)
            state_b = out
            torch.testing.assert_close(lb, la)
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                torch.testing.assert_close(pb, pa)
            for name, x in state_a.to_fields().items():
                torch.testing.assert_close(out.to_fields()[name][:3], x)
            assert int(out.pos[3:].abs().sum()) == 0 and float(out.S[3:].abs().sum()) == 0
        assert step.graph is None  # no capture off CUDA


def test_static_step_with_a_norm_equals_the_scaled_plain_step() -> None:
    """train.loss_weight = target: the step's loss is its targets' sum over a norm (the
    epoch's mean targets per step), in both forms of the step."""
    rng = np.random.default_rng(1)
    a, b = model_pair("mac")
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    step = StaticSegmentStep(b, ob, B=4, T=8, device=torch.device("cpu"), graph=False)
    state_a = a.init_state(3, "cpu").map(lambda x: x.double() if x.is_floating_point() else x)
    state_b = None
    for norm in (7.5, 30.0):
        seg = segment(rng, 3, 7)
        seg.norm = norm
        n = float(seg.weights.sum())
        la, state_a = plain_step(a, oa, seg, state_a, scale=n / norm)
        lb, state_b = step.run(seg, state_b)
        torch.testing.assert_close(lb, la)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pb, pa)
