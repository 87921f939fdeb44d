"""``server.frontends``: front-end processes on the public port in front of the engine
process (recmem/server/frontend.py, frontends.py), over real gRPC on 127.0.0.1 and real
processes.

The single-process answer to compare with is the engine process's own server, on its
private socket: the same ``RecMemServicer`` over the same engine that ``recmem serve``
with ``server.frontends = 0`` serves on the public port. Every test runs for each
``server.frontend_mode`` (threads, aio)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import event_pb2, rank_pb2, rank_pb2_grpc
from recmem.server.serve import RecMemService
from tests.recmem.rank_env import make_env

TIMEOUT = 20.0
MODES = ("threads", "aio")


def start_service(tmp: Path, mode: str, frontends: int = 2, token: str = "") -> RecMemService:
    env = make_env(tmp / "spill")
    env.cfg.server.frontends = frontends
    env.cfg.server.frontend_mode = mode
    env.cfg.server.metrics_port = 0
    env.cfg.server.auth_token = token
    return RecMemService(env.cfg, ingest=False, built=env.built).start()


@pytest.fixture(scope="module", params=MODES)
def svc(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RecMemService]:
    service = start_service(tmp_path_factory.mktemp("frontends"), request.param)
    yield service
    service.stop(grace=1.0)


def stub_at(address: str) -> tuple[grpc.Channel, rank_pb2_grpc.RecMemStub]:
    channel = grpc.insecure_channel(address)
    return channel, rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def public(svc: RecMemService) -> Iterator[rank_pb2_grpc.RecMemStub]:
    channel, stub = stub_at(f"127.0.0.1:{svc.port}")
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def engine(svc: RecMemService) -> Iterator[rank_pb2_grpc.RecMemStub]:
    """The engine process's server: the single-process answers."""
    assert svc.frontends is not None
    channel, stub = stub_at(svc.frontends.engine_address)
    yield stub
    channel.close()


def requests() -> list[rank_pb2.RankRequest]:
    context = [
        event_pb2.Event(item_id="item7", ts_ms=50_000_000, action=event_pb2.ACTION_CLICK),
        event_pb2.Event(item_id="item9", ts_ms=50_100_000, action=event_pb2.ACTION_CLICK),
    ]
    return [
        rank_pb2.RankRequest(user_id="user0", k=10),
        rank_pb2.RankRequest(user_id="user1", k=5, candidate_item_ids=["item3", "item4", "item8"]),
        rank_pb2.RankRequest(
            user_id="user2", k=8, replay=rank_pb2.ReplayOptions(enabled=True, notes=2)
        ),
        rank_pb2.RankRequest(user_id="user3", k=6, context=context),
        rank_pb2.RankRequest(user_id="user4", k=60),
        rank_pb2.RankRequest(user_id="nobody", k=4),
    ]


def assert_same(a: rank_pb2.RankResponse, b: rank_pb2.RankResponse) -> None:
    assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
    assert [i.score for i in a.items] == pytest.approx([i.score for i in b.items], abs=1e-5)
    fields = ("position", "cold_start", "notes_replayed", "context_applied", "model_version")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def test_rank_through_the_front_ends_is_the_single_process_answer(
    public: rank_pb2_grpc.RecMemStub, engine: rank_pb2_grpc.RecMemStub
) -> None:
    reqs = requests()
    for req in reqs:
        assert_same(public.Rank(req, timeout=TIMEOUT), engine.Rank(req, timeout=TIMEOUT))
    got = public.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), timeout=TIMEOUT)
    assert [r.code for r in got.results] == [0] * len(reqs)
    for req, res in zip(reqs, got.results):
        assert_same(res.response, engine.Rank(req, timeout=TIMEOUT))
    inspect = rank_pb2.InspectUserRequest(user_id="user2")
    assert public.InspectUser(inspect, timeout=TIMEOUT) == engine.InspectUser(
        inspect, timeout=TIMEOUT
    )
    routing = rank_pb2.RoutingRequest()
    assert public.Routing(routing, timeout=TIMEOUT) == engine.Routing(routing, timeout=TIMEOUT)


