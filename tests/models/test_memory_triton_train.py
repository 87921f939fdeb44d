"""The fused training kernels (forward and backward) against the reference, under Triton's
CPU interpreter, and the guard that hands a failing fused path to the eager chunked form.

The kernels run on CUDA in training (bench/bench_train.py checks them there against the
eager form); TRITON_INTERPRET=1 executes the same kernel source on CPU tensors, in float64
here, so outputs, final states and every input gradient are compared with the
one-event-at-a-time reference to 1e-10.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.memory import training
from models.memory import triton_train as tt
from models.memory.chunk import memory_scan_chunk
from models.memory.naive import memory_scan_reference
from models.memory.ops import memory_scan
from models.memory.proteus import open_rows
from models.memory.training import outputs_and_grads, relative_error
from tests.models.test_memory import make_inputs

TIGHT = 1e-10
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tt._kernels.cache_clear()
    yield
    tt._kernels.cache_clear()


@pytest.fixture
def fresh_guard(monkeypatch):
    """Each test starts with no fused path disabled or checked."""
    monkeypatch.setattr(training, "_disabled", set())
    monkeypatch.setattr(training, "_checked", {})


def crossing_inputs(momentum: bool, T: int = 11, K: int = 10, V: int = 6, seed: int = 1):
    """Users that cross Proteus unlocks inside the segment (Delta = 4), pass the horizon,
    have one event, none (padding), or start at 0."""
    inp = make_inputs(5, T, 2, K, V, momentum=momentum, seed=seed)
    inp["pos0"] = torch.tensor([0, 3, 7, 20, 2])
    inp["lengths"] = torch.tensor([T, 0, 1, T - 2, T - 5])
    return inp


SCHED = dict(n_blocks=3, horizon=12)


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    ("checkpoint", "fwd_bv", "bwd_bv"), [(4, 4, 4), (1, 32, 2), (16, 2, 32), (5, 8, 4)]
)
def test_outputs_states_and_gradients_equal_reference(
    interpret, momentum, checkpoint, fwd_bv, bwd_bv
):
    """K = 10 (not a power of two), V = 6 in one, two (one partial) or three value blocks,
    forward and backward split differently, checkpoints every event, every 4 or 5 events
    or once for the whole segment."""
    inp = crossing_inputs(momentum)
    ref = outputs_and_grads(memory_scan_reference, inp, **SCHED)
    got = outputs_and_grads(
        tt.memory_scan_triton_train, inp, **SCHED, checkpoint=checkpoint,
        fwd=(fwd_bv, 2), bwd=(bwd_bv, 4),
    )  # fmt: skip
    assert len(got) == len(ref) == (3 + 8 if momentum else 2 + 6)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=TIGHT, atol=TIGHT)
    pad = torch.arange(11)[None, :] >= inp["lengths"][:, None]
    assert not got[0][pad].any()


@pytest.mark.parametrize("momentum", [True, False])
def test_gates_at_their_limits(interpret, momentum):
    """theta, eta = 0 and alpha = 1 (decay to zero) are exact, forward and backward."""
    inp = crossing_inputs(momentum, seed=4)
    inp["alpha"][:, 1::4] = 1.0
    inp["theta"][:, 2::5] = 0.0
    if momentum:
        inp["eta"][:, ::3] = 0.0
    ref = outputs_and_grads(memory_scan_reference, inp, **SCHED)
    got = outputs_and_grads(tt.memory_scan_triton_train, inp, **SCHED, checkpoint=4)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=TIGHT, atol=TIGHT)


@pytest.mark.parametrize("momentum", [True, False])
def test_locked_rows_keep_their_bits(interpret, momentum):
    K, E, N = 12, 4, 40
    inp = make_inputs(3, 8, 2, K, 5, momentum=momentum, seed=2)
    inp["pos0"] = torch.tensor([0, 9, 18])
    inp["lengths"] = torch.tensor([8, 8, 8])
    _, S, M = tt.memory_scan_triton_train(**inp, n_blocks=E, horizon=N, checkpoint=3)
    for b in range(3):
        rows = open_rows(int(inp["pos0"][b]) + 8, K, E, N)
        assert torch.equal(S[b, :, rows:], inp["S0"][b, :, rows:])
        if momentum:
            assert torch.equal(M[b, :, rows:], inp["M0"][b, :, rows:])
        else:
            assert M is inp["M0"]


def test_float32_stays_close_to_float64(interpret):
    inp = crossing_inputs(True, T=24, K=16, V=8, seed=6)
    ref = outputs_and_grads(memory_scan_reference, inp, n_blocks=4, horizon=32)
    f32 = {n: x.float() if x is not None and x.is_floating_point() else x for n, x in inp.items()}
    got = outputs_and_grads(tt.memory_scan_triton_train, f32, n_blocks=4, horizon=32)
    assert got[0].dtype == torch.float32
    assert relative_error(got, ref) < 1e-5


def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        tt.memory_scan_triton_train(**crossing_inputs(True), **SCHED)


# ---------------------------------------------------------------- the guard and dispatch


def test_dispatch_runs_the_kernels_under_the_guard(interpret, fresh_guard):
    """memory_scan(training=True, backend='triton') is the fused path with autograd."""
    inp = crossing_inputs(True)
    got = outputs_and_grads(memory_scan, inp, **SCHED, backend="triton", training=True)
    ref = outputs_and_grads(memory_scan_reference, inp, **SCHED)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=TIGHT, atol=TIGHT)
    assert not training.path_disabled("triton")


class _BrokenBackward(torch.autograd.Function):
    """Identity whose backward raises, like a kernel that fails to compile there."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward kernel did not compile")


