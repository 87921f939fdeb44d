"""The adaptive schedules in one chunked scan (models/memory/adaptive_chunk.py) against
their definition (naive.memory_scan_scheduled_reference) and the piecewise fast path
(schedule.adaptive_scan): outputs, states, decisions, sums and every gradient; locked rows
bit for bit; the window layout; the model's training path, and that it reads nothing from
the device when training gives it the positions."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.config import TrainConfig
from models.memory.adaptive_chunk import AdaptiveCall, WindowLayout, adaptive_scan_chunk
from models.memory.naive import memory_scan_scheduled_reference
from models.memory.ops import memory_scan
from models.memory.schedule import adaptive_scan
from models.recommender import MemoryRecommender
from models.sequences import EventSeqs
from models.train import MemoryEpoch
from tests.models.test_memory import make_inputs
from tests.models.test_memory_schedule import events, sched_of, start_state, tiny_model

F64 = torch.float64
TIGHT = dict(atol=1e-9, rtol=1e-9)


def chunked(inp, unlocks0, acc0, sched, signal=None, chunk_size=4, qk_l2norm=True):
    return adaptive_scan_chunk(
        **inp, unlocks0=unlocks0, acc0=acc0, sched=sched, qk_l2norm=qk_l2norm, signal=signal,
        chunk_size=chunk_size,
    )  # fmt: skip


def drift_or_none(unlock, B, T):
    g = torch.Generator().manual_seed(3)
    return torch.rand(B, T, generator=g, dtype=F64) * 2 if unlock == "drift" else None


@pytest.mark.parametrize("unlock", ["surprise", "drift"])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    "K,E,N,chunk",
    [(8, 4, 16, 4), (10, 3, 12, 4), (8, 4, 3, 4), (8, 4, 64, 4), (8, 4, 16, 16), (8, 2, 16, 3)],
)  # Delta = 4 (C = Delta), 4 (K % E), 1, 16 (four chunks a window), 4, 8 (C = 2)
def test_equals_reference(unlock, momentum, K, E, N, chunk):
    B, T, H, V = 7, 37, 2, 5
    inp = make_inputs(B, T, H, K, V, momentum=momentum, max_pos=3 * N)
    inp["lengths"][0] = T
    unlocks0, acc0 = start_state(B, 2)
    signal = drift_or_none(unlock, B, T)
    for threshold in (0.0, 1.0, 1.3, math.inf):
        want = memory_scan_scheduled_reference(
            **inp, unlocks0=unlocks0, acc0=acc0, n_blocks=E, horizon=N, unlock=unlock,
            threshold=threshold, signal=signal,
        )  # fmt: skip
        sched = sched_of(unlock, E, N, threshold)
        got = chunked(inp, unlocks0, acc0, sched, signal, chunk)
        for name, w, x in zip(("y", "S", "M"), want[:3], (got.y, got.S, got.M), strict=True):
            if w is None:
                assert x is None
                continue
            torch.testing.assert_close(x, w, **TIGHT, msg=name)
        assert torch.equal(got.unlocks, want[3]), (threshold, got.unlocks, want[3])
        torch.testing.assert_close(got.acc, want[4], **TIGHT)
        # the virtual positions and signals are those of the piecewise path
        scan = partial(memory_scan, backend="reference")
        piecewise = adaptive_scan(
            **inp, unlocks0=unlocks0, acc0=acc0, sched=sched, qk_l2norm=True, scan=scan,
            probe=scan, signal=signal,
        )  # fmt: skip
        assert torch.equal(got.positions, piecewise.positions)
        torch.testing.assert_close(got.signals, piecewise.signals, **TIGHT)


@pytest.mark.parametrize("unlock", ["surprise", "drift"])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_gradients_equal_the_piecewise_path(unlock, momentum, qk_l2norm):
    """Every input gradient equals that of ``adaptive_scan`` on the reference backend."""
    B, T, H, K, V, E, N = 6, 30, 2, 8, 4, 4, 16
    inp = make_inputs(B, T, H, K, V, momentum=momentum, max_pos=40)
    names = [n for n in ("q", "k", "v", "theta", "eta", "alpha", "S0", "M0") if inp[n] is not None]
    unlocks0, acc0 = start_state(B, E)
    signal = drift_or_none(unlock, B, T)
    sched = sched_of(unlock, E, N, 1.0)
    scan = partial(memory_scan, backend="reference")
    grads = []
    for path in ("chunk", "piecewise"):
        x = {n: t.clone().requires_grad_() if n in names else t for n, t in inp.items()}
        if path == "chunk":
            res = chunked(x, unlocks0, acc0, sched, signal, qk_l2norm=qk_l2norm)
        else:
            res = adaptive_scan(
                **x, unlocks0=unlocks0, acc0=acc0, sched=sched, qk_l2norm=qk_l2norm, scan=scan,
                probe=scan, signal=signal,
            )  # fmt: skip
        g = torch.Generator().manual_seed(5)
        loss = sum(
            (t * torch.randn(t.shape, generator=g, dtype=F64)).sum()
            for t in (res.y, res.S, res.M)
            if t is not None
        )
        grads.append(torch.autograd.grad(loss, [x[n] for n in names]))
    for name, a, b in zip(names, *grads, strict=True):
        # without the norm the state grows large: compare relative to its size
        tol = TIGHT if qk_l2norm else dict(atol=1e-9 * float(b.abs().max()), rtol=1e-9)
        torch.testing.assert_close(a, b, **tol, msg=name)


@pytest.mark.parametrize("unlock", ["surprise", "drift"])
def test_locked_rows_keep_their_bits(unlock):
    B, T, H, K, V, E, N = 6, 30, 2, 8, 4, 4, 16
    inp = make_inputs(B, T, H, K, V, max_pos=20)
    unlocks0 = torch.tensor([0, 1, 0, 2, 3, 0])
    acc0 = torch.zeros(B, 2, dtype=F64)
    got = chunked(inp, unlocks0, acc0, sched_of(unlock, E, N, 1.0), drift_or_none(unlock, B, T))
    d = K // E
    for b in range(B):
        n_open = min(E, 1 + int(got.unlocks[b]))
        locked = slice(K if n_open == E else n_open * d, K)
        assert torch.equal(got.S[b, :, locked], inp["S0"][b, :, locked]), b
        assert torch.equal(got.M[b, :, locked], inp["M0"][b, :, locked]), b


def test_no_cumprod():
    """The scan forms its gate products without ``cumprod``, whose backward reads the host
    on the H200's torch (models/train_step.py)."""
    B, T, H, K, V, E, N = 4, 20, 2, 8, 4, 4, 16
    inp = make_inputs(B, T, H, K, V, max_pos=20)
    inp = {n: t.requires_grad_() if t.is_floating_point() else t for n, t in inp.items()}
    unlocks0, acc0 = start_state(B, E)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        for unlock in ("surprise", "drift"):
            sched = sched_of(unlock, E, N, 1.0)
            res = chunked(inp, unlocks0, acc0, sched, drift_or_none(unlock, B, T))
            (res.y.sum() + res.S.sum()).backward()
    assert "bmm" in ops.seen and "cumprod" not in ops.seen