def test_a_bad_request_fails_as_in_one_process(
    svc: RecMemService, public: rank_pb2_grpc.RecMemStub, engine: rank_pb2_grpc.RecMemStub
) -> None:
    registry = svc.metrics.registry
    label = {"code": "INVALID_ARGUMENT"}
    refused_before = registry.get_sample_value("recmem_frontend_rank_requests_total", label) or 0
    bad = [
        rank_pb2.RankRequest(user_id="user1", k=0),
        rank_pb2.RankRequest(user_id="", k=3),
        rank_pb2.RankRequest(user_id="user1", k=3, candidate_item_ids=["no-such-item"]),
        rank_pb2.RankRequest(
            user_id="user1", k=3, replay=rank_pb2.ReplayOptions(enabled=True, notes=999)
        ),
    ]
    for req in bad:
        answers = []
        for stub in (public, engine):
            with pytest.raises(grpc.RpcError) as err:
                stub.Rank(req, timeout=TIMEOUT)
            answers.append((err.value.code(), err.value.details()))
        assert answers[0] == answers[1]
        assert answers[0][0] == grpc.StatusCode.INVALID_ARGUMENT
    # the front ends count what they answered, with the engine process's status
    refused = registry.get_sample_value("recmem_frontend_rank_requests_total", label)
    assert refused == refused_before + len(bad)
    too_many = rank_pb2.RankBatchRequest(requests=[requests()[0]] * 257)
    with pytest.raises(grpc.RpcError) as err:
        public.RankBatch(too_many, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "server.max_batch_requests" in (err.value.details() or "")


def test_an_undecodable_payload_is_refused_at_the_front_end(svc: RecMemService) -> None:
    name, label = "recmem_frontend_undecodable_requests_total", {"method": "/recmem.v1.RecMem/Rank"}
    before = svc.metrics.registry.get_sample_value(name, label) or 0
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        raw = ch.unary_unary("/recmem.v1.RecMem/Rank")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff", timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (err.value.details() or "")
    assert svc.metrics.registry.get_sample_value(name, label) == before + 1


def test_the_metrics_name_each_family_once(svc: RecMemService) -> None:
    """The front ends' values (summed from their files) never repeat a family of the
    engine's: Prometheus refuses a scrape with a second TYPE line for a name."""
    from prometheus_client import generate_latest

    types = [x for x in generate_latest(svc.metrics.registry).decode().splitlines()
             if x.startswith("# TYPE ")]  # fmt: skip
    assert len(types) == len(set(types))
    assert "# TYPE recmem_frontend_rank_requests_total counter" in types
    assert "# TYPE recmem_rank_requests_total counter" in types


def test_concurrent_callers_share_engine_batches(
    svc: RecMemService, engine: rank_pb2_grpc.RecMemStub
) -> None:
    reqs = requests()
    want = [engine.Rank(r, timeout=TIMEOUT) for r in reqs]
    counts = svc.built.loop.counts
    registry = svc.metrics.registry
    ok_before = registry.get_sample_value("recmem_rank_requests_total", {"code": "OK"}) or 0
    packed_before = registry.get_sample_value("recmem_rank_packed_requests_total") or 0
    front = "recmem_frontend_rank_latency_seconds_count"
    timed_before = registry.get_sample_value(front) or 0
    batches_before, requests_before = counts.batches, counts.requests
    callers, rounds = 16, 6
    failures: list[str] = []

    def caller(i: int) -> None:
        # a channel each: connections spread over the front ends by the kernel
        channel, stub = stub_at(f"127.0.0.1:{svc.port}")
        with channel:
            for r in range(rounds):
                j = (i + r) % len(reqs)
                try:
                    assert_same(stub.Rank(reqs[j], timeout=TIMEOUT), want[j])
                except (AssertionError, grpc.RpcError) as e:
                    failures.append(f"caller {i} round {r}: {e!r}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert failures == []
    n = callers * rounds
    assert counts.requests - requests_before == n
    assert counts.batches - batches_before < n  # some engine steps ranked several
    assert counts.largest_batch > 1
    ok = registry.get_sample_value("recmem_rank_requests_total", {"code": "OK"})
    assert ok == ok_before + n  # each front-end call counted in the engine's metrics
    # both front ends send them packed (server.frontend_packed)
    packed = registry.get_sample_value("recmem_rank_packed_requests_total") - packed_before
    assert packed == n
    # and timed at the front end that answered it, summed over the front-end processes
    assert registry.get_sample_value(front) == timed_before + n
    slow = registry.get_sample_value("recmem_frontend_rank_latency_seconds_bucket", {"le": "+Inf"})
    assert slow == timed_before + n


def test_health_follows_the_engine(svc: RecMemService) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)

        def wait_for(status: int) -> None:
            request = health_pb2.HealthCheckRequest(service="recmem.v1.RecMem")
            deadline = time.monotonic() + TIMEOUT
            while health.Check(request, timeout=TIMEOUT).status != status:
                assert time.monotonic() < deadline, "front-end health did not follow"
                time.sleep(0.05)

        wait_for(health_pb2.HealthCheckResponse.SERVING)
        svc.server.set_serving(False)
        try:
            wait_for(health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            svc.server.set_serving(True)
        wait_for(health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.parametrize("mode", MODES)
def test_the_bearer_token_is_checked_at_the_front_end(tmp_path: Path, mode: str) -> None:
    svc = start_service(tmp_path, mode, token="s3cret")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)  # type: ignore[no-untyped-call]
            req = rank_pb2.RankRequest(user_id="user1", k=3)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Rank(req, timeout=TIMEOUT, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.Rank(req, timeout=TIMEOUT, metadata=(("authorization", "Bearer s3cret"),))
            assert len(ok.items) == 3
            health = health_pb2_grpc.HealthStub(ch)  # open for probes
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
    finally:
        svc.stop(grace=1.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_front_end_is_replaced_and_stop_ends_them_all(tmp_path: Path, mode: str) -> None:
    svc = start_service(tmp_path, mode)
    fronts = svc.frontends
    assert fronts is not None
    address = f"127.0.0.1:{svc.port}"
    req = rank_pb2.RankRequest(user_id="user1", k=3)
    try:
        # the engine's server: a socket only this user reaches
        assert stat.S_IMODE(os.stat(fronts.run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(fronts.engine_socket).st_mode) == 0o600
        victim, survivor = fronts.pids
        os.kill(victim, signal.SIGKILL)
        # new connections go to the survivor until the replacement listens
        for _ in range(10):
            channel, stub = stub_at(address)
            with channel:
                assert len(stub.Rank(req, timeout=TIMEOUT, wait_for_ready=True).items) == 3
        deadline = time.monotonic() + 60
        while not (len(fronts.pids) == 2 and victim not in fronts.pids):
            assert time.monotonic() < deadline, "the killed front end was not restarted"
            time.sleep(0.1)
        assert survivor in fronts.pids and all(alive(p) for p in fronts.pids)
        assert len(fronts.restarts[0]) + len(fronts.restarts[1]) == 1
        channel, stub = stub_at(address)
        with channel:
            assert len(stub.Rank(req, timeout=TIMEOUT).items) == 3
    finally:
        pids, run_dir = fronts.pids, fronts.run_dir
        svc.stop(grace=1.0)
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(run_dir)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", svc.port), timeout=2).close()