def _broken(stage: str):
    def scan(*args, **kwargs):
        if stage == "forward":
            raise RuntimeError("forward kernel did not compile")
        y, S, M = memory_scan_reference(*args, **kwargs)
        return _BrokenBackward.apply(y), _BrokenBackward.apply(S), M

    return scan


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("momentum", [True, False])
def test_a_failing_fused_path_falls_back_with_one_warning(
    monkeypatch, fresh_guard, caplog, stage, momentum
):
    monkeypatch.setattr(training, "fused_scan", lambda name: _broken(stage))
    inp = crossing_inputs(momentum)
    ref = outputs_and_grads(memory_scan_chunk, inp, **SCHED, chunk_size=4)
    with caplog.at_level(logging.WARNING, logger="models.memory.training"):
        for _ in range(2):
            got = outputs_and_grads(
                memory_scan, inp, **SCHED, backend="triton", training=True, chunk_size=4
            )
            for a, b in zip(got, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=TIGHT, atol=TIGHT)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and stage in warnings[0].getMessage()
    assert training.path_disabled("triton")


def test_auto_uses_a_fused_path_only_once_checked(monkeypatch, fresh_guard, caplog):
    """A path that runs but disagrees with the eager form is not used by auto."""

    def off_by_a_percent(*args, **kwargs):
        y, S, M = memory_scan_chunk(*args, **kwargs)
        return y * 1.01, S, M

    monkeypatch.setattr(training, "fused_scan", lambda name: off_by_a_percent)
    device = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="models.memory.training"):
        assert not training.path_checked("triton", device, True, 2, 8, 4, **SCHED)
    assert "differs" in caplog.text
    monkeypatch.setattr(training, "_checked", {})
    monkeypatch.setattr(training, "fused_scan", lambda name: memory_scan_chunk)
    assert training.path_checked("triton", device, True, 2, 8, 4, **SCHED)


def test_kernels_pass_the_check_in_the_interpreter(interpret, fresh_guard):
    for momentum in (True, False):
        err = training.check_against_eager(
            tt.memory_scan_triton_train, torch.device("cpu"), momentum, 2, 8, 4, **SCHED
        )
        assert err < 1e-5


def test_train_backend_names_are_checked():
    training.check_train_backend("auto", True)
    training.check_train_backend("fla_chunk", False)
    with pytest.raises(ValueError, match="momentum"):
        training.check_train_backend("fla_chunk", True)
    with pytest.raises(ValueError, match="memory.train_backend"):
        training.check_train_backend("chunk_aligned", True)


# ---------------------------------------------------------------- fla's chunk_kda for training


def test_fla_training_mapping_through_fla_naive_form(fresh_guard):
    """The padded mapping (gk, k~ / (1 - alpha), theta (1 - alpha)) fed to fla's own naive
    recurrent KDA: our rule without momentum, values and every gradient (fla computes in
    float32)."""
    pytest.importorskip("fla")
    from fla.ops.kda.naive import naive_recurrent_kda

    from models.memory.fla_gated import memory_scan_fla_chunk_train

    inp = crossing_inputs(False, K=12, V=8, seed=8)
    inp["alpha"][:, 1::4] = 0.9
    ref = outputs_and_grads(memory_scan_reference, inp, **SCHED)
    got = outputs_and_grads(memory_scan_fla_chunk_train, inp, **SCHED, kda=naive_recurrent_kda)
    assert relative_error(got, ref) < 1e-5
    assert got[1].dtype == torch.float64  # handed back in the caller's dtype
    with pytest.raises(ValueError, match="momentum"):
        memory_scan_fla_chunk_train(**crossing_inputs(True), **SCHED)


