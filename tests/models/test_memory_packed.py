"""The packed scan (CPU ingest: ``advance_packed``) equals the reference on the padded
batch, with users of every length, across Proteus unlocks; and ``advance_packed`` equals
``advance``."""

from __future__ import annotations

import pytest
import torch

from models.config import MemoryConfig, ModelConfig
from models.memory.chunk_aligned import aligned_chunk_size
from models.memory.naive import memory_scan_reference
from models.memory.packed import (
    PACKED_CHUNK_MIN_EVENTS,
    memory_scan_packed,
    packed_groups,
    padded_groups,
)
from models.recommender import MemoryRecommender
from tests.models.test_memory import make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)


def pack(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Right-padded [B, T, ...] -> [N, ...], the valid events user by user."""
    T = x.shape[1]
    return x[torch.arange(T)[None, :] < lengths[:, None]]


@pytest.mark.parametrize("padded", [None, "recurrent", "chunk"])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize(
    "K, E, N, chunk", [(8, 4, 64, 16), (10, 3, 30, 16), (8, 4, 8, 16), (8, 2, 40, 6)]
)
def test_packed_scan_equals_the_reference(momentum, K, E, N, chunk, padded, monkeypatch):
    B, T, H, V = 9, 45, 2, 5
    inp = make_inputs(B, T, H, K, V, momentum=momentum, max_pos=3 * N)
    # every kind of user: none, 1-3 events (recurrent), a few, a chunk, many
    inp["lengths"] = torch.tensor([45, 0, 1, 3, 4, 16, 17, 2, 31])
    inp["theta"][0, 5] = 0.0  # gates at 0 and 1
    inp["alpha"][6, 2] = 1.0
    kw = dict(n_blocks=E, horizon=N, qk_l2norm=True)
    y_ref, S_ref, M_ref = memory_scan_reference(**inp, **kw)
    lengths = inp["lengths"]
    packed = {n: pack(inp[n], lengths) for n in ("q", "k", "v", "theta", "alpha")}
    packed["eta"] = None if inp["eta"] is None else pack(inp["eta"], lengths)
    # the padded-scan path (the GPU's) in small groups, so that the users split across them
    monkeypatch.setattr("models.memory.packed.PADDED_SCAN_CELLS", 64)
    y, S, M = memory_scan_packed(
        **packed, S0=inp["S0"], M0=inp["M0"], pos0=inp["pos0"], lengths=lengths,
        chunk_size=chunk, padded_backend=padded, **kw,
    )  # fmt: skip
    torch.testing.assert_close(y, pack(y_ref, lengths), **TIGHT)
    torch.testing.assert_close(S, S_ref, **TIGHT)
    if momentum:
        torch.testing.assert_close(M, M_ref, **TIGHT)
    assert torch.equal(S[1], inp["S0"][1])  # no events: the state keeps its bits
    for name in ("q", "S0"):
        assert inp[name].data_ptr() != S.data_ptr()


def test_padded_groups_run_longest_first_within_the_cell_cap():
    lengths = torch.tensor([3, 0, 40, 1, 16, 16, 2])
    groups = [g.tolist() for g in padded_groups(lengths, cells=48)]
    assert groups == [[2], [4, 5, 0], [6, 3]]  # 48 // 40 = 1 row, 48 // 16 = 3, 48 // 2
    assert padded_groups(torch.zeros(3, dtype=torch.int64)) == []
    assert [g.tolist() for g in padded_groups(torch.tensor([90, 2]), cells=8)] == [[0], [1]]


def test_groups_split_short_users_off_and_need_a_wide_chunk():
    lengths = torch.tensor([40, 16, 4, 3, 1, 0])
    groups = dict(packed_groups(lengths, aligned_chunk_size(16, 16, 256)))
    assert groups["chunk_aligned"].tolist() == [0, 1, 2]
    assert groups["recurrent"].tolist() == [3, 4]
    assert PACKED_CHUNK_MIN_EVENTS == 4
    ones = dict(packed_groups(torch.ones(50, dtype=torch.int64), 16))
    assert list(ones) == ["recurrent"]  # one event each: one step, no chunks of 16 slots
    narrow = dict(packed_groups(lengths, 2))  # aligned chunk too narrow: all recurrent
    assert list(narrow) == ["recurrent"] and len(narrow["recurrent"]) == 5


def batch_of(m: MemoryRecommender, lengths: torch.Tensor, n_items: int):  # type: ignore[no-untyped-def]
    """Right-padded events of users of ``lengths`` and a state with random S, M and
    positions (on the CPU, in the model's dtype)."""
    B, T = len(lengths), int(lengths.max())
    items = torch.randint(0, n_items, (B, T))
    actions = torch.randint(0, 3, (B, T))
    ts = 10**12 + torch.cumsum(torch.randint(0, 10**7, (B, T)), 1)
    state = m.init_state(B, "cpu")
    state.pos = torch.randint(0, 90, (B,))
    state.S.normal_()
    assert state.M is not None
    state.M.normal_()
    state.last_ts = ts[:, 0] - 5
    return items, actions, ts, state


def assert_packed_equals_padded(b, a, lengths: torch.Tensor, **tol: float) -> None:  # type: ignore[no-untyped-def]
    """``advance_packed``'s result ``b`` (any device) against ``advance``'s ``a``: states,
    outputs and (k~, q~), within ``tol``."""
    assert a.kq is not None and b.kq is not None
    for name, x in b.state.to_fields().items():
        want = a.state.to_fields()[name]
        if x is None or not x.is_floating_point():
            assert (x is None and want is None) or torch.equal(x.cpu(), want), name
        else:
            torch.testing.assert_close(x.cpu().to(want.dtype), want, **tol)
    for got, want in ((b.outputs, a.outputs), *zip(b.kq, a.kq, strict=True)):
        torch.testing.assert_close(got.cpu().to(want.dtype), pack(want, lengths), **tol)


@pytest.mark.parametrize("hybrid", ["none", "mac"])
def test_advance_packed_equals_advance(hybrid):
    torch.manual_seed(0)
    mem = MemoryConfig(key_dim=8, value_dim=8, n_blocks=4, horizon=32)
    model_cfg = ModelConfig(embed_dim=16, hybrid=hybrid, window=6)
    m = MemoryRecommender(30, 4, mem, model_cfg).double().eval()
    lengths = torch.tensor([70, 40, 33, 17, 16, 9, 5, 4, 3, 2, 1, 1])
    items, actions, ts, state = batch_of(m, lengths, 34)
    assert m.packs
    with torch.no_grad():
        a = m.advance(items, actions, ts, lengths, state, return_kq=True)
        b = m.advance_packed(items, actions, ts, lengths, state, return_kq=True)
    assert_packed_equals_padded(b, a, lengths, **TIGHT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_advance_packed_on_cuda_equals_advance_in_double_on_the_cpu():
    """The GPU's packed step (fp32) against the padded step in double on the CPU: the
    states, outputs and (k~, q~) within fp32 rounding, for users of every length."""
    torch.manual_seed(0)
    mem = MemoryConfig(key_dim=16, value_dim=16, n_blocks=4, horizon=32)
    m = MemoryRecommender(300, 4, mem, ModelConfig(embed_dim=32)).eval()
    lengths = torch.tensor([90, 40, 33, 17, 16, 9, 5, 4, 3, 2, 1, 1, 0, 1])
    items, actions, ts, state = batch_of(m, lengths, 304)
    dev = torch.device("cuda")
    gpu = MemoryRecommender(300, 4, mem, ModelConfig(embed_dim=32)).eval()
    gpu.load_state_dict(m.state_dict())
    gpu.to(dev)
    m.double()
    with torch.no_grad():
        a = m.advance(
            items, actions, ts, lengths,
            state.map(lambda t: t.double() if t.is_floating_point() else t), return_kq=True,
        )  # fmt: skip
        b = gpu.advance_packed(
            items.to(dev), actions.to(dev), ts.to(dev), lengths.to(dev), state.to(dev),
            return_kq=True,
        )  # fmt: skip
    assert_packed_equals_padded(b, a, lengths, rtol=2e-4, atol=2e-4)


def test_advance_packed_needs_the_uniform_prefix_schedule():
    m = MemoryRecommender(
        10, 2, MemoryConfig(key_dim=8, value_dim=8, unlock="surprise"), ModelConfig(embed_dim=16)
    )
    assert not m.packs
    m2 = MemoryRecommender(
        10, 2, MemoryConfig(key_dim=8, value_dim=8, backend="recurrent"), ModelConfig(embed_dim=16)
    )
    assert not m2.packs
    with pytest.raises(ValueError, match="uniform schedule"):
        m.advance_packed(
            torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), m.init_state(1, "cpu"),
        )  # fmt: skip
