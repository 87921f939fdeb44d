"""The aligned chunked form (CPU inference) equals the reference, for every schedule and
chunk size, keeps locked rows and padding exact, and is what ``auto`` picks for wide
no-gradient CPU batches."""

from __future__ import annotations

import pytest
import torch

from models.memory.chunk_aligned import aligned_chunk_size, memory_scan_chunk_aligned
from models.memory.naive import memory_scan_reference
from models.memory.ops import (
    CPU_CHUNK_ALWAYS_EVENTS,
    CPU_CHUNK_MIN_CELLS,
    CPU_CHUNK_MIN_EVENTS,
    memory_scan,
    resolve_backend,
)
from models.memory.proteus import open_rows
from models.memory.recurrent import memory_scan_recurrent
from tests.models.test_memory import make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)


def assert_matches_reference(inp, kw, chunk_size, momentum):
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    y, S, M = memory_scan_chunk_aligned(**inp, **kw, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(S, S_ref, **TIGHT)
    if momentum:
        torch.testing.assert_close(M, M_ref, **TIGHT)
    else:
        assert M is inp["M0"]
    T = inp["q"].shape[1]
    pad = torch.arange(T)[None, :] >= inp["lengths"][:, None]
    assert not y[pad].any()


def test_aligned_chunk_size_divides_delta():
    assert aligned_chunk_size(16, 16, 256) == 16  # Delta 16
    assert aligned_chunk_size(16, 3, 12) == 4  # Delta 4
    assert aligned_chunk_size(16, 4, 24) == 6  # Delta 6
    assert aligned_chunk_size(5, 4, 24) == 3
    assert aligned_chunk_size(16, 8, 4) == 1  # Delta 1


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 16])
def test_aligned_equals_reference(momentum, chunk_size):
    """Users before, across and past the schedule's unlocks, with and without padding; K not
    a multiple of the blocks (the last block takes the remainder)."""
    inp = make_inputs(7, 13, 2, 10, 5, momentum=momentum, seed=chunk_size)
    inp["pos0"] = torch.tensor([0, 3, 7, 11, 2, 40, 5])
    inp["lengths"] = torch.tensor([13, 0, 1, 5, 12, 13, 2])
    assert_matches_reference(inp, dict(n_blocks=3, horizon=12), chunk_size, momentum)


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    ("n_blocks", "horizon"), [(1, 8), (4, 24), (4, 40), (5, 16), (8, 4), (2, 100)]
)
def test_aligned_equals_reference_for_other_schedules(momentum, n_blocks, horizon):
    inp = make_inputs(6, 21, 2, 12, 4, momentum=momentum, seed=n_blocks * horizon, max_pos=60)
    assert_matches_reference(inp, dict(n_blocks=n_blocks, horizon=horizon), 16, momentum)


@pytest.mark.parametrize("momentum", [True, False])
def test_aligned_keeps_locked_rows_and_idle_users_bit_identical(momentum):
    K, E, N = 12, 4, 40
    inp = make_inputs(4, 11, 2, K, 5, momentum=momentum, seed=2)
    inp["pos0"] = torch.tensor([0, 9, 18, 3])
    inp["lengths"] = torch.tensor([11, 8, 11, 0])
    S0, M0 = inp["S0"].clone(), inp["M0"].clone()
    _, S, M = memory_scan_chunk_aligned(**inp, n_blocks=E, horizon=N, chunk_size=5)
    assert torch.equal(inp["S0"], S0) and torch.equal(inp["M0"], M0)  # inputs untouched
    for b in range(4):
        rows = open_rows(int(inp["pos0"][b] + inp["lengths"][b]), K, E, N)
        if int(inp["lengths"][b]) == 0:
            rows = 0
        assert torch.equal(S[b, :, rows:], S0[b, :, rows:])
        if momentum:
            assert torch.equal(M[b, :, rows:], M0[b, :, rows:])


@pytest.mark.parametrize("momentum", [True, False])
def test_aligned_stable_in_float32_at_the_default_sizes(momentum):
    """H=4, K=V=64, E=16, N=256 as the default config; float32 against float64."""
    inp = make_inputs(5, 80, 4, 64, 64, momentum=momentum, dtype=torch.float32, seed=9)
    inp["pos0"] = torch.tensor([0, 7, 100, 250, 900])
    inp["lengths"] = torch.tensor([80, 61, 17, 80, 33])
    kw = dict(n_blocks=16, horizon=256)
    exact = {n: (x.double() if x is not None and x.is_floating_point() else x)
             for n, x in inp.items()}  # fmt: skip
    y_ref, S_ref, M_ref = memory_scan_recurrent(**exact, **kw)
    y, S, M = memory_scan_chunk_aligned(**inp, **kw, chunk_size=16)
    assert (y.double() - y_ref).norm() / y_ref.norm() < 1e-5
    assert (S.double() - S_ref).norm() / S_ref.norm() < 1e-5
    if momentum:
        assert M is not None and M_ref is not None
        assert (M.double() - M_ref).norm() / M_ref.norm() < 1e-5


def test_auto_picks_the_aligned_chunks_for_large_cpu_batches_without_gradients():
    cpu = torch.device("cpu")
    T, many = CPU_CHUNK_MIN_EVENTS, -(-CPU_CHUNK_MIN_CELLS // CPU_CHUNK_MIN_EVENTS)

    def pick(length, users, chunk=16, training=False):
        return resolve_backend("auto", cpu, training, length=length, users=users, chunk=chunk)

    assert pick(T, many) == "chunk_aligned"
    assert pick(T, many - 1) == "recurrent"  # too few cells for the set-up to pay
    assert pick(T - 1, 1000) == "recurrent"  # too narrow
    assert pick(CPU_CHUNK_ALWAYS_EVENTS, 1) == "chunk_aligned"
    assert pick(CPU_CHUNK_ALWAYS_EVENTS, 1, chunk=1) == "recurrent"  # Delta too small
    assert pick(T, many, training=True) == "chunk"
    assert resolve_backend("auto", cpu, False) == "recurrent"  # a gradient is wanted


def test_memory_scan_auto_equals_reference_for_narrow_and_wide_batches():
    kw = dict(n_blocks=4, horizon=32)
    for T in (3, CPU_CHUNK_ALWAYS_EVENTS + 5):
        inp = make_inputs(5, T, 2, 8, 3, seed=T)
        y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
        y, S, M = memory_scan(**inp, **kw, backend="auto", chunk_size=16)
        for a, b in ((y, y_ref), (S, S_ref), (M, M_ref)):
            torch.testing.assert_close(a, b, **TIGHT)


def test_memory_scan_auto_keeps_gradients_when_an_input_needs_them():
    inp = make_inputs(3, CPU_CHUNK_ALWAYS_EVENTS + 2, 2, 8, 3, seed=5)
    inp["q"] = inp["q"].clone().requires_grad_(True)
    y, _, _ = memory_scan(**inp, n_blocks=2, horizon=8, backend="auto")
    assert y.requires_grad
