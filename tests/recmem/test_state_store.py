import numpy as np
import pytest
import torch

from recmem.state_store import StateLayout, UserStateStore, state_from_numpy, state_to_numpy

LAYOUT = StateLayout(n_layers=2, n_heads=2, key_dim=4, value_dim=3, momentum=True, embed_dim=5)


def random_state(layout, n, gen):
    st = layout.zeros(n)
    st.S.copy_(torch.randn(st.S.shape, generator=gen))
    if st.M is not None:
        st.M.copy_(torch.randn(st.M.shape, generator=gen))
    st.pos.copy_(torch.randint(0, 1000, (n,), generator=gen))
    st.last_ts.copy_(torch.randint(0, 10**12, (n,), generator=gen))
    st.h.copy_(torch.randn(st.h.shape, generator=gen))
    return st


def assert_state_equal(a, b):
    assert torch.equal(a.S, b.S)
    assert (a.M is None) == (b.M is None)
    if a.M is not None:
        assert torch.equal(a.M, b.M)
    assert torch.equal(a.pos, b.pos)
    assert torch.equal(a.last_ts, b.last_ts)
    assert torch.equal(a.h, b.h)


@pytest.mark.parametrize("momentum", [True, False])
def test_random_access_bit_exact_through_every_tier(tmp_path, momentum):
    layout = StateLayout(2, 2, 4, 3, momentum, 5)
    store = UserStateStore(layout, capacity=4, host_capacity=3, spill_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    truth = {}
    seen_tiers = set()
    for _ in range(200):
        users = [f"u{i}" for i in rng.choice(20, size=rng.integers(1, 5), replace=False)]
        state, slots = store.gather(users)
        for j, u in enumerate(users):
            if u in truth:
                assert_state_equal(state.index(slice(j, j + 1)), truth[u])
            else:
                assert_state_equal(state.index(slice(j, j + 1)), layout.zeros(1))
        new = random_state(layout, len(users), gen)
        store.scatter(slots, new)
        for j, u in enumerate(users):
            truth[u] = new.index(slice(j, j + 1)).clone()
        seen_tiers |= {t for t, n in store.tier_counts().items() if n}
        # read() sees every tier and changes nothing
        some = list(truth)[::3]
        got = store.read(some)
        for j, u in enumerate(some):
            assert_state_equal(got.index(slice(j, j + 1)), truth[u])
        # read_into: the same rows, written at an offset of an uninitialised buffer
        buf = layout.empty(len(some) + 2)
        store.read_into(some, buf, 1)
        assert_state_equal(buf.index(slice(1, 1 + len(some))), got)
        # read_resident: the same copies, only when every user is on the slab
        fast = store.read_resident(some)
        on_slab = [u in store._slot_of for u in some]
        if all(on_slab):
            assert fast is not None
            assert_state_equal(fast, got)
            fast.S.add_(1.0)  # a copy: the live state does not move
            assert_state_equal(store.read(some), got)
        else:
            assert fast is None
    assert seen_tiers == {"device", "host", "disk"}
    assert set(store.users()) == set(truth)
    assert len(store) == len(truth)
    counts = store.tier_counts()
    assert counts["device"] == 4 and counts["host"] == 3 and counts["disk"] == len(truth) - 7
    store.close()


def test_gather_limits_and_distinct(tmp_path):
    store = UserStateStore(LAYOUT, capacity=2, host_capacity=0, spill_dir=tmp_path)
    with pytest.raises(ValueError, match="exceed the slab capacity"):
        store.gather(["a", "b", "c"])
    with pytest.raises(ValueError, match="distinct"):
        store.gather(["a", "a"])


def test_put_drop_and_read_unknown(tmp_path):
    store = UserStateStore(LAYOUT, capacity=2, host_capacity=1, spill_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    users = [f"u{i}" for i in range(7)]
    st = random_state(LAYOUT, 7, gen)
    store.put(users, st)
    assert_state_equal(store.read(users), st)
    assert store.drop(["u0", "u3", "u6", "nobody"]) == 3
    assert "u0" not in store and "u1" in store
    assert sum(store.tier_counts().values()) == 4
    with pytest.raises(KeyError):
        store.read(["u0"])
    # a dropped user comes back as a new (zero) user
    again, _ = store.gather(["u0"])
    assert_state_equal(again, LAYOUT.zeros(1))


def test_numpy_round_trip_and_size_checks():
    gen = torch.Generator().manual_seed(2)
    st = random_state(LAYOUT, 3, gen)
    arrays = state_to_numpy(st)
    assert_state_equal(state_from_numpy(arrays, LAYOUT), st)
    arrays["S"] = arrays["S"][:-4]
    with pytest.raises(ValueError, match="bytes, layout expects"):
        state_from_numpy(arrays, LAYOUT)


def test_bytes_per_user_and_stale_spills(tmp_path):
    assert LAYOUT.bytes_per_user() == 2 * (2 * 2 * 4 * 3 * 4) + 5 * 4 + 16
    stale = tmp_path / "store-999999999-abc"
    stale.mkdir()
    store = UserStateStore(LAYOUT, capacity=1, host_capacity=0, spill_dir=tmp_path)
    assert not stale.exists()
    store.gather(["a"])
    store.gather(["b"])
    assert store.tier_counts() == {"device": 1, "host": 0, "disk": 1}
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_slab_grows_on_demand_and_keeps_states(tmp_path):
    from recmem.state_store import INITIAL_SLAB_ROWS

    store = UserStateStore(
        LAYOUT, capacity=3 * INITIAL_SLAB_ROWS, host_capacity=0, spill_dir=tmp_path
    )
    assert store.allocated == INITIAL_SLAB_ROWS  # a large capacity is not allocated up front
    gen = torch.Generator().manual_seed(1)
    first = [f"a{i}" for i in range(INITIAL_SLAB_ROWS - 10)]
    state, slots = store.gather(first)
    written = random_state(LAYOUT, len(first), gen)
    store.scatter(slots, written)
    more = [f"b{i}" for i in range(INITIAL_SLAB_ROWS)]
    store.gather(more)  # needs more rows than are free: the slab grows, nobody is evicted
    assert store.allocated == 2 * INITIAL_SLAB_ROWS
    assert store.tier_counts() == {"device": 2 * INITIAL_SLAB_ROWS - 10, "host": 0, "disk": 0}
    again, _ = store.gather(first)
    assert_state_equal(again, written)
    store.gather([f"c{i}" for i in range(2 * INITIAL_SLAB_ROWS)])
    assert store.allocated == 3 * INITIAL_SLAB_ROWS  # capped at capacity
