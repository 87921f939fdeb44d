"""The chunked form equals the reference, values and gradients, for every chunk size."""

from __future__ import annotations

import pytest
import torch

from models.memory.chunk import memory_scan_chunk
from models.memory.chunk_aligned import memory_scan_chunk_aligned
from models.memory.naive import memory_scan_reference
from models.memory.proteus import open_rows
from models.memory.recurrent import memory_scan_recurrent
from tests.models.test_memory import make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16, 64])
def test_chunk_equals_reference(momentum, chunk_size):
    inp = make_inputs(6, 13, 2, 10, 5, momentum=momentum, seed=chunk_size)
    inp["pos0"] = torch.tensor([0, 3, 7, 11, 2, 40])
    inp["lengths"] = torch.tensor([13, 0, 1, 5, 12, 13])
    kw = dict(n_blocks=3, horizon=12)
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    y, S, M = memory_scan_chunk(**inp, **kw, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(S, S_ref, **TIGHT)
    if momentum:
        torch.testing.assert_close(M, M_ref, **TIGHT)
    else:
        assert M is inp["M0"]
    pad = torch.arange(13)[None, :] >= inp["lengths"][:, None]
    assert not y[pad].any()


@pytest.mark.parametrize("momentum", [True, False])
def test_chunk_keeps_locked_rows_bit_identical(momentum):
    K, E, N = 12, 4, 40
    inp = make_inputs(3, 8, 2, K, 5, momentum=momentum, seed=2)
    inp["pos0"] = torch.tensor([0, 9, 18])
    inp["lengths"] = torch.tensor([8, 8, 8])
    _, S, M = memory_scan_chunk(**inp, n_blocks=E, horizon=N, chunk_size=4)
    for b in range(3):
        rows = open_rows(int(inp["pos0"][b]) + 8, K, E, N)
        assert torch.equal(S[b, :, rows:], inp["S0"][b, :, rows:])
        if momentum:
            assert torch.equal(M[b, :, rows:], inp["M0"][b, :, rows:])


@pytest.mark.parametrize(
    ("scan", "T"),
    [(memory_scan_chunk, 9), (memory_scan_chunk_aligned, 19)],
    ids=["chunk", "aligned"],
)
def test_chunked_forms_with_gates_at_their_limits(scan, T):
    """eta = 0 and alpha = 1 (products that hit zero) are exact, not NaN, in both chunked
    forms (the training one and the aligned CPU inference one)."""
    inp = make_inputs(3, T, 1, 6, 3, seed=4)
    inp["eta"][:, ::3] = 0.0
    inp["alpha"][:, 1::4] = 1.0
    kw = dict(n_blocks=2, horizon=8)
    ref = memory_scan_reference(**inp, **kw)
    out = scan(**inp, **kw, chunk_size=4)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("momentum", [True, False])
def test_chunk_stable_in_float32(momentum):
    inp = make_inputs(4, 96, 2, 32, 16, momentum=momentum, dtype=torch.float32, seed=9)
    inp["eta"] = None if not momentum else inp["eta"] * 0.95
    kw = dict(n_blocks=4, horizon=64)
    exact = {n: (x.double() if x is not None and x.is_floating_point() else x)
             for n, x in inp.items()}  # fmt: skip
    y_ref, S_ref, _ = memory_scan_recurrent(**exact, **kw)
    for chunk_size in (16, 32, 64):
        y, S, _ = memory_scan_chunk(**inp, **kw, chunk_size=chunk_size)
        assert (y.double() - y_ref).norm() / y_ref.norm() < 1e-5
        assert (S.double() - S_ref).norm() / S_ref.norm() < 1e-5


@pytest.mark.parametrize("momentum", [True, False])
def test_chunk_gradients_equal_recurrent_gradients(momentum):
    inp = make_inputs(3, 7, 2, 6, 4, momentum=momentum, seed=13)
    inp["lengths"] = torch.tensor([7, 3, 6])
    kw = dict(n_blocks=2, horizon=6)
    names = [n for n in ("q", "k", "v", "theta", "eta", "alpha", "S0", "M0") if inp[n] is not None]
    w_y = torch.randn(3, 7, 2, 4, dtype=torch.float64)
    w_s = torch.randn(3, 2, 6, 4, dtype=torch.float64)

    def grads(fn, **extra):
        leaves = {n: inp[n].clone().requires_grad_(True) for n in names}
        args = {**inp, **leaves}
        y, S, M = fn(**args, **kw, **extra)
        loss = (y * w_y).sum() + (S * w_s).sum() + (M.sum() if momentum else 0)
        return torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)

    g_rec = grads(memory_scan_recurrent)
    g_chk = grads(memory_scan_chunk, chunk_size=3)
    for n, a, b in zip(names, g_chk, g_rec, strict=True):
        if b is None:
            assert a is None or not a.any(), n
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=n)
