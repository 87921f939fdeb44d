"""The replay cache (server.replay_cache_users): a kept user vector answers a replay request
until the engine changes the user (events applied, partition restored or dropped), and the
answer equals a fresh replay."""

from __future__ import annotations

import numpy as np
import pytest

from recmem.ranking import Ranker, RankQuery, RankResult, ReplayCache
from streams.validate import ValidEvent
from tests.recmem.rank_env import RankEnv, make_env


@pytest.fixture
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


def ranker(env: RankEnv, cache: int) -> Ranker:
    env.engine.replay_cache = ReplayCache(cache)  # the engine forgets what it changes
    return Ranker(
        env.model, env.engine, env.popularity, env.cfg.server.replay_query_events,
        replay_cache=env.engine.replay_cache,
    )  # fmt: skip


def same(a: RankResult, b: RankResult) -> bool:
    return (
        a.items.tolist() == b.items.tolist()
        and np.allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)
        and (a.position, a.notes_replayed) == (b.position, b.notes_replayed)
    )


def new_event(env: RankEnv, user: str, i: int) -> None:
    ts = int(env.history[user].ts_ms[-1]) + 60_000 * (i + 1)
    env.engine.apply([ValidEvent(user, f"item{i}", ts, 1, 1.0, None, 0, 1000 + i)])


def test_a_kept_vector_answers_until_the_user_changes(env: RankEnv) -> None:
    fresh = Ranker(env.model, env.engine, env.popularity, env.cfg.server.replay_query_events)
    cached = ranker(env, 16)
    batch = [RankQuery("user0", k=5, replay_notes=2), RankQuery("user1", k=4, replay_notes=3)]
    first = cached.rank(batch)
    assert cached.cache_counts == {"hits": 0, "stored": 2}
    second = cached.rank(batch)
    assert cached.cache_counts == {"hits": 2, "stored": 2}
    assert all(r.from_cache for r in second)
    for a, b, c in zip(first, second, fresh.rank(batch), strict=True):
        assert same(a, b) and same(b, c) and b.notes_replayed == a.notes_replayed > 0
    # another R is another entry; context requests never use the cache
    other = [RankQuery("user0", k=5, replay_notes=4)]
    assert same(cached.rank(other)[0], fresh.rank(other)[0])
    assert cached.cache_counts["hits"] == 2
    ctx = [RankQuery("user0", k=5, replay_notes=2, context=env.history["user1"])]
    cached.rank(ctx)
    assert cached.cache_counts == {"hits": 2, "stored": 3}

    new_event(env, "user0", 0)
    after = cached.rank(batch)
    assert cached.cache_counts["hits"] == 3  # user1 still kept, user0 replayed again
    assert after[0].position == first[0].position + 1
    for a, c in zip(after, fresh.rank(batch), strict=True):
        assert same(a, c)
    # a dropped (revoked) partition forgets its users' entries too
    env.engine.drop_partition(0)
    assert len(env.engine.replay_cache) == 0


def test_the_cache_holds_at_most_its_size(env: RankEnv) -> None:
    cached = ranker(env, 2)
    for user in ("user0", "user1", "user2"):
        cached.rank([RankQuery(user, k=3, replay_notes=2)])
    assert len(env.engine.replay_cache) == 2
    cached.rank([RankQuery("user0", k=3, replay_notes=2)])  # the oldest was dropped
    assert cached.cache_counts["hits"] == 0
