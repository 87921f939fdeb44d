"""The compiled packed step (``state.compile_step``, models/memory/compiled.py) gives the
plain step's results, and after its warm-up a batch of new sizes compiles nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from models.config import MemoryConfig, ModelConfig
from models.recommender import EAGER_PACKED_OPS, MemoryRecommender

pytestmark = pytest.mark.slow

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def compiling() -> Iterator[None]:
    """torch.compile on (tests/conftest.py turns it off for the suite)."""
    with torch._dynamo.config.patch(disable=False):
        yield


def batch(model: MemoryRecommender, B: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Users of 0 to 40 events (both scans: 1-3 and 4+), positions across the unlocks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 41, (B,), generator=g)
    lengths[: B // 3] = torch.randint(1, 4, (B // 3,), generator=g)
    lengths[-1] = 0
    T = int(lengths.max())
    items = torch.randint(0, model.n_items, (B, T), generator=g)
    actions = torch.randint(0, 3, (B, T), generator=g)
    ts = torch.cumsum(torch.randint(1, 10**6, (B, T), generator=g), 1)
    pos = torch.randint(0, 3 * model.mem_cfg.horizon, (B,), generator=g)
    return items, actions, ts, lengths, pos


def test_compiled_step_equals_the_plain_one_and_compiles_nothing_after_warm_up(compiling):
    torch.manual_seed(0)
    model = MemoryRecommender(200, 4, MemoryConfig(horizon=64), ModelConfig()).eval()
    warm = MemoryRecommender(200, 4, MemoryConfig(horizon=64), ModelConfig()).eval()
    warm.compile_packed()
    graphs = counters["stats"]["unique_graphs"]
    warm.warm_up_packed("cpu")  # another model of the same shapes: graphs are shared
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile
    graphs = counters["stats"]["unique_graphs"]
    compiled_ops = warm.packed_ops
    for B, seed in ((37, 1), (58, 2)):
        items, actions, ts, lengths, pos = batch(model, B, seed)
        state = model.init_state(B, "cpu")
        state.S.normal_(0, 0.1)
        state.M.normal_(0, 0.1)
        state.pos = pos
        results = []
        for ops in (EAGER_PACKED_OPS, compiled_ops):
            model.packed_ops = ops
            with torch._dynamo.config.patch(error_on_recompile=True):
                results.append(
                    model.advance_packed(items, actions, ts, lengths, state, return_kq=True)
                )
        plain, compiled = results
        torch.testing.assert_close(compiled.outputs, plain.outputs, **FP32)
        torch.testing.assert_close(compiled.state.S, plain.state.S, **FP32)
        torch.testing.assert_close(compiled.state.M, plain.state.M, **FP32)
        torch.testing.assert_close(compiled.state.h, plain.state.h, **FP32)
        for a, b in zip(compiled.kq, plain.kq):
            torch.testing.assert_close(a, b, **FP32)
        # a user without events keeps its state's bits
        assert torch.equal(compiled.state.S[-1], state.S[-1])
    assert counters["stats"]["unique_graphs"] == graphs  # new sizes: no new graph
