"""The read-out-only form (rank-time replay on a copy) equals the reference's outputs for
every schedule, across Proteus unlocks, with padding; ``memory_readout`` dispatches to it
or to the scan; and the model's ``replay_read`` equals ``advance(...).state.h``."""

from __future__ import annotations

import pytest
import torch

from models.memory.naive import memory_scan_reference
from models.memory.ops import (
    CPU_READOUT_MIN_EVENTS,
    CPU_READOUT_MIN_USERS,
    memory_readout,
)
from models.memory.readout import READOUT_MAX_EVENTS, memory_readout_chunk
from tests.models.test_memory import make_inputs
from tests.models.test_recommender import advance, batch, small_model

TIGHT = dict(rtol=1e-10, atol=1e-10)


def assert_matches_reference(inp, kw):
    y_ref, _, _ = memory_scan_reference(**inp, **kw)
    before = {k: v.clone() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    y = memory_readout_chunk(**inp, **kw)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    T = inp["q"].shape[1]
    pad = torch.arange(T)[None, :] >= inp["lengths"][:, None]
    assert not y[pad].any()
    for k, v in before.items():
        assert torch.equal(inp[k], v), f"{k} was changed"


@pytest.mark.parametrize("momentum", [True, False])
def test_readout_equals_reference_across_unlocks(momentum):
    """Users before, across (several unlocks in one run) and past the schedule, idle users,
    K not a multiple of the blocks."""
    inp = make_inputs(7, 13, 2, 10, 5, momentum=momentum, seed=3)
    inp["pos0"] = torch.tensor([0, 3, 7, 11, 2, 40, 5])
    inp["lengths"] = torch.tensor([13, 0, 1, 5, 12, 13, 2])
    assert_matches_reference(inp, dict(n_blocks=3, horizon=12))


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    ("n_blocks", "horizon"), [(1, 8), (4, 24), (4, 40), (5, 16), (8, 4), (2, 100)]
)
def test_readout_equals_reference_for_other_schedules(momentum, n_blocks, horizon):
    inp = make_inputs(6, 21, 2, 12, 4, momentum=momentum, seed=n_blocks * horizon, max_pos=60)
    assert_matches_reference(inp, dict(n_blocks=n_blocks, horizon=horizon))


def test_readout_handles_gates_at_their_limits():
    """Gates of exactly 0 and 1 (products are cumulative, never ratios)."""
    inp = make_inputs(3, 9, 2, 8, 4, seed=5)
    inp["eta"][0] = 0.0
    inp["alpha"][1] = 1.0
    inp["theta"][2, ::2] = 0.0
    assert_matches_reference(inp, dict(n_blocks=2, horizon=8))


def test_readout_rejects_long_runs():
    inp = make_inputs(1, READOUT_MAX_EVENTS + 1, 1, 4, 2, seed=0)
    with pytest.raises(ValueError, match="at most"):
        memory_readout_chunk(**inp, n_blocks=1, horizon=4)


@pytest.mark.parametrize(
    ("B", "T", "backend"),
    [
        (1, 3, "auto"),  # narrow: the scan
        (CPU_READOUT_MIN_USERS, 3, "auto"),  # wide in users: the one-chunk form
        (1, CPU_READOUT_MIN_EVENTS, "auto"),
        (2, READOUT_MAX_EVENTS + 4, "auto"),  # too long for one chunk: the scan
        (5, 20, "reference"),  # explicit backend: the scan
    ],
)
def test_memory_readout_is_the_scans_output(B, T, backend):
    inp = make_inputs(B, T, 2, 8, 4, seed=B * T, max_pos=30)
    kw = dict(n_blocks=4, horizon=16)
    y_ref, _, _ = memory_scan_reference(**inp, **kw)
    torch.testing.assert_close(memory_readout(**inp, **kw, backend=backend), y_ref, **TIGHT)


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("backend", ["auto", "recurrent"])
def test_replay_read_equals_advance(momentum, backend):
    """From states across the schedule, some users without new events (they keep h)."""
    model = small_model(momentum)
    model.mem_cfg.backend = backend
    items, actions, ts = batch(B=4, T=12)
    start = advance(model, items, actions, ts, torch.tensor([12, 5, 1, 3])).state
    new_items, new_actions, new_ts = batch(B=4, T=10, seed=3)
    new_ts = new_ts + int(ts.max())
    lengths = torch.tensor([10, 0, 7, 4])
    before = start.clone()
    want = model.advance(new_items, new_actions, new_ts, lengths, start.clone()).state.h
    got = model.replay_read(new_items, new_actions, new_ts, lengths, start)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert torch.equal(got[1], start.h[1])
    for a, b in [(before.S, start.S), (before.M, start.M), (before.h, start.h),
                 (before.pos, start.pos)]:  # fmt: skip
        assert a is None or torch.equal(a, b)


def last_rows(y, lengths):
    """Each user's output at its last event, [B, 1, H, V] (zeros for a user without any)."""
    last = (lengths - 1).clamp(min=0)
    out = y[torch.arange(len(lengths)), last][:, None]
    return out * (lengths > 0)[:, None, None, None].to(y.dtype)


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_last_only_is_the_output_at_each_users_last_event(momentum, backend):
    """Across unlocks, users without events and with one; through the one-chunk form
    (auto, wide) and through the scan (an explicit backend)."""
    inp = make_inputs(7, 13, 2, 10, 5, momentum=momentum, seed=11)
    inp["pos0"] = torch.tensor([0, 3, 7, 11, 2, 40, 5])
    inp["lengths"] = torch.tensor([13, 0, 1, 5, 12, 13, 2])
    kw = dict(n_blocks=3, horizon=12)
    y_ref, _, _ = memory_scan_reference(**inp, **kw)
    want = last_rows(y_ref, inp["lengths"])
    got = memory_readout(**inp, **kw, backend=backend, last_only=True)
    assert got.shape == (7, 1, 2, 5)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(memory_readout_chunk(**inp, **kw, last_only=True), want, **TIGHT)
