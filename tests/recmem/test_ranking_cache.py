"""The replay cache (server.replay_cache_users): a kept user vector answers a replay
request only while the user's counter and position are unchanged, the answer equals a
fresh replay, and nothing is kept from a snapshot an engine step may have overtaken."""

from __future__ import annotations

import numpy as np
import pytest

from recmem.ranking import Ranker, RankQuery, RankResult
from recmem.server.sources import EngineSources
from streams.validate import ValidEvent
from tests.recmem.rank_env import RankEnv, make_env


@pytest.fixture
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


def ranker(env: RankEnv, cache: int, sources: object | None = None) -> Ranker:
    return Ranker(
        env.model, sources or env.stack.sources, env.popularity,
        env.cfg.server.replay_query_events, replay_cache=cache,
    )  # fmt: skip


def same(a: RankResult, b: RankResult) -> bool:
    return (
        a.items.tolist() == b.items.tolist()
        and np.allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)
        and (a.position, a.notes_replayed) == (b.position, b.notes_replayed)
    )


def new_event(env: RankEnv, user: str, i: int) -> None:
    ts = int(env.history[user].ts_ms[-1]) + 60_000 * (i + 1)
    env.stack.engine.apply([ValidEvent(user, f"item{i}", ts, 1, 1.0, None, 0, 1000 + i)])


def test_a_kept_vector_answers_until_the_user_changes(env: RankEnv) -> None:
    cached, fresh = ranker(env, 16), ranker(env, 0)
    batch = [RankQuery("user0", k=5, replay_notes=2), RankQuery("user1", k=4, replay_notes=3)]
    first = cached.rank(batch)
    assert cached.cache_counts == {"hits": 0, "stored": 2}
    second = cached.rank(batch)
    assert cached.cache_counts == {"hits": 2, "stored": 2}
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


def test_the_cache_holds_at_most_its_size(env: RankEnv) -> None:
    cached = ranker(env, 2)
    for user in ("user0", "user1", "user2"):
        cached.rank([RankQuery(user, k=3, replay_notes=2)])
    assert len(cached._replayed) == 2
    cached.rank([RankQuery("user0", k=3, replay_notes=2)])  # the oldest was dropped
    assert cached.cache_counts["hits"] == 0


class StepDuringSnapshot(EngineSources):
    """The real sources, with a real engine step landing just before the snapshot (after
    the rank step read the users' counters): the race the counter check guards."""

    def __init__(self, env: RankEnv) -> None:
        s = env.stack.sources
        super().__init__(s.engine, s.bank, s.recent, s.lock)
        self.env = env
        self.steps = 0

    def snapshot(self, user_ids):  # type: ignore[no-untyped-def]
        new_event(self.env, "user0", 10 + self.steps)
        self.steps += 1
        return super().snapshot(user_ids)


def test_nothing_is_kept_from_a_snapshot_a_step_overtook(env: RankEnv) -> None:
    cached = ranker(env, 16, StepDuringSnapshot(env))
    res = cached.rank([RankQuery("user0", k=5, replay_notes=2)])
    assert cached.cache_counts == {"hits": 0, "stored": 0}
    assert same(res[0], ranker(env, 0).rank([RankQuery("user0", k=5, replay_notes=2)])[0])
