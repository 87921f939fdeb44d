"""EngineSources.snapshot (Engine.snapshot under the lock: one gather for slab-resident
users, else a host copy) on users in every tier, with repeats and unknown users: equal
copies, and private ones."""

from __future__ import annotations

import gc

import pytest
import torch

from recmem.server.app import settle_heap
from tests.recmem.rank_env import RankEnv, make_env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


@pytest.mark.parametrize(
    "users",
    [
        ["user0", "user5", "user4"],  # all on the slab: one gather
        ["user0", "user5", "user3"],  # slab and host tiers (4 slab slots for 6 users)
        ["user2", "user2", "user4"],  # the same user twice in one micro-batch
        ["user1", "nobody", "user0"],  # an unknown user: zeros, position 0
    ],
)
def test_snapshot_equals_the_engines_copy(env: RankEnv, users: list[str]) -> None:
    got = env.stack.sources.snapshot(users)
    want = env.stack.engine.snapshot(users)
    for name in ("S", "M", "pos", "last_ts", "h"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    got.S.add_(1.0)  # a private copy: the live state is not touched
    again = env.stack.engine.snapshot(users)
    assert torch.equal(again.S, want.S)


def test_settle_heap_freezes_the_survivors() -> None:
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
