"""The engine's vectorised per-user structures against their plain references, over many
random batches: the duplicate policy (SeenEvents) and the latest events (RecentEvents).

Users repeat inside a batch (more events than the window or ``keep`` included), keys repeat
inside and across batches, users are dropped and restored from exported arrays (also
under another window or ``keep``, and without q~), and every answer, export and count must
be the same, the exported arrays byte for byte."""

import numpy as np
import pytest
import torch

from recmem.engine.dedupe import SeenEvents, SeenEventsReference
from recmem.engine.tails import RecentEvents, RecentEventsReference


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def zipf_users(rng: np.random.Generator, n: int, pool: int) -> list[str]:
    return [f"u{min(int(x), pool) - 1}" for x in rng.zipf(1.3, size=n)]


# ---- SeenEvents ----------------------------------------------------------------------


def seen_batch(rng: np.random.Generator, pool: int, n_keys: int) -> tuple[list[str], np.ndarray]:
    n = int(rng.integers(0, 40))
    users = zipf_users(rng, n, pool)
    keys = rng.integers(-n_keys, n_keys, size=n).astype(np.int64)
    if n and rng.random() < 0.3:  # one user with a long run of events in the batch
        run = int(rng.integers(1, 80))
        users += [users[0]] * run
        keys = np.concatenate([keys, rng.integers(-n_keys, n_keys, size=run)])
    return users, keys


def check_seen(fast: SeenEvents, ref: SeenEventsReference, users: list[str]) -> None:
    assert fast.dropped == ref.dropped
    assert_same_arrays(fast.export(users), ref.export(users))


@pytest.mark.parametrize("window", [1, 2, 3, 64])
@pytest.mark.parametrize("seed", range(6))
def test_seen_events_agree_with_the_reference(window: int, seed: int) -> None:
    rng = np.random.default_rng(seed * 100 + window)
    pool, n_keys = 12, int(rng.choice([3, 8, 40]))
    fast, ref = SeenEvents(window), SeenEventsReference(window)
    every = [f"u{j}" for j in range(pool)] + ["nobody"]
    for step in range(60):
        users, keys = seen_batch(rng, pool, n_keys)
        got, want = fast.keep(users, keys), ref.keep(users, keys)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), step
        check_seen(fast, ref, every)
        if step % 7 == 3:  # a partition leaves
            gone = list(rng.choice(every, size=3, replace=False))
            fast.drop(gone)
            ref.drop(gone)
        if step % 11 == 5:  # a restore, from either side's arrays, maybe under a new window
            part = list(rng.choice(every, size=5, replace=False))
            arrays = (fast if step % 2 else ref).export(part)
            w = int(rng.choice([window, 1, 5]))
            fast2, ref2 = SeenEvents(w), SeenEventsReference(w)
            for s in (fast, fast2):
                s.load(part, arrays)
            for r in (ref, ref2):
                r.load(part, arrays)
            check_seen(fast, ref, every)
            check_seen(fast2, ref2, every)
    check_seen(fast, ref, every)


def test_seen_events_a_held_key_pushed_out_by_the_batch_is_new_again() -> None:
    """The case the batch-wide rule alone gets wrong: a key the user held is pushed out of
    the window by newer events of the same batch before its copy arrives."""
    fast, ref = SeenEvents(4), SeenEventsReference(4)
    for s in (fast, ref):
        s.keep(["u"] * 4, np.array([1, 2, 3, 4]))
    users, keys = ["u", "v", "u", "u", "u"], np.array([5, 1, 6, 1, 4])
    got, want = fast.keep(users, keys), ref.keep(users, keys)
    assert want.tolist() == [0, 1, 2, 3] and got.tolist() == want.tolist()
    assert_same_arrays(fast.export(["u", "v"]), ref.export(["u", "v"]))


def test_seen_events_off_and_empty() -> None:
    off = SeenEvents(0)
    assert off.keep(["a", "a"], np.array([1, 1])).tolist() == [0, 1]
    assert off.export(["a"]) == {} and off.dropped == 0
    fast, ref = SeenEvents(3), SeenEventsReference(3)
    assert fast.keep([], np.zeros(0, np.int64)).dtype == ref.keep([], np.zeros(0, np.int64)).dtype
    assert_same_arrays(fast.export([]), ref.export([]))
    assert_same_arrays(fast.export(["x"]), ref.export(["x"]))
    with pytest.raises(ValueError, match="restored"):
        fast.load(["a", "b"], ref.export(["a"]))


# ---- RecentEvents --------------------------------------------------------------------

QSHAPE = (1, 2, 3)


