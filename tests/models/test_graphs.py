"""GraphedReplay: the padded static-buffer path equals the eager replay pass (rows padded to
a power of two, events to a bucket), falls back to the eager pass for shapes beyond the
buckets, and on CUDA (when present) the captured graphs give the same answer. GraphedReadout
(the read-out ``read_user`` per padded user count): the same checks."""

from __future__ import annotations

import pytest
import torch

from models.graphs import EVENT_BUCKETS, GraphedReadout, GraphedReplay
from tests.models.test_recommender import advance, batch, small_model


def start_state(model, B):
    items, actions, ts = batch(B=B, T=12, seed=B)
    lengths = torch.randint(1, 13, (B,), generator=torch.Generator().manual_seed(B))
    return advance(model, items, actions, ts, lengths).state, int(ts.max())


def replay_inputs(B, T, after, seed=0):
    items, actions, ts = batch(B=B, T=T, seed=seed)
    lengths = torch.randint(0, T + 1, (B,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = T
    return items, actions, ts + after, lengths


@pytest.mark.parametrize("momentum", [True, False])
def test_padded_shapes_equal_the_eager_pass(momentum):
    model = small_model(momentum)
    graphed = GraphedReplay(model, max_batch=8, capture=False)
    for B, T in [(1, 3), (3, 9), (5, 16), (8, 30), (2, 64)]:
        state, after = start_state(model, B)
        items, actions, ts, lengths = replay_inputs(B, T, after, seed=B + T)
        want = model.replay_read(items, actions, ts, lengths, state)
        got = graphed(items, actions, ts, lengths, state)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert graphed.calls == {"graph": 5, "eager": 0}
    assert (8, 32) in graphed._shapes and (4, 16) in graphed._shapes


def test_a_second_call_on_a_shape_does_not_see_the_first():
    """Static buffers are reused: a smaller call after a larger one on the same shape must
    not pick up the earlier rows or events."""
    model = small_model()
    graphed = GraphedReplay(model, max_batch=4, capture=False)
    state, after = start_state(model, 4)
    items, actions, ts, lengths = replay_inputs(4, 14, after, seed=1)
    graphed(items, actions, ts, lengths, state)
    small = state.index(torch.tensor([1, 2, 3]))
    it, ac, t, ln = items[1:, :9], actions[1:, :9], ts[1:, :9], torch.tensor([9, 4, 0])
    want = model.replay_read(it, ac, t, ln, small)
    torch.testing.assert_close(graphed(it, ac, t, ln, small), want, atol=1e-12, rtol=1e-10)


def test_shapes_beyond_the_buckets_run_eagerly():
    model = small_model()
    graphed = GraphedReplay(model, max_batch=2, capture=False)
    state, after = start_state(model, 3)
    items, actions, ts, lengths = replay_inputs(3, 5, after)
    want = model.replay_read(items, actions, ts, lengths, state)
    torch.testing.assert_close(graphed(items, actions, ts, lengths, state), want)
    items, actions, ts, lengths = replay_inputs(1, EVENT_BUCKETS[-1] + 1, after)
    graphed(items, actions, ts, lengths, state.index(torch.tensor([0])))
    assert graphed.calls == {"graph": 0, "eager": 2} and not graphed._shapes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_equal_the_eager_pass_on_cuda():
    on_cpu = small_model(double=False)  # the same weights (same seed), for the start states
    model = small_model(double=False).cuda()
    model.mem_cfg.backend = "auto"
    graphed = GraphedReplay(model, max_batch=8)
    graphed.capture_all(model.init_state(1, "cuda"), max_events=16)
    for B, T in [(1, 5), (6, 16), (8, 11)]:
        state, after = start_state(on_cpu, B)
        state = state.to("cuda")
        items, actions, ts, lengths = (x.cuda() for x in replay_inputs(B, T, after, seed=T))
        want = model.replay_read(items, actions, ts, lengths, state)
        got = graphed(items, actions, ts, lengths, state)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphed.calls["graph"] == 3


def readout_inputs(model, B, seed=0):
    """A state after some events, a request time after them, a live and a replayed read-out
    and which rows replayed (the arguments the Ranker passes to ``read_user``)."""
    state, after = start_state(model, B)
    g = torch.Generator().manual_seed(seed)
    request_ts = after + torch.randint(0, 10**8, (B,), generator=g)
    live = state.h + 0.1 * torch.randn(state.h.shape, generator=g, dtype=state.h.dtype)
    replayed = torch.randn(state.h.shape, generator=g, dtype=state.h.dtype)
    ok = torch.rand(B, generator=g) < 0.5
    return state, request_ts, live, replayed, ok


def test_readout_padded_shapes_equal_the_eager_read_out():
    model = small_model()
    assert model.head.window > 0  # the default hybrid: window attention and request time
    graphed = GraphedReadout(model, max_batch=8, capture=False)
    for B in (1, 3, 8, 2):  # the last one reuses the buffers of a larger earlier call
        state, request_ts, live, replayed, ok = readout_inputs(model, B, seed=B)
        want = model.read_user(state, request_ts, mem=live, replayed=replayed, replayed_ok=ok)
        got = graphed(state, request_ts, live, replayed, ok)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert graphed.calls == {"graph": 4, "eager": 0}
    assert sorted(graphed._shapes) == [1, 2, 4, 8]


def test_readout_beyond_the_buckets_runs_eagerly():
    model = small_model()
    graphed = GraphedReadout(model, max_batch=2, capture=False)
    state, request_ts, live, replayed, ok = readout_inputs(model, 3)
    want = model.read_user(state, request_ts, mem=live, replayed=replayed, replayed_ok=ok)
    torch.testing.assert_close(graphed(state, request_ts, live, replayed, ok), want)
    assert graphed.calls == {"graph": 0, "eager": 1} and not graphed._shapes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_readout_equals_the_eager_read_out_on_cuda():
    on_cpu = small_model(double=False)  # the same weights (same seed), for the inputs
    model = small_model(double=False).cuda()
    graphed = GraphedReadout(model, max_batch=8)
    graphed.capture_all(model.init_state(1, "cuda"))
    for B in (1, 6, 8):
        state, request_ts, live, replayed, ok = readout_inputs(on_cpu, B, seed=B)
        state = state.to("cuda")
        args = (request_ts.cuda(), live.float().cuda(), replayed.float().cuda(), ok.cuda())
        want = model.read_user(state, args[0], mem=args[1], replayed=args[2], replayed_ok=args[3])
        torch.testing.assert_close(graphed(state, *args), want, atol=1e-4, rtol=1e-4)
    assert graphed.calls["graph"] == 3
