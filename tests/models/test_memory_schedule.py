"""Unlock schedules (models/memory/schedule.py) against their definition
(naive.memory_scan_scheduled_reference), locked rows bit for bit, block orders, and the
model's streaming / replay / state paths under every schedule."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from models.config import MemoryConfig, ModelConfig
from models.memory.naive import memory_scan_scheduled_reference
from models.memory.ops import memory_scan
from models.memory.schedule import (
    UnlockSchedule,
    adaptive_scan,
    block_order,
    check_schedule_config,
    decision_pieces,
    drift_signal,
    order_keys,
    row_order,
)
from models.recommender import MemoryRecommender
from models.state import MemoryState
from recmem.state_store import StateLayout, state_from_numpy, state_to_numpy
from tests.models.test_memory import make_inputs

F64 = torch.float64


def sched_of(unlock: str, E: int, N: int, threshold: float, order: str = "prefix"):
    return UnlockSchedule(unlock, order, E, N, threshold)


def fast_adaptive(inp, unlocks0, acc0, sched, backend, signal=None, qk_l2norm=True):
    scan = partial(memory_scan, backend=backend, chunk_size=4)
    return adaptive_scan(
        **inp, unlocks0=unlocks0, acc0=acc0, sched=sched, qk_l2norm=qk_l2norm,
        scan=scan, probe=scan, signal=signal,
    )  # fmt: skip


def start_state(B: int, E: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    unlocks0 = torch.randint(0, E, (B,), generator=g)
    acc0 = torch.rand(B, 2, generator=g, dtype=F64)
    return unlocks0, acc0


@pytest.mark.parametrize("backend", ["reference", "recurrent", "chunk", "chunk_aligned"])
@pytest.mark.parametrize("unlock", ["surprise", "drift"])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("K,E,N", [(8, 4, 16), (10, 3, 12), (8, 4, 3)])
def test_adaptive_scan_equals_reference(backend, unlock, momentum, K, E, N):
    B, T, H, V = 7, 37, 2, 5
    inp = make_inputs(B, T, H, K, V, momentum=momentum, max_pos=3 * N)
    inp["lengths"][0] = T  # one user runs the whole width
    unlocks0, acc0 = start_state(B, 2)
    g = torch.Generator().manual_seed(3)
    signal = torch.rand(B, T, generator=g, dtype=F64) * 2 if unlock == "drift" else None
    for threshold in (0.0, 1.0, 1.3, math.inf):
        want = memory_scan_scheduled_reference(
            **inp, unlocks0=unlocks0, acc0=acc0, n_blocks=E, horizon=N, unlock=unlock,
            threshold=threshold, signal=signal,
        )  # fmt: skip
        got = fast_adaptive(inp, unlocks0, acc0, sched_of(unlock, E, N, threshold), backend,
                            signal)  # fmt: skip
        for name, w, x in zip(("y", "S", "M"), want[:3], (got.y, got.S, got.M), strict=True):
            if w is None:
                assert x is None
                continue
            torch.testing.assert_close(x, w, atol=1e-9, rtol=1e-9, msg=name)
        assert torch.equal(got.unlocks, want[3]), (threshold, got.unlocks, want[3])
        torch.testing.assert_close(got.acc, want[4], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("unlock,mid", [("surprise", 1.0), ("drift", 1.0)])
def test_thresholds_decide_both_ways(unlock, mid):
    """Between the extremes the rule unlocks some intervals and not others (so the equality
    tests above exercise both branches)."""
    B, T, H, K, V, E, N = 7, 37, 2, 16, 5, 16, 32
    inp = make_inputs(B, T, H, K, V, max_pos=40)
    inp["pos0"][:] = 0  # new users: their running level starts with them
    zero_u, zero_a = torch.zeros(B, dtype=torch.int64), torch.zeros(B, 2, dtype=F64)
    g = torch.Generator().manual_seed(3)
    signal = torch.rand(B, T, generator=g, dtype=F64) * 2 if unlock == "drift" else None

    def run(threshold):
        sched = sched_of(unlock, E, N, threshold)
        return fast_adaptive(inp, zero_u, zero_a, sched, "recurrent", signal).unlocks

    always, mid_u, never = run(0.0), run(mid), run(math.inf)
    end = inp["pos0"] + inp["lengths"]
    decisions = torch.clamp(end // 2 - inp["pos0"] // 2, max=E - 1)  # Delta = 2
    assert (never == 0).all() and torch.equal(always, decisions)
    assert (mid_u > 0).any() and (mid_u < always).any()


def test_adaptive_locked_rows_keep_their_bits():
    """Rows past the open blocks at the end of a run (the blocks never unlocked) keep S0 and
    M0 bit for bit, on every backend."""
    B, T, H, K, V, E, N = 6, 30, 2, 8, 4, 4, 16
    inp = make_inputs(B, T, H, K, V, max_pos=20)
    unlocks0 = torch.tensor([0, 1, 0, 2, 3, 0])
    acc0 = torch.zeros(B, 2, dtype=F64)
    d = K // E
    for backend in ("reference", "recurrent", "chunk", "chunk_aligned"):
        got = fast_adaptive(inp, unlocks0, acc0, sched_of("surprise", E, N, 1.0), backend)
        for b in range(B):
            n_open = min(E, 1 + int(got.unlocks[b]))
            locked = slice(K if n_open == E else n_open * d, K)
            assert torch.equal(got.S[b, :, locked], inp["S0"][b, :, locked]), (backend, b)
            assert torch.equal(got.M[b, :, locked], inp["M0"][b, :, locked]), (backend, b)


@pytest.mark.parametrize("K,E,N", [(8, 4, 16), (10, 3, 12)])
def test_thresholds_at_the_ends_are_uniform_and_narrow(K, E, N):
    """Always unlocking from a fresh state is the uniform schedule; never, the narrow one."""
    B, T, H, V = 5, 40, 2, 4
    inp = make_inputs(B, T, H, K, V, max_pos=1)
    inp["pos0"][:] = 0
    zero_u, zero_a = torch.zeros(B, dtype=torch.int64), torch.zeros(B, 2, dtype=F64)
    for threshold, unlock in ((0.0, "uniform"), (math.inf, "narrow")):
        got = fast_adaptive(inp, zero_u, zero_a, sched_of("surprise", E, N, threshold), "chunk")
        want = memory_scan_scheduled_reference(
            **inp, unlocks0=zero_u, acc0=zero_a, n_blocks=E, horizon=N, unlock=unlock
        )
        torch.testing.assert_close(got.y, want[0], atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(got.S, want[1], atol=1e-9, rtol=1e-9)
    sched = sched_of("narrow", E, N, 0.0)
    y, S, _ = memory_scan(**inp, n_blocks=E, horizon=sched.scan_horizon, backend="recurrent")
    want = memory_scan_scheduled_reference(
        **inp, unlocks0=zero_u, acc0=zero_a, n_blocks=E, horizon=N, unlock="narrow"
    )
    torch.testing.assert_close(S, want[1], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("order", ["reverse", "random"])
@pytest.mark.parametrize("unlock", ["uniform", "surprise"])
def test_block_orders_equal_reference(order, unlock):
    """A block order is the prefix schedule on permuted key rows: permuting q, k (and the
    stored state) per user, scanning, and permuting back gives the definition with masks
    that open the blocks in that order; rows of blocks not yet open keep their bits."""
    B, T, H, K, V, E, N = 5, 33, 2, 8, 3, 4, 16
    inp = make_inputs(B, T, H, K, V, max_pos=20)
    keys = order_keys(torch.arange(B) * 37 + 5, torch.arange(B) * 1000 + 17)
    sched = sched_of(unlock, E, N, 1.0, order)
    blocks = block_order(sched, keys, B, torch.device("cpu"))
    assert blocks is not None
    rows = row_order(blocks, K)
    unlocks0, acc0 = start_state(B, E)
    want = memory_scan_scheduled_reference(
        **inp, unlocks0=unlocks0, acc0=acc0, n_blocks=E, horizon=N, unlock=unlock,
        threshold=1.0, order=blocks,
    )  # fmt: skip

    def perm(x):  # [B, T, H, K] or [B, H, K, V] along K
        if x.dim() == 4 and x.shape[-1] == K:
            return torch.gather(x, 3, rows[:, None, None, :].expand_as(x))
        return torch.gather(x, 2, rows[:, None, :, None].expand_as(x))

    p = dict(inp, q=perm(inp["q"]), k=perm(inp["k"]), S0=perm(inp["S0"]), M0=perm(inp["M0"]))
    if unlock == "uniform":
        y, S, M = memory_scan(**p, n_blocks=E, horizon=N, backend="recurrent")
    else:
        got = fast_adaptive(p, unlocks0, acc0, sched, "recurrent")
        y, S, M = got.y, got.S, got.M
        assert torch.equal(got.unlocks, want[3])
    inv = torch.argsort(rows, dim=1)
    unperm = torch.gather(S, 2, inv[:, None, :, None].expand_as(S))
    assert M is not None
    torch.testing.assert_close(y, want[0], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(unperm, want[1], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(
        torch.gather(M, 2, inv[:, None, :, None].expand_as(M)), want[2], atol=1e-9, rtol=1e-9
    )
    # locked rows in the original coordinates: the blocks not in the first k of the order
    d = K // E
    for b in range(B):
        last = int(inp["pos0"][b] + inp["lengths"][b])
        n_open = (
            min(E, 1 + (max(last, 1) - 1) // max(1, N // E))
            if unlock == "uniform"
            else min(E, 1 + int(want[3][b]))
        )
        for j in blocks[b, n_open:].tolist():
            r = slice(j * d, (j + 1) * d)
            assert torch.equal(unperm[b, :, r], inp["S0"][b, :, r])
    assert (blocks.sort(dim=1).values == torch.arange(E)).all()  # each a permutation


def test_random_orders_differ_between_users_and_are_stable():
    keys = order_keys(torch.arange(64), torch.arange(64) * 7)
    sched = sched_of("uniform", 8, 64, 0.0, "random")
    a = block_order(sched, keys, 64, torch.device("cpu"))
    b = block_order(sched, keys.clone(), 64, torch.device("cpu"))
    assert a is not None and b is not None and torch.equal(a, b)
    assert len({tuple(r) for r in a.tolist()}) > 50
    assert int(keys.min()) >= 0


def test_decision_pieces_cut_at_every_users_grid():
    pos0 = np.array([0, 3, 5, 15])
    lengths = np.array([20, 9, 0, 2])
    pieces = decision_pieces(pos0, lengths, 4)
    assert pieces[0][0] == 0 and pieces[-1][1] == 20
    for b in range(4):
        for c0, c1 in pieces:
            inside = [p for p in range(pos0[b] + c0 + 1, pos0[b] + min(c1, lengths[b]))]
            assert all(p % 4 for p in inside), (b, c0, c1)  # no grid strictly inside


def test_drift_signal():
    old = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # one valid window event
    old_ok = torch.tensor([[True, False]])
    new = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    new_ok = torch.tensor([[True, True, False]])
    got = drift_signal(new, new_ok, old, old_ok)
    # event 0 against [1, 0]: 0; event 1 against the window [1, 0] + event 0 [1, 0]: 1
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0]]))
    fresh = drift_signal(new, new_ok, old, torch.zeros_like(old_ok))
    assert fresh[0, 0] == 0.0  # no history: no drift


def test_config_checks():
    check_schedule_config("surprise", "random", 8, 4, 0)
    with pytest.raises(ValueError, match="memory.unlock"):
        check_schedule_config("sometimes", "prefix", 8, 4, 4)
    with pytest.raises(ValueError, match="memory.block_order"):
        check_schedule_config("uniform", "sideways", 8, 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        check_schedule_config("uniform", "reverse", 10, 4, 4)
    with pytest.raises(ValueError, match="window"):
        check_schedule_config("drift", "prefix", 8, 4, 0)


# ---------------------------------------------------------------- the model under a schedule

SCHEDULES = [
    {"unlock": "surprise", "unlock_threshold": 1.0},
    {"unlock": "drift", "unlock_threshold": 1.0},
    {"unlock": "narrow"},
    {"block_order": "reverse"},
    {"block_order": "random"},
    {"unlock": "surprise", "unlock_threshold": 1.0, "block_order": "random"},
]


def tiny_model(seed: int = 0, **mem_kw) -> MemoryRecommender:
    torch.manual_seed(seed)
    mem = MemoryConfig(
        n_layers=2, n_heads=2, key_dim=8, value_dim=4, n_blocks=4, horizon=12,
        backend="recurrent", **mem_kw,
    )  # fmt: skip
    model = ModelConfig(embed_dim=16, n_time_buckets=8, dropout=0.0, window=4, attn_heads=2)
    return MemoryRecommender(30, 4, mem, model).double().eval()


def events(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(0, 34, (B, T), generator=g)
    actions = torch.randint(0, 3, (B, T), generator=g)
    ts = 1_000_000 + torch.cumsum(torch.randint(0, 9_000_000, (B, T), generator=g), dim=1)
    lengths = torch.clamp(torch.tensor([T, T - 3, 7, 0, T - 11][:B]), 0, T)
    return items, actions, ts, lengths


def split_run(model, items, actions, ts, lengths, cuts):
    """``advance`` over the events in pieces at the given columns."""
    state = model.init_state(items.shape[0], "cpu")
    outs = []
    bounds = [0, *cuts, items.shape[1]]
    for c0, c1 in zip(bounds, bounds[1:]):
        seg = torch.clamp(lengths - c0, min=0, max=c1 - c0)
        res = model.advance(items[:, c0:c1], actions[:, c0:c1], ts[:, c0:c1], seg, state)
        state = res.state
        outs.append(res.outputs)
    return state, torch.cat(outs, dim=1)


def assert_states_close(a: MemoryState, b: MemoryState):
    fa, fb = a.to_fields(), b.to_fields()
    assert fa.keys() == fb.keys()
    for k in fa:
        if fa[k].is_floating_point():
            torch.testing.assert_close(fa[k], fb[k], atol=1e-9, rtol=1e-9, msg=k)
        else:
            assert torch.equal(fa[k], fb[k]), k


@pytest.mark.parametrize("kw", SCHEDULES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_model_streaming_in_pieces_equals_one_run(kw):
    """Applying a user's events in any pieces gives the state (unlocks, sums, order keys
    included) and the read-outs of one run: the schedule is streaming."""
    model = tiny_model(**kw)
    items, actions, ts, lengths = events(5, 40)
    whole, out = split_run(model, items, actions, ts, lengths, [])
    for cuts in ([1], [5, 6, 19], [3, 11, 12, 13, 27, 35]):
        parts, out_p = split_run(model, items, actions, ts, lengths, cuts)
        assert_states_close(parts, whole)
        valid = torch.arange(40)[None, :] < lengths[:, None]
        torch.testing.assert_close(out_p[valid], out[valid], atol=1e-9, rtol=1e-9)
    if model.sched.adaptive:
        assert whole.unlocks is not None and whole.unlock_acc is not None
        assert whole.unlocks.shape == (5, 2)
        assert whole.unlock_acc is not None and whole.unlock_acc.shape == (5, 2, 2)
    if model.sched.keyed:
        assert whole.order_key is not None and (whole.order_key[lengths > 0] > 0).all()


@pytest.mark.parametrize("kw", SCHEDULES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_model_replay_read_equals_advance(kw):
    model = tiny_model(**kw)
    items, actions, ts, lengths = events(5, 30)
    state = model.advance(items, actions, ts, lengths, model.init_state(5, "cpu")).state
    more = events(5, 9, seed=4)
    got = model.replay_read(*more, state)
    want = model.advance(*more, state).state.h
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_adaptive_always_unlocking_equals_the_uniform_model():
    """The same weights with ``surprise`` at threshold 0 run the uniform schedule."""
    uniform = tiny_model()
    adaptive = tiny_model(unlock="surprise", unlock_threshold=0.0)
    adaptive.load_state_dict(uniform.state_dict())
    items, actions, ts, lengths = events(5, 40)
    a, out_a = split_run(adaptive, items, actions, ts, lengths, [7, 20])
    u, out_u = split_run(uniform, items, actions, ts, lengths, [])
    torch.testing.assert_close(out_a, out_u, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(a.S, u.S, atol=1e-9, rtol=1e-9)
    delta = UnlockSchedule.from_config(adaptive.mem_cfg).delta
    assert a.unlocks is not None
    want = torch.clamp(lengths // delta, max=3)
    assert torch.equal(a.unlocks, want[:, None].expand(5, 2))


@pytest.mark.parametrize("kw", SCHEDULES[:2] + SCHEDULES[4:5], ids=["surprise", "drift", "rand"])
def test_schedule_fields_round_trip_the_store_layout(kw):
    model = tiny_model(**kw)
    items, actions, ts, lengths = events(5, 30)
    state = model.advance(items, actions, ts, lengths, model.init_state(5, "cpu")).state
    layout = StateLayout.from_config(model.mem_cfg, model.model_cfg)
    layout = StateLayout(**{**layout.__dict__, "dtype": F64})
    assert set(layout.field_shapes(1)) == set(state.to_fields())
    back = state_from_numpy(state_to_numpy(state), layout)
    assert_states_close(back, state)
    default = StateLayout.from_config(MemoryConfig(), ModelConfig())
    assert {"unlocks", "unlock_acc", "order_key"}.isdisjoint(default.field_shapes(1))
    assert default.bytes_per_user() == 34_064  # the default state is unchanged
