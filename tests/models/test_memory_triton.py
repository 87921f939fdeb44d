"""The Triton kernel: argument checks on CPU, and its logic under Triton's CPU interpreter.

The kernel itself runs on CUDA (bench/gpu_memory.py checks it there against the float64
reference); TRITON_INTERPRET=1 executes the same kernel source on CPU tensors, slowly, which
is enough to check masks, varlen offsets and in-place slab writes on small inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.memory import triton_momentum as tm
from models.memory.naive import memory_scan_reference
from tests.models.test_memory import make_inputs

ROOT = Path(__file__).resolve().parents[2]


def slab_args(total=5, H=2, K=8, V=4, B=2, n_slab=6):
    return dict(
        q=torch.randn(total, H, K),
        k=torch.randn(total, H, K),
        v=torch.randn(total, H, V),
        theta=torch.rand(total, H),
        eta=torch.rand(total, H),
        alpha=torch.rand(total, H),
        cu_seqlens=torch.tensor([0, 2, total]),
        pos0=torch.zeros(B, dtype=torch.int64),
        S_slab=torch.zeros(n_slab, H, K, V),
        M_slab=torch.zeros(n_slab, H, K, V),
        slots=torch.tensor([4, 1]),
    )


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tm._kernel.cache_clear()
    yield
    tm._kernel.cache_clear()


def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        tm.memory_ingest_triton(**slab_args(), n_blocks=2, horizon=4)
    inp = make_inputs(2, 3, 2, 8, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        tm.memory_scan_triton(**inp, n_blocks=2, horizon=4)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.randn(5, 2)), "q and k"),
        (dict(v=torch.randn(5, 3, 4)), "v must be"),
        (dict(theta=torch.rand(5, 3)), "theta must be"),
        (dict(S_slab=torch.zeros(6, 2, 8, 5)), "S_slab must be"),
        (dict(M_slab=None), "needs M_slab"),
        (dict(S_slab=torch.zeros(6, 2, 8, 4, dtype=torch.float64)), "float32"),
        (dict(slots=torch.tensor([4, 1, 0])), "disagree"),
        (dict(cu_seqlens=torch.tensor([0, 2, 4])), "cu_seqlens must run"),
        (
            dict(
                cu_seqlens=torch.tensor([0, 3, 2, 5]),
                slots=torch.tensor([0, 1, 2]),
                pos0=torch.zeros(3, dtype=torch.int64),
            ),
            "non-decreasing",
        ),  # fmt: skip
        (dict(slots=torch.tensor([4, 6])), "out of range"),
        (dict(slots=torch.tensor([1, 1])), "distinct"),
        (dict(pos0=torch.tensor([0, -1])), "pos0"),
    ],
)
def test_ingest_argument_checks(interpret, change, match):
    with pytest.raises(ValueError, match=match):
        tm.memory_ingest_triton(**{**slab_args(), **change}, n_blocks=2, horizon=4)
    with pytest.raises(ValueError, match="n_blocks"):
        tm.memory_ingest_triton(**slab_args(), n_blocks=9, horizon=4)


@pytest.mark.parametrize("momentum", [True, False])
def test_scan_matches_reference_in_interpreter(interpret, momentum):
    inp = make_inputs(5, 9, 2, 10, 6, momentum=momentum, dtype=torch.float32, seed=1)
    inp["pos0"] = torch.tensor([0, 3, 7, 20, 5])
    inp["lengths"] = torch.tensor([9, 0, 1, 5, 9])
    kw = dict(n_blocks=3, horizon=12)
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    y, S, M = tm.memory_scan_triton(**inp, **kw, block_v=4)  # V=6: two blocks, one partial
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)
    if momentum:
        torch.testing.assert_close(M, M_ref, rtol=1e-5, atol=1e-5)
    else:
        assert M is inp["M0"]


@pytest.mark.parametrize("momentum", [True, False])
def test_ingest_writes_slab_rows_in_place(interpret, momentum):
    H, K, V = 2, 8, 4
    g = torch.Generator().manual_seed(5)
    lens = [3, 0, 1, 4]
    total, B = sum(lens), len(lens)
    ev = dict(
        q=torch.randn(total, H, K, generator=g),
        k=torch.randn(total, H, K, generator=g),
        v=torch.randn(total, H, V, generator=g),
        theta=torch.rand(total, H, generator=g),
        eta=torch.rand(total, H, generator=g) if momentum else None,
        alpha=torch.rand(total, H, generator=g) * 0.3,
    )
    S_slab = torch.randn(7, H, K, V, generator=g)
    M_slab = torch.randn(7, H, K, V, generator=g)
    slots = torch.tensor([5, 0, 2, 6])
    pos0 = torch.tensor([0, 4, 3, 9])
    cu = torch.tensor([0, 3, 3, 4, 8])
    S_before, M_before = S_slab.clone(), M_slab.clone()
    kw = dict(n_blocks=4, horizon=16)
    y = tm.memory_ingest_triton(
        **ev, cu_seqlens=cu, pos0=pos0, S_slab=S_slab, M_slab=M_slab, slots=slots, **kw
    )
    for b in range(B):
        s, e = int(cu[b]), int(cu[b + 1])
        pad = {n: None if x is None else x[s:e][None] for n, x in ev.items()}
        sl = int(slots[b])
        y_ref, S_ref, M_ref = memory_scan_reference(
            **pad, S0=S_before[sl][None], M0=M_before[sl][None], pos0=pos0[b : b + 1],
            lengths=torch.tensor([e - s]), **kw,
        )  # fmt: skip
        torch.testing.assert_close(y[s:e], y_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S_slab[sl], S_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(M_slab[sl], M_ref[0], rtol=1e-5, atol=1e-5)
    untouched = [1, 3, 4]
    assert torch.equal(S_slab[untouched], S_before[untouched])
    assert torch.equal(M_slab[untouched], M_before[untouched])
    if not momentum:
        assert torch.equal(M_slab, M_before)


FLA_CHECK = """
import torch
from models.memory.fla_gated import memory_scan_fla_recurrent
from models.memory.naive import memory_scan_reference
from tests.models.test_memory import make_inputs
inp = make_inputs(4, 7, 2, 8, 8, momentum=False, dtype=torch.float32, seed=2)
inp["lengths"] = torch.tensor([7, 0, 1, 5])
kw = dict(n_blocks=4, horizon=12)
ref = memory_scan_reference(**inp, **kw)
out = memory_scan_fla_recurrent(**inp, **kw)
for a, b in zip(out, ref):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_fla_reparameterisation_in_interpreter():
    """fla's fused recurrent gated delta rule, fed our reparameterised inputs, is our rule."""
    pytest.importorskip("fla")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", FLA_CHECK], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_fla_chunk_dots_default_to_three_pass_tf32(monkeypatch):
    """chunk_kda misses the 1e-3 bar under Triton's TF32 default; the chunk path asks for
    tf32x3 unless the user chose a precision."""
    from models.memory import fla_gated

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert fla_gated.precise_f32_dots() == "tf32x3"
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32x3"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert fla_gated.precise_f32_dots() == "ieee"
    monkeypatch.delenv("TRITON_F32_DEFAULT")
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="momentum"):  # refused before any kernel runs
        fla_gated.memory_scan_fla_chunk(
            q, q, q, q[..., 0], q[..., 0], q[..., 0], torch.zeros(1, 1, 4, 4), None,
            torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
            n_blocks=1, horizon=4,
        )  # fmt: skip
