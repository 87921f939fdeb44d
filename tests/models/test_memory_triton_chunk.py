"""The chunked Triton kernel (triton_chunk.py) under Triton's CPU interpreter, in float64
against the one-event-at-a-time reference: both rules, chunks cut at Proteus mask changes
(users at different lifetime positions), T not a multiple of the chunk, padding, K and V not
powers of two, several value blocks, gates at 0 and 1. Sizes stay small: the interpreter
is slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.memory import triton_chunk as tc
from models.memory.naive import memory_scan_reference
from models.memory.ops import memory_scan
from models.memory.proteus import open_rows
from tests.models.test_memory import make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tc._kernel.cache_clear()
    yield
    tc._kernel.cache_clear()


def check(inp, kw, momentum, tol, **launch):
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    y, S, M = tc.memory_scan_triton_chunk(**inp, **kw, **launch)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(S, S_ref, **tol)
    if momentum:
        torch.testing.assert_close(M, M_ref, **tol)
    else:
        assert M is inp["M0"]
    T = inp["q"].shape[1]
    pad = torch.arange(T)[None, :] >= inp["lengths"][:, None]
    assert not y[pad].any()
    return S, M


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    "n_blocks,horizon",
    [(3, 12), (4, 70), (8, 4), (1, 10)],  # Delta 4, 17 (changes inside 16-chunks), 1, static
)
def test_chunk_kernel_equals_reference(interpret, momentum, n_blocks, horizon):
    """Users before, across and past the unlocks, lengths 0, 1, partial and T = 37 (two full
    chunks and a partial one); K = 10 (the last block takes the remainder), V = 20 in two
    value blocks of 16, one partial. Locked rows keep their bits."""
    inp = make_inputs(6, 37, 2, 10, 20, momentum=momentum, seed=n_blocks + horizon)
    inp["pos0"] = torch.tensor([0, 3, 15, 33, 70, 5])
    inp["lengths"] = torch.tensor([37, 0, 1, 20, 37, 9])
    kw = dict(n_blocks=n_blocks, horizon=horizon)
    S, M = check(inp, kw, momentum, TIGHT, block_v=16)
    for b in range(6):
        t_last = int(inp["pos0"][b] + inp["lengths"][b])
        rows = open_rows(max(t_last, 1), 10, n_blocks, horizon)
        assert torch.equal(S[b, :, rows:], inp["S0"][b, :, rows:])
        if momentum:
            assert torch.equal(M[b, :, rows:], inp["M0"][b, :, rows:])


@pytest.mark.parametrize("solve", tc.SOLVES)
@pytest.mark.parametrize("momentum", [True, False])
def test_chunk_kernel_gates_at_zero_and_one(interpret, momentum, solve):
    """alpha = 1 (the state is forgotten: a = 0), eta at 0 and 1, theta at 0: cumulative
    products, never ratios, so they are exact; a chunk of 32; both triangular solves."""
    inp = make_inputs(3, 40, 1, 16, 16, momentum=momentum, seed=7)
    for name, value, every in (("alpha", 1.0, 5), ("theta", 0.0, 7), ("eta", 0.0, 3)):
        if inp[name] is not None:
            inp[name][:, ::every] = value
    if momentum:
        inp["eta"][:, 1::4] = 1.0
    inp["pos0"] = torch.tensor([0, 17, 300])
    inp["lengths"] = torch.tensor([40, 33, 38])
    check(inp, dict(n_blocks=4, horizon=64), momentum, TIGHT, chunk_size=32, solve=solve)


def test_chunk_kernel_float32_and_backend_name(interpret):
    """float32 inputs compute in float32 (the GPU path); the registered backend name; the
    doubling solve and the hand-split three-pass dots in float32."""
    inp = make_inputs(3, 18, 2, 8, 8, momentum=True, dtype=torch.float32, seed=3)
    inp["pos0"] = torch.tensor([0, 14, 2])
    inp["lengths"] = torch.tensor([18, 11, 0])
    kw = dict(n_blocks=4, horizon=32)
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    y, S, M = memory_scan(**inp, **kw, backend="triton_chunk")
    assert y.dtype == S.dtype == torch.float32
    outs = [(y, S, M), tc.memory_scan_triton_chunk(**inp, **kw, solve="doubling")]
    outs.append(tc.memory_scan_triton_chunk(**inp, **kw, input_precision="tf32x3m"))
    for out in outs:
        for got, ref in zip(out, (y_ref, S_ref, M_ref), strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_chunk_kernel_argument_checks(interpret, monkeypatch):
    inp = make_inputs(2, 3, 2, 8, 4, dtype=torch.float32)
    kw = dict(n_blocks=2, horizon=4)
    for bad, match in ((dict(chunk_size=8), "power of two"), (dict(chunk_size=24), "power"),
                       (dict(input_precision="bf16"), "input_precision"),
                       (dict(solve="lu"), "solve")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            tc.memory_scan_triton_chunk(**inp, **kw, **bad)
    with pytest.raises(ValueError, match="n_blocks"):
        tc.memory_scan_triton_chunk(**inp, n_blocks=9, horizon=4)
    with pytest.raises(ValueError, match="lengths"):
        tc.memory_scan_triton_chunk(**{**inp, "lengths": torch.tensor([4, 0])}, **kw)
    with pytest.raises(ValueError, match="S0"):
        tc.memory_scan_triton_chunk(**{**inp, "S0": torch.zeros(2, 2, 8, 5)}, **kw)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        tc.memory_scan_triton_chunk(**inp, **kw)


def test_gpu_benchmark_dry_run(tmp_path):
    """bench/gpu_chunk_kernel.py's whole flow on CPU (interpreter, tiny sizes): checks before
    timings, the JSON with its summary and goals (fla skipped without CUDA)."""
    out = tmp_path / "chunk.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_chunk_kernel.py"), "--dry-run", "--json",
           str(out), "--ts", "16", "--variants", "subst/tf32x3/1/32,doubling/tf32/1/32"]  # fmt: skip
    env = {**os.environ, "GIT_COMMIT": "abc123"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["git_commit"] == "abc123" and r["dry_run"] and not r["skipped"]
    expect = {f"{v}/{rule}" for v in r["variants"] for rule in ("momentum", "delta")}
    expect |= {f"{v}/momentum/issue_dims" for v in r["variants"]}  # the issue's H, K, V
    assert set(r["checks"]) == expect
    assert all(c["pass"] for c in r["checks"].values())
    timings = r["timings"]["T=16"]
    assert timings["sequential/momentum"]["events_per_s"] > 0
    assert "skipped" in timings["fla_chunk_gdr/float32"]
    assert r["summary"]["ratios"]["T=16/momentum/chunk_best_over_sequential"] > 0
    assert r["summary"]["goals"]["T=16: chunk (delta) >= fla chunk_gated_delta_rule"] is None
    issue = r["summary"]["issue_dims"]
    assert issue["dims_HKV"] == [4, 64, 64] and issue["chunk_best_over_sequential"] > 0
