"""RankServer over real gRPC on 127.0.0.1: with server.read_ahead the replay answers equal
those without it (the Ranker routes as requests are dequeued instead of in the batch)."""

from __future__ import annotations

import grpc
import pytest

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from tests.recmem.rank_env import RankEnv, make_env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


def answers(env: RankEnv, read_ahead: bool) -> list[tuple[list[str], int]]:
    env.cfg.server.read_ahead = read_ahead
    try:
        srv = env.stack.server(env.cfg).start()
    finally:
        env.cfg.server.read_ahead = False
    try:
        assert (srv.batcher._prepare is not None) == read_ahead
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            out = []
            for user in ("user0", "user3", "user5", "stranger"):
                req = rank_pb2.RankRequest(
                    user_id=user, k=5, replay=rank_pb2.ReplayOptions(enabled=True, notes=2)
                )
                res = stub.Rank(req, timeout=20)
                out.append(([i.item_id for i in res.items], res.notes_replayed))
            return out
    finally:
        srv.stop(grace=1.0)


def test_read_ahead_gives_the_same_answers(env: RankEnv) -> None:
    plain, ahead = answers(env, False), answers(env, True)
    assert plain == ahead
    assert plain[0][1] == 2 and plain[3][1] == 0  # replayed notes; none for a stranger
