"""Payloads that do not parse (raw bytes, invalid UTF-8 in a string field) get
INVALID_ARGUMENT with a message, over real gRPC on 127.0.0.1, and cost at most one log line
however many arrive (issue 11, defect 3: they got INTERNAL and a traceback each)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest

from proto.recmem.v1 import rank_pb2
from recmem.server import RankServer
from tests.recmem.rank_env import RankEnv, loop_server, make_env

RANK = "/recmem.v1.RecMem/Rank"
INSPECT = "/recmem.v1.RecMem/InspectUser"
BAD_UTF8 = b"\x0a\x02\xc3\x28\x10\x05"  # user_id = b"\xc3\x28" (not UTF-8), k = 5


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"), n_users=2)


@pytest.fixture
def server(env: RankEnv) -> Iterator[RankServer]:
    srv = loop_server(env).start()
    yield srv
    srv.stop(grace=0.5)


def call_raw(port: int, method: str, payload: bytes) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        raw = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return bytes(raw(payload, timeout=10))
        except grpc.RpcError as e:
            return e


@pytest.mark.parametrize(
    "method, payload",
    [(RANK, b"\xff\xff\xff"), (RANK, BAD_UTF8), (INSPECT, b"\x0a\x02\xff\xfe"), (RANK, b"\x0b")],
)
def test_an_undecodable_payload_is_invalid_argument(server, method, payload) -> None:
    err = call_raw(server.port, method, payload)
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "the request payload does not parse" in err.details()


def test_a_flood_of_bad_payloads_logs_one_line(server, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            err = call_raw(server.port, RANK, BAD_UTF8)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        good = call_raw(
            server.port, RANK, rank_pb2.RankRequest(user_id="user0", k=2).SerializeToString()
        )
    assert len(rank_pb2.RankResponse.FromString(good).items) == 2  # the server is fine
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].getMessage().startswith("1 undecodable request(s)")
    assert not any("Exception deserializing" in r.getMessage() for r in caplog.records)
    counted = server.metrics.undecodable.labels(method=RANK)._value.get()
    assert counted == 20
