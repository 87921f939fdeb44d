"""Ranker.prepare (the read-ahead of tails and routed notes in the gRPC handler thread):
used only while the user's counter stays put, and the answers equal the plain ones."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from recmem.ranking import RankQuery, RankResult
from streams.validate import ValidEvent
from tests.recmem.rank_env import EVENTS_PER_USER, RankEnv, make_env, user_events


@pytest.fixture
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


def same(a: RankResult, b: RankResult) -> bool:
    """Equal answers (scores to float tolerance: multi-threaded MKL sums may differ in the
    last bits from one call to the next, as in tests/recmem/test_ranking.py)."""
    return (
        a.items.tolist() == b.items.tolist()
        and np.allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)
        and (a.position, a.cold_start, a.notes_replayed, a.context_applied)
        == (b.position, b.cold_start, b.notes_replayed, b.context_applied)
    )


def test_prepared_batch_answers_equal_the_plain_ones(env: RankEnv) -> None:
    rng = np.random.default_rng(4)
    queries = [
        RankQuery("user0", k=5, replay_notes=2),
        RankQuery("user1", k=3, candidates=np.array([4, 9, 17, 33], np.int64), replay_notes=4),
        RankQuery("user2", k=4),
        RankQuery("user3", k=4, replay_notes=2, context=user_events(rng, 3, t0=10**12)),
        RankQuery("stranger", k=5, replay_notes=2),
        RankQuery("user5", k=6, replay_notes=3),
    ]
    ranker = env.stack.ranker
    prepared = [ranker.prepare(q) for q in queries]
    # read ahead only for replay without context; user5 is in the host tier
    assert [p.prefetched is not None for p in prepared] == [1, 1, 0, 0, 1, 1]
    assert prepared[0].prefetched is not None and prepared[0].prefetched.notes
    plain, ahead = ranker.rank(queries), ranker.rank(prepared)
    assert all(same(a, b) for a, b in zip(plain, ahead))
    assert plain[0].notes_replayed == 2 and plain[1].notes_replayed == 4


def test_read_ahead_is_used_while_current_and_dropped_once_stale(env: RankEnv) -> None:
    ranker = env.stack.ranker
    q = RankQuery("user0", k=5, replay_notes=2)
    p = ranker.prepare(q)
    assert p.prefetched is not None
    # proof that a current read-ahead is what rank uses: tampered notes show through
    tampered = replace(p, prefetched=replace(p.prefetched, notes=()))
    (res,) = ranker.rank([tampered])
    assert res.notes_replayed == 0
    # a new engine step for the user moves the counter: rank reads tail and notes again
    h = user_events(np.random.default_rng(9), 1, t0=int(env.history["user0"].ts_ms[-1]) + 1)
    event = ValidEvent("user0", f"item{h.items[0]}", int(h.ts_ms[0]), int(h.actions[0]), 1.0,
                       None, 0, 999)  # fmt: skip
    with env.stack.lock:
        env.stack.engine.apply([event])
    (stale,) = ranker.rank([tampered])
    (fresh,) = ranker.rank([q])
    assert stale.notes_replayed == 2 and same(stale, fresh)
    assert fresh.position == EVENTS_PER_USER + 1
    assert env.stack.sources.recent_events("user0", 1).ts_ms.tolist() == h.ts_ms.tolist()


def test_counters_move_on_every_change(env: RankEnv) -> None:
    recent = env.stack.recent
    users = ["user0", "user1"]
    v0 = recent.versions([*users, "nobody"])
    assert v0[2] == -1 and min(v0[:2]) > 0
    exported = recent.export_notes(users)
    recent.import_notes(users, exported)
    v1 = recent.versions(users)
    assert all(b > a for a, b in zip(v0, v1))
    recent.drop(["user1"])
    v2 = recent.versions(users)
    assert v2[0] == v1[0] and v2[1] > v1[1]