def test_calls_without_events_change_nothing():
    B, T, H, K, V, E, N = 3, 5, 2, 8, 4, 4, 16
    inp = make_inputs(B, T, H, K, V, max_pos=20)
    inp["lengths"][:] = 0
    unlocks0, acc0 = start_state(B, E)
    got = chunked(inp, unlocks0, acc0, sched_of("surprise", E, N, 1.0))
    assert torch.equal(got.S, inp["S0"]) and torch.equal(got.M, inp["M0"])
    assert torch.equal(got.unlocks, unlocks0) and torch.equal(got.acc, acc0)
    assert not got.y.any() and not got.positions.any()


def test_window_layout_from_the_host_equals_the_device_read():
    pos0 = torch.tensor([0, 3, 5, 15, 7])
    lengths = torch.tensor([20, 9, 0, 2, 1])
    a = WindowLayout.build(pos0, lengths, 20, 4)
    b = WindowLayout.build(pos0, lengths, 20, 4, (pos0.numpy(), lengths.numpy()))
    assert a.n_windows == b.n_windows == 5  # user 0: 20 events from column 0
    for name in ("src", "ok", "dst", "valid", "level_div"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # every user's decision positions end a window
    for u in range(5):
        cols = torch.nonzero(a.ok[u]).flatten()
        positions = pos0[u] + a.src[u, cols] + 1
        assert torch.equal(positions % 4 == 0, (cols + 1) % 4 == 0)
    call = AdaptiveCall(pos0, lengths, 20, 4, (pos0.numpy(), lengths.numpy()))
    assert call.layout is call.layout and call.pieces[-1][1] == 20


# ---------------------------------------------------------------- the model's training path


@pytest.mark.parametrize("unlock", ["surprise", "drift"])
def test_model_training_path_equals_inference(unlock):
    """With gradients on the chunked train backend (this kernel) and without them on the
    recurrent backend (piece by piece), the model gives the same outputs and states."""
    model = tiny_model(unlock=unlock, unlock_threshold=1.0)
    items, actions, ts, lengths = events(5, 40)
    state0 = model.init_state(5, "cpu")
    with torch.no_grad():
        want = model.advance(items, actions, ts, lengths, state0)
    model.train()  # dropout is 0
    host = (state0.pos.numpy(), lengths.numpy())
    got = model.advance(items, actions, ts, lengths, state0, host_positions=host)
    assert got.outputs.requires_grad
    torch.testing.assert_close(got.outputs, want.outputs, **TIGHT)
    a, b = got.state.to_fields(), want.state.to_fields()
    for k in a:
        torch.testing.assert_close(a[k].detach(), b[k], **TIGHT, msg=k)


class HostReads:
    """Counts reads of tensor values on the host (each a synchronisation on a GPU)."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        outer = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in ("cpu", "tolist", "numpy"):
                    outer.reads.append(func.__name__)
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero"):
                    outer.reads.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.modes = (Functions(), Ops())

    def __enter__(self) -> HostReads:
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self.modes):
            m.__exit__(*exc)


@pytest.mark.parametrize("unlock", ["surprise", "drift"])
def test_training_step_reads_nothing_from_the_device(unlock):
    """Given the positions on the host, an adaptive schedule's forward and backward read no
    tensor value (without them: one read of pos0 and lengths per call, not per layer)."""
    model = tiny_model(unlock=unlock, unlock_threshold=1.0).train()
    items, actions, ts, lengths = events(5, 40)
    state = model.init_state(5, "cpu")
    host = (state.pos.numpy(), lengths.numpy())
    with HostReads() as seen:
        res = model.advance(items, actions, ts, lengths, state, host_positions=host)
        res.outputs.sum().backward()
    assert seen.reads == []
    with HostReads() as seen:
        model.advance(items, actions, ts, lengths, state)
    assert sorted(seen.reads) == ["cpu", "cpu", "numpy", "numpy"]


def test_training_loop_gives_the_states_positions():
    """MemoryEpoch's host positions are the state's own, segment after segment."""
    model = tiny_model(unlock="surprise", unlock_threshold=1.0).float()
    rng = np.random.default_rng(0)
    lengths = np.array([2, 9, 30, 31, 55, 60])
    n = int(lengths.sum())
    seqs = EventSeqs(
        user_ids=[str(u) for u in range(6)],
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        items=rng.integers(0, 30, n), actions=np.zeros(n, np.int64),
        ts_ms=1_000_000 + np.cumsum(rng.integers(1, 9_000, n)), part=np.zeros(n, np.int64),
        global_idx=np.arange(n),
    )  # fmt: skip
    epoch = MemoryEpoch(
        model, seqs, lengths, TrainConfig(batch_size=6, segment_len=13), torch.device("cpu")
    )
    calls = []
    advance = MemoryRecommender.advance

    def checked(self, items, actions, ts, lens, state, **kw):
        pos, seg = kw["host_positions"]
        assert np.array_equal(pos, state.pos.numpy()) and np.array_equal(seg, lens.numpy())
        calls.append(len(pos))
        return advance(self, items, actions, ts, lens, state, **kw)

    class Control:
        stop, step = False, 0

        def before_step(self):
            pass

        def after_step(self, loss, n):
            return False

    MemoryRecommender.advance = checked
    try:
        epoch(0, Control())
    finally:
        MemoryRecommender.advance = advance
    assert len(calls) == 5  # 59 inputs in segments of 13