FLA_CHUNK_CHECK = """
import builtins, importlib, logging, pkgutil
import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner
from triton.runtime.interpreter import TensorHandle

# Two gaps of Triton's CPU interpreter that fla's chunk kernels hit: autotuning needs a GPU
# timer (every configuration is called equal: the first one runs), and loop counters are
# plain ints where fla calls .to(tl.int64) on them.
autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles: [0.0, 0.0, 0.0])


class Counter(int):
    def to(self, dtype, **kwargs):
        np_type = {tl.int64: np.int64, tl.int32: np.int32}[dtype]
        return tl.core.tensor(TensorHandle(np.array(int(self), dtype=np_type), dtype), dtype)


def counting_range(*args):
    return (Counter(i) for i in builtins.range(*args))


import fla.ops
for info in pkgutil.walk_packages(fla.ops.__path__, "fla.ops."):
    try:
        importlib.import_module(info.name).range = counting_range
    except Exception:
        pass

from models.memory import training
from models.memory.naive import memory_scan_reference
from models.memory.ops import memory_scan
from models.memory.training import outputs_and_grads, relative_error
from tests.models.test_memory_triton_train import SCHED, crossing_inputs

logging.basicConfig(level=logging.WARNING)
inp = crossing_inputs(False, T=21, K=16, V=8, seed=3)
ref = outputs_and_grads(memory_scan_reference, inp, **SCHED)
f32 = {n: x.float() if x is not None and x.is_floating_point() else x for n, x in inp.items()}
got = outputs_and_grads(memory_scan, f32, **SCHED, backend="fla_chunk", training=True)
assert not training.path_disabled("fla_chunk"), "fell back to the eager form"
err = relative_error(got, ref)
assert err < 1e-5, err
print("ok", err)
"""


def test_fla_chunk_kda_training_path_in_interpreter():
    """fla's chunk_kda forward and backward kernels, through memory_scan(training=True,
    backend='fla_chunk'), under Triton's CPU interpreter (in a child process: the two
    interpreter shims patch fla's modules)."""
    pytest.importorskip("fla")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", FLA_CHUNK_CHECK], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().startswith("ok"), res.stderr[-3000:]


@pytest.mark.parametrize("momentum", [True, False])
def test_model_training_step_on_the_kernels_equals_chunk(
    interpret, fresh_guard, monkeypatch, momentum
):
    """A MemoryRecommender's loss and every parameter gradient with memory.train_backend =
    triton equal those with chunk (float64, two layers, unlocks inside the batch)."""
    from tests.models.test_recommender import N_ITEMS, advance, batch, small_model

    used = []
    fused = training.fused_scan
    monkeypatch.setattr(training, "fused_scan", lambda name: used.append(name) or fused(name))

    items, actions, ts = batch(B=3, T=10, seed=5)
    lengths = torch.tensor([10, 4, 7])
    request = ts + 1000
    grads = {}
    for backend in ("chunk", "triton"):
        model = small_model(momentum=momentum, n_blocks=2)
        model.mem_cfg.train_backend = backend
        model.train()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        res = advance(model, items, actions, ts, lengths, request_ts=request)
        logits = res.user @ model.item_weight().T
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, N_ITEMS), items.roll(-1, dims=1).clamp(max=N_ITEMS - 1).reshape(-1)
        )
        loss.backward()
        grads[backend] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert used == ["triton", "triton"] and not training.path_disabled("triton")
    for a, b in zip(grads["triton"], grads["chunk"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


COMPILE_CHECK = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from models.memory import triton_train as tt

for momentum in (True, False):
    for K, V in ((32, 32), (10, 6)):
        for kernel, (block_v, warps) in zip(tt._kernels(), (tt.FWD_LAUNCH, tt.BWD_LAUNCH)):
            BK, BV, _ = tt._blocks(K, V, block_v)
            consts = dict(K=K, V=V, HAS_MOMENTUM=momentum, CK=16, BK=BK, BV=BV)
            signature = {
                n: "constexpr" if n in consts
                else ("*i32" if n in ("rows_ptr", "len_ptr") else "*fp32") if n.endswith("_ptr")
                else "i32"
                for n in kernel.arg_names
            }
            src = ASTSource(kernel, signature, consts)
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            assert out.asm["cubin"]
print("ok")
"""


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build both kernels, both rules, for an H100/H200
    (sm_90) down to a cubin with Triton's bundled ptxas (no GPU needed), at the default
    launches, for a power-of-two layer and one that needs masks. In a child process with a
    fresh kernel cache: the interpreter, once used in a process, breaks later compilations
    there, and a cached kernel would skip the compiler."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_CHECK], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_check_inputs_stay_small_when_unlocks_lie_far_apart(fresh_guard):
    """memory.unlock = narrow runs the scan with a horizon of E * 2**26 events: the check
    before a fused path's first use once sized its inputs by that interval (about 1.3e8
    events per user) and the process was killed for memory. The inputs stay small, the
    second user still crosses the unlock, and the whole check runs."""
    from models.memory.schedule import NARROW_DELTA

    sched = dict(n_blocks=16, horizon=16 * NARROW_DELTA)
    inp = training.check_inputs(torch.device("cpu"), True, 2, 8, 4, **sched)
    T = inp["q"].shape[1]
    assert T <= training.CHECK_EVENTS
    start, length = int(inp["pos0"][1]), int(inp["lengths"][1])
    assert start < NARROW_DELTA <= start + length  # crosses the unlock
    big = training.check_inputs(torch.device("cpu"), True, 2, 8, 4, users=40, **sched)
    assert int((big["pos0"] + big["lengths"]).max()) < 2**31  # fits the kernels' int32
    err = training.check_against_eager(
        memory_scan_reference, torch.device("cpu"), True, 2, 8, 4, **sched
    )
    assert err < 1e-4
