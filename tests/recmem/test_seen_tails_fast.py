"""The engine's vectorised per-user structures against their plain references, over many
random batches: the duplicate policy (SeenEvents).

Users repeat inside a batch (more events than the window included), keys repeat inside
and across batches, users are dropped and restored from exported arrays (also under
another window), and every answer, export and count must be the same, the exported
arrays byte for byte."""

import numpy as np
import pytest

from recmem.engine.dedupe import SeenEvents, SeenEventsReference


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
