"""The memory rule: Proteus schedule, reference, vectorised recurrent path, state round trip."""

from __future__ import annotations

import pytest
import torch

from models.memory.chunk import memory_scan_chunk
from models.memory.chunk_aligned import memory_scan_chunk_aligned
from models.memory.naive import l2norm, memory_scan_reference, memory_step_reference
from models.memory.ops import BACKENDS, memory_scan, resolve_backend
from models.memory.proteus import (
    open_rows,
    open_rows_tensor,
    proteus_row_mask,
    schedule_delta,
    unlocked_blocks,
)
from models.memory.recurrent import memory_scan_recurrent

F64 = torch.float64


def make_inputs(B, T, H, K, V, *, momentum=True, dtype=F64, seed=0, max_pos=40):
    """Random inputs with a random nonzero starting state (so untouched rows can be told)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    def uni(*s, hi=1.0):
        return torch.rand(*s, generator=g, dtype=dtype) * hi

    return dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, H, V),
        theta=uni(B, T, H),
        eta=uni(B, T, H) if momentum else None,
        alpha=uni(B, T, H, hi=0.3),
        S0=rnd(B, H, K, V),
        M0=rnd(B, H, K, V) * 0.5,
        pos0=torch.randint(0, max_pos, (B,), generator=g),
        lengths=torch.randint(0, T + 1, (B,), generator=g),
    )


def scan(fn, inp, **kw):
    return fn(**inp, **kw)


# ---------------------------------------------------------------- Proteus schedule


@pytest.mark.parametrize("K,E,N", [(64, 4, 100), (10, 3, 12), (7, 7, 3), (16, 1, 50)])
def test_schedule_at_the_boundaries(K, E, N):
    delta = max(1, N // E)
    d = K // E
    assert schedule_delta(E, N) == delta
    expect = {
        1: 1,
        delta: 1,
        delta + 1: min(E, 2),
        N: min(E, 1 + (N - 1) // delta),
        N + 1: min(E, 1 + N // delta),
        10 * N + 3: E,
    }
    for t, kt in expect.items():
        assert unlocked_blocks(t, E, N) == kt, t
        rows = K if kt == E else kt * d
        assert open_rows(t, K, E, N) == rows, t
        mask = proteus_row_mask(torch.tensor(t), K, E, N)
        assert mask.tolist() == [1.0] * rows + [0.0] * (K - rows)
    if N >= E:  # Delta * E <= N: every block is open past N
        assert open_rows(N + 1, K, E, N) == K
    assert open_rows_tensor(torch.tensor([0, -3]), K, E, N).tolist() == [0, 0]


def test_last_block_takes_the_remainder():
    K, E, N = 10, 3, 12  # d = 3: blocks rows 0-2, 3-5, 6-9
    assert [open_rows(t, K, E, N) for t in (1, 4, 5, 8, 9, 100)] == [3, 3, 6, 6, 10, 10]
    # Delta = 25: K=64, E=4, N=100 at t = 1, Delta, Delta+1, N, N+1, past N.
    assert [open_rows(t, 64, 4, 100) for t in (1, 25, 26, 100, 101, 5000)] == [
        16,
        16,
        32,
        64,
        64,
        64,
    ]


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    "fn", [memory_scan_reference, memory_scan_recurrent, memory_scan_chunk_aligned]
)
def test_locked_rows_bit_identical(fn, momentum):
    K, E, N = 12, 4, 40  # Delta = 10; rows open 3 per 10 events
    inp = make_inputs(3, 8, 2, K, 5, momentum=momentum)
    inp["pos0"] = torch.tensor([0, 9, 18])
    inp["lengths"] = torch.tensor([8, 8, 8])
    _, S, M = scan(fn, inp, n_blocks=E, horizon=N)
    for b in range(3):
        last = int(inp["pos0"][b]) + 8
        rows = open_rows(last, K, E, N)
        assert rows < K
        assert torch.equal(S[b, :, rows:], inp["S0"][b, :, rows:])
        assert not torch.equal(S[b, :, :rows], inp["S0"][b, :, :rows])
        if momentum:
            assert torch.equal(M[b, :, rows:], inp["M0"][b, :, rows:])
            assert not torch.equal(M[b, :, :rows], inp["M0"][b, :, :rows])
        else:
            assert M is inp["M0"] or torch.equal(M, inp["M0"])


@pytest.mark.parametrize("path", ["reference", "recurrent", "chunk", "chunk_aligned"])
@pytest.mark.parametrize("momentum", [True, False])
def test_one_block_is_the_unmasked_rule(momentum, path):
    inp = make_inputs(2, 6, 2, 8, 5, momentum=momentum)
    inp["lengths"] = torch.tensor([6, 6])
    fn = {"reference": memory_scan_reference, "recurrent": memory_scan_recurrent,
          "chunk": memory_scan_chunk, "chunk_aligned": memory_scan_chunk_aligned}[path]  # fmt: skip
    y, S, M = scan(fn, inp, n_blocks=1, horizon=3)
    for b in range(2):
        Sb, Mb = inp["S0"][b].clone(), inp["M0"][b].clone()
        for i in range(6):
            k = l2norm(inp["k"][b, i])
            q = l2norm(inp["q"][b, i])
            th = inp["theta"][b, i][:, None, None]
            al = inp["alpha"][b, i][:, None, None]
            grad = k[:, :, None] * (torch.einsum("hk,hkv->hv", k, Sb) - inp["v"][b, i])[:, None]
            if momentum:
                Mb = inp["eta"][b, i][:, None, None] * Mb - th * grad
                Sb = (1 - al) * Sb + Mb
            else:
                Sb = (1 - al) * Sb - th * grad
            torch.testing.assert_close(y[b, i], torch.einsum("hk,hkv->hv", q, Sb))
        torch.testing.assert_close(S[b], Sb)
        torch.testing.assert_close(M[b], Mb if momentum else inp["M0"][b])


@pytest.mark.parametrize("momentum", [True, False])
def test_step_by_step_equals_one_call(momentum):
    inp = make_inputs(5, 9, 2, 10, 4, momentum=momentum, seed=3)
    inp["pos0"] = torch.tensor([0, 3, 7, 11, 30])  # Delta = 4: crosses block boundaries
    inp["lengths"] = torch.tensor([9, 0, 1, 5, 9])
    kw = dict(n_blocks=3, horizon=12)
    y_ref, S_ref, M_ref = scan(memory_scan_reference, inp, **kw)
    y_rec, S_rec, M_rec = scan(memory_scan_recurrent, inp, **kw)
    torch.testing.assert_close(y_rec, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S_rec, S_ref, rtol=1e-12, atol=1e-12)
    y_chk, S_chk, _ = memory_scan_chunk(**inp, **kw, chunk_size=4)
    torch.testing.assert_close(y_chk, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S_chk, S_ref, rtol=1e-10, atol=1e-10)
    if momentum:
        torch.testing.assert_close(M_rec, M_ref, rtol=1e-12, atol=1e-12)
    # One event per call, carrying state and position, through the vectorised path.
    S, M, pos = inp["S0"], inp["M0"], inp["pos0"].clone()
    for i in range(9):
        one = {
            name: inp[name][:, i : i + 1] if inp[name] is not None else None
            for name in ("q", "k", "v", "theta", "eta", "alpha")
        }
        active = (inp["lengths"] > i).long()
        y1, S, M = memory_scan_recurrent(**one, S0=S, M0=M, pos0=pos, lengths=active, **kw)
        pos = pos + active
        torch.testing.assert_close(y1[:, 0], y_ref[:, i], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)
    # The reference step itself, one user.
    S1 = inp["S0"][0].clone()
    M1 = inp["M0"][0].clone() if momentum else None
    for i in range(9):
        S1, M1, _ = memory_step_reference(
            S1,
            M1,
            inp["q"][0, i],
            inp["k"][0, i],
            inp["v"][0, i],
            inp["theta"][0, i],
            None if inp["eta"] is None else inp["eta"][0, i],
            inp["alpha"][0, i],
            i + 1,
            **kw,
        )
    torch.testing.assert_close(S1, S_ref[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [memory_scan_recurrent, memory_scan_chunk_aligned])
@pytest.mark.parametrize("momentum", [True, False])
def test_padding_is_an_exact_no_op(momentum, fn):
    inp = make_inputs(4, 6, 2, 8, 3, momentum=momentum, seed=5)
    kw = dict(n_blocks=4, horizon=16)
    y, S, M = scan(fn, inp, **kw)
    longer = dict(inp)
    for name in ("q", "k", "v", "theta", "eta", "alpha"):
        if inp[name] is not None:
            x = inp[name]
            longer[name] = torch.cat([x, torch.randn_like(x[:, :4]) + 5], dim=1)
    y2, S2, M2 = scan(fn, longer, **kw)
    assert torch.equal(S2, S)
    assert torch.equal(y2[:, :6], y)
    assert not y2[:, 6:].any()
    steps = torch.arange(6)[None, :] >= inp["lengths"][:, None]
    assert not y[steps].any()
    if momentum:
        assert torch.equal(M2, M)


@pytest.mark.parametrize("path", ["recurrent", "chunk", "chunk_aligned"])
@pytest.mark.parametrize("momentum", [True, False])
def test_saved_state_continues_identically(momentum, path, tmp_path):
    inp = make_inputs(3, 10, 2, 8, 4, momentum=momentum, seed=7)
    inp["lengths"] = torch.tensor([10, 10, 10])
    kw = dict(n_blocks=4, horizon=16)
    y_all, S_all, M_all = scan(memory_scan_recurrent, inp, **kw)
    fn = {"recurrent": memory_scan_recurrent, "chunk": memory_scan_chunk,
          "chunk_aligned": memory_scan_chunk_aligned}[path]  # fmt: skip
    same = torch.equal if path == "recurrent" else torch.allclose  # chunks: other sum order
    names = ("q", "k", "v", "theta", "eta", "alpha")
    first = {n: None if inp[n] is None else inp[n][:, :4] for n in names}
    rest = {n: None if inp[n] is None else inp[n][:, 4:] for n in names}
    _, S, M = fn(
        **first, S0=inp["S0"], M0=inp["M0"], pos0=inp["pos0"],
        lengths=torch.full((3,), 4), **kw,
    )  # fmt: skip
    state_file = tmp_path / "state.pt"
    torch.save({"S": S, "M": M, "pos": inp["pos0"] + 4}, state_file)
    saved = torch.load(state_file)
    y2, S2, M2 = fn(
        **rest, S0=saved["S"], M0=saved["M"], pos0=saved["pos"],
        lengths=torch.full((3,), 6), **kw,
    )  # fmt: skip
    assert saved["pos"].tolist() == (inp["pos0"] + 4).tolist()
    assert same(S2, S_all)
    assert same(y2, y_all[:, 4:])
    if momentum:
        assert same(M2, M_all)


# ---------------------------------------------------------------- dispatch


def test_resolve_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, training=False) == "recurrent"
    assert resolve_backend("auto", cpu, training=True) == "chunk"
    assert resolve_backend("auto", cuda, training=False) == "triton"
    assert resolve_backend("auto", cuda, training=True) == "triton"  # once checked: ops
    assert resolve_backend("fla", cuda, training=False) == "fla_chunk"
    for name in ("reference", "recurrent", "chunk", "triton"):
        assert name in BACKENDS and resolve_backend(name, cpu, False) == name


def test_memory_scan_dispatches_and_rejects_unknown():
    inp = make_inputs(2, 5, 2, 8, 3, seed=11)
    kw = dict(n_blocks=2, horizon=6)
    y_ref, S_ref, _ = memory_scan(**inp, **kw, backend="reference")
    y_ch, S_ch, _ = memory_scan(**inp, **kw, training=True, chunk_size=2)
    torch.testing.assert_close(S_ch, S_ref)
    torch.testing.assert_close(y_ch, y_ref)
    with pytest.raises(ValueError, match="not available"):
        memory_scan(**inp, **kw, backend="nope")


@pytest.mark.parametrize("momentum", [True, False])
def test_in_place_inference_path_equals_the_autograd_path(momentum):
    """memory_scan_recurrent runs in place when no input needs a gradient; both branches
    compute the same function, and the in-place one leaves the caller's state untouched."""
    inp = make_inputs(7, 19, 2, 12, 5, momentum=momentum, seed=11, max_pos=30)
    kw = dict(n_blocks=3, horizon=24)
    S0, M0 = inp["S0"].clone(), inp["M0"].clone()
    y_fast, S_fast, M_fast = memory_scan_recurrent(**inp, **kw)
    assert torch.equal(inp["S0"], S0) and torch.equal(inp["M0"], M0)
    grad_inp = dict(inp, q=inp["q"].clone().requires_grad_(True))
    y_ag, S_ag, M_ag = memory_scan_recurrent(**grad_inp, **kw)
    assert y_ag.requires_grad
    torch.testing.assert_close(y_fast, y_ag.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S_fast, S_ag.detach(), rtol=1e-12, atol=1e-12)
    if momentum:
        torch.testing.assert_close(M_fast, M_ag.detach(), rtol=1e-12, atol=1e-12)
    else:
        assert torch.equal(M_fast, M0)


def _denormal_survives() -> bool:
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() != 0.0


def test_cpu_scan_flushes_denormals_without_leaking_the_flag():
    from models.memory import recurrent

    assert not recurrent._process_flushes_denormals
    torch.set_flush_denormal(False)
    assert _denormal_survives()
    inp = make_inputs(3, 5, 2, 8, 4, dtype=torch.float32, seed=13)
    memory_scan_recurrent(**inp, n_blocks=2, horizon=8)
    assert _denormal_survives()  # the caller's thread is as it was


def test_flush_denormals_opts_the_process_in():
    from models.memory import recurrent

    try:
        assert recurrent.flush_denormals()
        assert not _denormal_survives()
        inp = make_inputs(3, 5, 2, 8, 4, dtype=torch.float32, seed=14)
        memory_scan_recurrent(**inp, n_blocks=2, horizon=8)
        assert not _denormal_survives()  # an opted-in process keeps flushing
    finally:
        recurrent._process_flushes_denormals = False
        torch.set_flush_denormal(False)