def recent_step(
    rng: np.random.Generator, pool: int, keep: int, packed: bool, counter: list[int]
) -> tuple:
    B = int(rng.integers(1, 9))
    users = zipf_users(rng, B, pool)
    if rng.random() < 0.7:  # distinct users, as the engine's pieces; else repeats
        users = list(dict.fromkeys(users))
        B = len(users)
    lengths = rng.integers(0, keep + 4, size=B).astype(np.int64)
    T = max(int(lengths.max()), 1)
    items = rng.integers(0, 1000, size=(B, T)).astype(np.int64)
    actions = rng.integers(0, 3, size=(B, T)).astype(np.int64)
    ts = (counter[0] + np.arange(B * T).reshape(B, T)).astype(np.int64)
    counter[0] += B * T
    q = torch.randn(B, T, *QSHAPE)
    if packed:
        q = q[torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]]
    return users, items, actions, ts, lengths, q


def check_recent(
    fast: RecentEvents, ref: RecentEventsReference, users: list[str], keep: int
) -> None:
    for u in users:
        for n in (0, 1, keep, keep + 3):
            a, b = fast.recent(u, n), ref.recent(u, n)
            for f in ("items", "actions", "ts_ms"):
                x, y = getattr(a, f), getattr(b, f)
                assert x.dtype == y.dtype and x.tolist() == y.tolist(), (u, n, f)
            qa, qb = fast.recent_queries(u, n), ref.recent_queries(u, n)
            assert (qa is None) == (qb is None), (u, n)
            if qa is not None and qb is not None:
                assert qa.dtype == qb.dtype and qa.shape == qb.shape
                assert qa.tobytes() == qb.tobytes(), (u, n)
    check_recent_many(fast, ref, users + users[::-2], keep)
    assert_same_arrays(fast.export(users), ref.export(users))
    # every event slot in use belongs to one held event: none leaks on drops and restores
    rows = list(fast._rows.of.values())
    assert fast._pool.used == int(fast._rows.arrays["count"][rows].sum())


def check_recent_many(
    fast: RecentEvents, ref: RecentEventsReference, users: list[str], keep: int
) -> None:
    """The batched reads (users repeated, unknown, without q~, in the plain form) return,
    user by user, what the per-user reads return, in the fast form and the reference."""
    for n in (0, 1, keep, keep + 3):
        for tails in (fast, ref):
            got, got_q = tails.recent_many(users, n), tails.recent_queries_many(users, n)
            assert len(got) == len(got_q) == len(users)
            for u, a, qa in zip(users, got, got_q, strict=True):
                b, qb = tails.recent(u, n), tails.recent_queries(u, n)
                for f in ("items", "actions", "ts_ms"):
                    x, y = getattr(a, f), getattr(b, f)
                    assert x.dtype == y.dtype and x.tolist() == y.tolist(), (u, n, f)
                assert (qa is None) == (qb is None), (u, n)
                if qa is not None and qb is not None:
                    assert qa.dtype == qb.dtype and qa.shape == qb.shape
                    assert qa.tobytes() == qb.tobytes(), (u, n)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("keep", [1, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_recent_events_agree_with_the_reference(packed: bool, keep: int, seed: int) -> None:
    rng = np.random.default_rng(seed * 10 + keep)
    torch.manual_seed(seed)
    pool, counter = 10, [0]
    fast, ref = RecentEvents(keep), RecentEventsReference(keep)
    every = [f"u{j}" for j in range(pool)] + ["nobody"]
    for step in range(50):
        users, items, actions, ts, lengths, q = recent_step(rng, pool, keep, packed, counter)
        fast.observe(users, items, actions, ts, lengths, q, packed=packed)
        ref.observe(users, items, actions, ts, lengths, q, packed=packed)
        check_recent(fast, ref, every, keep)
        if step % 7 == 3:
            gone = list(rng.choice(every, size=3, replace=False))
            fast.drop(gone)
            ref.drop(gone)
        if step % 9 == 4:  # a restore, maybe written under another keep, maybe without q~
            part = list(rng.choice(every, size=5, replace=False))
            other = RecentEventsReference(int(rng.choice([1, keep, keep + 4])))
            for _ in range(3):
                u2, it2, ac2, ts2, len2, q2 = recent_step(rng, pool, keep, False, counter)
                other.observe(u2, it2, ac2, ts2, len2, q2)
            arrays = other.export(part)
            if rng.random() < 0.3:
                arrays.pop("recent.queries", None)
            fast.load(part, arrays)
            ref.load(part, arrays)
            check_recent(fast, ref, every, keep)
    check_recent(fast, ref, every, keep)


def test_recent_events_edge_cases() -> None:
    fast, ref = RecentEvents(2), RecentEventsReference(2)
    check_recent(fast, ref, ["x"], 2)
    z = np.zeros((1, 1), np.int64)
    for s in (fast, ref):  # no events at all: nothing changes
        s.observe(["a"], z, z, z, np.zeros(1, np.int64), torch.zeros(1, 1, *QSHAPE))
    check_recent(fast, ref, ["a"], 2)
    with pytest.raises(ValueError, match="users restored"):
        fast.load(["a", "b"], ref.export(["a"]))
    with pytest.raises(ValueError, match="do not match"):
        arrays = {"recent.lengths": np.array([1]), "recent.queries": np.zeros((2, *QSHAPE))}
        fast.load(["a"], arrays)
