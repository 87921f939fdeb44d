"""MemoryRecommender: shapes, causality, padding, chunked advance, KJT path, scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.embeddings import kjt_available
from models.features import (
    seq_time_gap_buckets_np,
    time_gap_buckets,
    time_gap_buckets_np,
    time_gap_edges_s,
)
from models.recommender import MemoryRecommender
from recmem.config import Config
from tests.models.synth import cyclic_seqs

N_ITEMS, N_OOV = 30, 4


def small_model(
    momentum: bool = True, n_blocks: int = 4, seed: int = 0, double: bool = True
) -> MemoryRecommender:
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_heads = 2
    cfg.memory.n_blocks = n_blocks
    cfg.memory.horizon = 8
    cfg.memory.momentum = momentum
    cfg.memory.backend = "recurrent"
    cfg.model.embed_dim = 16
    torch.manual_seed(seed)
    model = MemoryRecommender(N_ITEMS, N_OOV, cfg.memory, cfg.model).eval()
    return model.double() if double else model


def batch(B: int = 3, T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(0, N_ITEMS + N_OOV, (B, T), generator=g)
    actions = torch.randint(0, 6, (B, T), generator=g)
    ts = 10**9 + torch.cumsum(torch.randint(0, 10**7, (B, T), generator=g), dim=1)
    return items, actions, ts


def advance(model, items, actions, ts, lengths, state=None, **kw):
    state = state if state is not None else model.init_state(items.shape[0], "cpu")
    dtype = model.embed.item_weight().dtype
    state.S, state.h = state.S.to(dtype), state.h.to(dtype)
    if state.M is not None:
        state.M = state.M.to(dtype)
    return model.advance(items, actions, ts, lengths, state, **kw)


@pytest.mark.parametrize("momentum", [True, False])
def test_shapes_and_state(momentum: bool) -> None:
    model = small_model(momentum)
    items, actions, ts = batch()
    lengths = torch.tensor([12, 5, 0])
    res = advance(model, items, actions, ts, lengths, return_kq=True)
    assert res.outputs.shape == (3, 12, 16)
    assert res.state.S.shape == (3, 2, 2, 8, 8)
    assert (res.state.M is None) == (not momentum)
    assert res.state.pos.tolist() == [12, 5, 0]
    assert res.state.last_ts.tolist() == [int(ts[0, 11]), int(ts[1, 4]), -1]
    assert torch.equal(res.state.h[0], res.outputs[0, 11])
    assert torch.equal(res.state.h[1], res.outputs[1, 4])
    assert torch.equal(res.state.h[2], torch.zeros(16, dtype=torch.float64))
    assert torch.equal(res.state.S[2], torch.zeros_like(res.state.S[2]))
    assert torch.all(res.outputs[1, 5:] == 0)
    k, q = res.kq
    assert k.shape == q.shape == (3, 12, 2, 2, 8)
    # Position 1 opens only the first block (2 of 8 rows) of every key.
    assert torch.all(k[0, 0, :, :, 2:] == 0) and torch.any(k[0, 0, :, :, :2] != 0)


def test_causal() -> None:
    model = small_model()
    items, actions, ts = batch(2, 10)
    lengths = torch.tensor([10, 10])
    a = advance(model, items, actions, ts, lengths).outputs
    items2 = items.clone()
    items2[:, 6:] = (items2[:, 6:] + 7) % N_ITEMS
    b = advance(model, items2, actions, ts, lengths).outputs
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_training_step_is_causal() -> None:
    """What training reads at input t (the user vector of the default head: memory, window
    attention, request time) depends on no later event: neither a later item nor a later
    request time. The training scan (memory.train_backend) differs from the eval one."""
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.horizon = 8
    cfg.model.embed_dim, cfg.model.dropout = 16, 0.0  # the dropout masks would differ
    torch.manual_seed(0)
    model = MemoryRecommender(N_ITEMS, N_OOV, cfg.memory, cfg.model).train()
    assert model.head.window > 0
    items, actions, ts = batch(2, 24)
    request_ts = torch.cat([ts[:, 1:], ts[:, -1:] + 1], dim=1)
    lengths = torch.tensor([24, 24])
    a = advance(model, items, actions, ts, lengths, request_ts=request_ts).user
    for t in (3, 16):
        items2, req2 = items.clone(), request_ts.clone()
        items2[:, t + 1 :] = (items2[:, t + 1 :] + 7) % N_ITEMS
        req2[:, t + 1 :] += 10**9
        b = advance(model, items2, actions, ts, lengths, request_ts=req2).user
        assert torch.equal(a[:, : t + 1], b[:, : t + 1])
        assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_padding_is_a_no_op() -> None:
    model = small_model()
    items, actions, ts = batch(2, 10)
    lengths = torch.tensor([4, 7])
    a = advance(model, items, actions, ts, lengths)
    noise = batch(2, 10, seed=5)
    mask = torch.arange(10)[None, :] >= lengths[:, None]
    items2, actions2, ts2 = (torch.where(mask, n, x) for n, x in zip(noise, (items, actions, ts)))
    b = advance(model, items2, actions2, ts2, lengths)
    assert torch.equal(a.outputs, b.outputs)
    assert torch.equal(a.state.S, b.state.S) and torch.equal(a.state.M, b.state.M)
    # A narrower batch without the padding columns gives the same result.
    c = advance(model, items[:, :7], actions[:, :7], ts[:, :7], lengths)
    assert torch.allclose(a.state.S, c.state.S, atol=1e-12)
    assert torch.allclose(a.outputs[:, :7], c.outputs, atol=1e-12)


@pytest.mark.parametrize("momentum", [True, False])
def test_two_calls_equal_one(momentum: bool) -> None:
    model = small_model(momentum)
    items, actions, ts = batch(3, 14)
    lengths = torch.tensor([14, 9, 3])
    whole = advance(model, items, actions, ts, lengths)
    cut = 6
    l1 = torch.clamp(lengths, max=cut)
    first = advance(model, items[:, :cut], actions[:, :cut], ts[:, :cut], l1)
    l2 = lengths - l1
    second = advance(model, items[:, cut:], actions[:, cut:], ts[:, cut:], l2, first.state)
    assert torch.equal(second.state.pos, whole.state.pos)
    assert torch.equal(second.state.last_ts, whole.state.last_ts)
    assert torch.allclose(second.state.S, whole.state.S, atol=1e-10)
    if momentum:
        assert torch.allclose(second.state.M, whole.state.M, atol=1e-10)
    assert torch.allclose(second.state.h, whole.state.h, atol=1e-10)
    for b in range(3):
        n1 = int(l1[b])
        joined = torch.cat([first.outputs[b, :n1], second.outputs[b, : int(l2[b])]])
        assert torch.allclose(joined, whole.outputs[b, : int(lengths[b])], atol=1e-10)


def test_kjt_path_equals_padded_path() -> None:
    assert kjt_available(torch.device("cpu"))
    # torchrec's EmbeddingCollection returns float32, so compare a float32 model.
    model = small_model(double=False)
    items, actions, ts = batch(3, 9)
    lengths = torch.tensor([9, 4, 0])
    gaps = time_gap_buckets(ts, torch.full_like(ts, 10**9), 16)
    padded = model.embed(items, actions, gaps, lengths, use_kjt=False)
    kjt = model.embed(items, actions, gaps, lengths, use_kjt=True)
    assert torch.equal(padded, kjt)
    expected = model.embed.item_weight()[items[0, 2]] + model.embed.table("action")[actions[0, 2]]
    assert torch.allclose(padded[0, 2], expected + model.embed.table("gap")[gaps[0, 2]])
    model.use_kjt = True
    a = advance(model, items, actions, ts, lengths)
    model.use_kjt = False
    b = advance(model, items, actions, ts, lengths)
    assert torch.equal(a.outputs, b.outputs)


def test_score_full_and_candidates() -> None:
    model = small_model()
    u = torch.randn(2, 16, dtype=torch.float64)
    full = model.score(u)
    assert full.shape == (2, N_ITEMS)
    cand = torch.tensor([[3, 0, 29], [7, 7, 1]])
    part = model.score(u, cand)
    assert torch.allclose(part, torch.gather(full, 1, cand))
    assert torch.equal(model.item_matrix(), model.embed.item_weight()[:N_ITEMS])


HEADS = [("none", "none"), ("none", "gap_clock"), ("mac", "gap"), ("mag", "gap_clock")]


def head_model(hybrid: str, request_time: str, window: int = 4) -> MemoryRecommender:
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_heads = 2
    cfg.memory.n_blocks = 4
    cfg.memory.horizon = 8
    cfg.memory.backend = "recurrent"
    cfg.model.embed_dim = 16
    cfg.model.hybrid, cfg.model.request_time, cfg.model.window = hybrid, request_time, window
    torch.manual_seed(0)
    model = MemoryRecommender(N_ITEMS, N_OOV, cfg.memory, cfg.model).eval()
    with torch.no_grad():  # the head's biases start at 0: give them values to test
        for name, p in model.head.named_parameters():
            if "bias" in name:
                p.normal_()
    return model.double()


@pytest.mark.parametrize("hybrid,request_time", HEADS)
def test_user_vectors_equal_streamed_state(hybrid: str, request_time: str) -> None:
    """The offline path (all of a user's events in one advance, the head at every event)
    equals the served path: events applied in pieces, then ``read_user`` of the state."""
    model = head_model(hybrid, request_time)
    seqs = cyclic_seqs(n_users=5, n_items=N_ITEMS, max_len=12)
    rows = np.array(
        [seqs.offsets[1] + 2, seqs.offsets[3], seqs.offsets[4] + 1, seqs.offsets[5] - 1]
    )
    req = seqs.ts_ms[rows] + np.array([5_000, 3_600_000 * 30, 0, 86_400_000 * 3])
    got = model.user_vectors(seqs, rows, request_ts=req, batch_users=2).double()
    for i, r in enumerate(rows):
        u = int(np.searchsorted(seqs.offsets, r, side="right") - 1)
        state = model.init_state(1, "cpu")
        state = state.map(lambda t: t.double() if t.is_floating_point() else t)
        for s, e in _pieces(int(seqs.offsets[u]), int(r) + 1):
            state = model.advance(
                torch.as_tensor(seqs.items[s:e])[None],
                torch.as_tensor(seqs.actions[s:e])[None],
                torch.as_tensor(seqs.ts_ms[s:e])[None],
                torch.tensor([e - s]),
                state,
            ).state
        want = model.read_user(state, torch.tensor([int(req[i])]))
        assert torch.allclose(got[i], want[0], atol=1e-10)


def _pieces(s: int, e: int) -> list[tuple[int, int]]:
    """[s, e) cut into runs of 1, 2, 3, ... events (so windows straddle pieces)."""
    out, n = [], 1
    while s < e:
        out.append((s, min(e, s + n)))
        s, n = s + n, n + 1
    return out


@pytest.mark.parametrize("hybrid,request_time", HEADS[1:])
def test_request_time_changes_the_user_vector(hybrid: str, request_time: str) -> None:
    model = head_model(hybrid, request_time)
    items, actions, ts = batch(B=2, T=6)
    state = advance(model, items, actions, ts, torch.tensor([6, 3])).state
    soon = model.read_user(state, state.last_ts + 1_000)
    later = model.read_user(state, state.last_ts + 86_400_000 * 40)
    assert not torch.allclose(soon, later)


def test_window_keeps_the_latest_events() -> None:
    model = head_model("mac", "gap", window=4)
    items, actions, ts = batch(B=2, T=6)
    st = advance(model, items[:, :2], actions[:, :2], ts[:, :2], torch.tensor([2, 1])).state
    assert st.win_items[0].tolist() == [-1, -1, *items[0, :2].tolist()]
    assert st.win_items[1].tolist() == [-1, -1, -1, int(items[1, 0])]
    st = advance(model, items[:, 2:], actions[:, 2:], ts[:, 2:], torch.tensor([4, 0]), st).state
    assert st.win_items[0].tolist() == items[0, 2:].tolist()
    assert st.win_ts[0].tolist() == ts[0, 2:].tolist()
    assert st.win_items[1].tolist() == [-1, -1, -1, int(items[1, 0])]


def test_time_gap_buckets() -> None:
    rng = np.random.default_rng(0)
    ts = rng.integers(2 * 10**13, 3 * 10**13, size=2000)
    prev = ts - np.exp(rng.uniform(0, 30, size=2000)).astype(np.int64)
    prev[:10] = -1
    a = time_gap_buckets_np(ts, prev, 16)
    b = time_gap_buckets(torch.as_tensor(ts), torch.as_tensor(prev), 16).numpy()
    assert np.array_equal(a, b)
    assert np.all(a[:10] == 0) and a.min() == 0 and a.max() == 15 and np.all(a[10:] >= 1)
    edges = time_gap_edges_s(16)
    for i, edge in enumerate(edges):
        gap_ms = int(np.ceil(edge * 1000)) + 1
        assert time_gap_buckets_np(np.array([gap_ms]), np.array([0]), 16)[0] == 1 + i
    assert time_gap_buckets_np(np.array([5]), np.array([5]), 16)[0] == 1
    offs = np.array([0, 3, 5])
    got = seq_time_gap_buckets_np(np.array([0, 0, 10**6, 7, 7]), offs, 16)
    assert got[0] == 0 and got[3] == 0 and got[1] == 1 and got[2] > 1
    with pytest.raises(ValueError):
        time_gap_edges_s(1)


def _last_events(items, actions, ts, lengths):
    """Each user's latest event and the ts of the one before it (-1: none)."""
    rows = torch.arange(items.shape[0])
    last = lengths - 1
    prev = torch.where(last > 0, ts[rows, torch.clamp(last - 1, min=0)], torch.full_like(last, -1))
    return items[rows, last], actions[rows, last], ts[rows, last], prev


@pytest.mark.parametrize("momentum", [True, False])
def test_read_only_on_live_state_is_the_latest_readout(momentum: bool) -> None:
    """The rule reads after the write, so reading the latest event again from the state it
    left (its own position and previous ts) gives the read-out advance gave, and writes
    nothing."""
    model = small_model(momentum)
    items, actions, ts = batch(B=4)
    lengths = torch.tensor([12, 5, 1, 3])  # positions 12 (all rows open), 5, 1, 3
    state = advance(model, items, actions, ts, lengths).state
    before = state.clone()
    it, ac, t, prev = _last_events(items, actions, ts, lengths)
    vec = model.read_only(it, ac, t, state, prev_ts=prev)
    torch.testing.assert_close(vec, state.h, atol=1e-12, rtol=1e-10)
    for a, b in [(before.S, state.S), (before.pos, state.pos), (before.h, state.h),
                 (before.last_ts, state.last_ts)]:  # fmt: skip
        assert torch.equal(a, b)
    if momentum:
        assert torch.equal(before.M, state.M)
    # the gap feature matters: measured from the state's own last ts (gap 0) it differs
    other = model.read_only(it, ac, t, state)
    assert (other - vec).abs().amax() > 1e-6


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("backend", ["reference", "recurrent"])
def test_read_only_is_the_scan_with_a_no_op_write(momentum: bool, backend: str) -> None:
    """read_only on any state equals advance of the same event through a twin whose gates
    make the write a no-op (theta = 0, alpha = 0, eta = 0: S <- S, y = S^T q~), run from
    that state with the position one back so the event lands at the read position."""
    model = small_model(momentum)
    items, actions, ts = batch(B=3, seed=1)
    lengths = torch.tensor([12, 4, 2])
    state = advance(model, items, actions, ts, lengths).state
    # a different event per user (not the latest), read at a later position than applied
    g = torch.Generator().manual_seed(7)
    ev_items = torch.randint(0, N_ITEMS + N_OOV, (3,), generator=g)
    ev_actions = torch.randint(0, 6, (3,), generator=g)
    ev_ts = ts[:, -1] + 5_000_000
    prev = torch.tensor([-1, 10**9, int(ts[2, 1])])
    pos = state.pos + torch.tensor([0, 3, 1])
    got = model.read_only(ev_items, ev_actions, ev_ts, state, prev_ts=prev, positions=pos)

    twin = small_model(momentum)
    twin.load_state_dict(model.state_dict())
    twin.mem_cfg.backend = backend
    with torch.no_grad():
        for layer in twin.layers:
            layer.gates.weight.zero_()
            layer.gates.bias.fill_(-1e4)  # sigmoid -> exactly 0
    start = state.clone()
    start.pos, start.last_ts = pos - 1, prev
    res = twin.advance(ev_items[:, None], ev_actions[:, None], ev_ts[:, None],
                       torch.ones(3, dtype=torch.int64), start)  # fmt: skip
    assert torch.equal(res.state.S, state.S)  # the write was a no-op
    torch.testing.assert_close(got, res.outputs[:, 0], atol=1e-12, rtol=1e-10)
    # and it is not the vector of a real write
    real = model.advance(ev_items[:, None], ev_actions[:, None], ev_ts[:, None],
                         torch.ones(3, dtype=torch.int64), start)  # fmt: skip
    assert (real.outputs[:, 0] - got).abs().amax() > 1e-6
