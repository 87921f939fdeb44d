"""A stop drains (issue 11, defect 4): health turns NOT_SERVING first, the server goes on
answering during the grace period, and calls in flight at stop or SIGTERM complete OK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import event_pb2, rank_pb2, rank_pb2_grpc
from recmem.ranking import RankQuery, RankResult
from recmem.server import RankServer
from streams.broker import free_port
from tests.recmem.rank_env import RankEnv, loop_server, make_env

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"), n_users=2)


class SlowRanker:
    """The real Ranker, each micro-batch taking ``delay_s`` longer: calls stay in flight."""

    def __init__(self, env: RankEnv, delay_s: float) -> None:
        self.inner, self.delay_s = env.ranker, delay_s
        self.n_items = self.inner.n_items

    def rank(self, queries: Sequence[RankQuery]) -> list[RankResult]:
        time.sleep(self.delay_s)
        return self.inner.rank(queries)


def slow_server(env: RankEnv, delay_s: float) -> RankServer:
    return loop_server(env, ranker=SlowRanker(env, delay_s)).start()


def health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_not_serving_comes_first_and_calls_are_answered_meanwhile(env: RankEnv) -> None:
    srv = slow_server(env, 0.0)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = rank_pb2_grpc.RecMemStub(ch)
        req = rank_pb2.RankRequest(user_id="user0", k=2)
        assert len(stub.Rank(req, timeout=5).items) == 2
        stopper = threading.Thread(target=srv.stop, kwargs={"grace": 5.0})
        began = time.monotonic()
        stopper.start()
        wait_for(lambda: health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        for _ in range(3):  # a client that has not looked at health yet is still answered
            assert len(stub.Rank(req, timeout=5).items) == 2
        stopper.join(timeout=10)
        took = time.monotonic() - began
        assert 0.5 <= took < 4.0  # closed once no call arrived for 0.5 s, not after 5 s
        with pytest.raises(grpc.RpcError):
            stub.Rank(req, timeout=2)


def test_calls_in_flight_at_stop_complete_ok(env: RankEnv) -> None:
    srv = slow_server(env, 0.3)
    results: list[str] = []
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = rank_pb2_grpc.RecMemStub(ch)

        def call() -> None:
            try:
                stub.Rank(rank_pb2.RankRequest(user_id="user1", k=2), timeout=10)
                results.append("OK")
            except grpc.RpcError as e:
                results.append(e.code().name)

        clients = [threading.Thread(target=call) for _ in range(8)]
        for c in clients:
            c.start()
        time.sleep(0.1)  # the calls are queued or in the slow batch
        srv.stop(grace=5.0)
        for c in clients:
            c.join(timeout=10)
    assert results == ["OK"] * 8


def test_sigterm_drains_the_calls_of_clients_that_watch_health(tmp_path: Path) -> None:
    """``recmem serve``: clients stop sending once they see NOT_SERVING; every call they
    sent completes OK, and the process exits 0."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "recmem.cli", "serve", "--no-ingest", "--init-model",
        "--set", f"server.port={port}", "--set", "server.metrics_port=0",
        "--set", f"server.model_dir={tmp_path / 'model'}",
        "--set", f"state.spill_dir={tmp_path / 'spill'}",
    ]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ.copy(), stdout=log, stderr=log)
    codes: list[str] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            wait_for(lambda: health(ch) == health_pb2.HealthCheckResponse.SERVING, 60)
            stub = rank_pb2_grpc.RecMemStub(ch)
            unhealthy = threading.Event()

            def watch() -> None:
                stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                for reply in stream:
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        unhealthy.set()
                        return

            context = [
                event_pb2.Event(item_id=f"i{j}", ts_ms=1_700_000_000_000 + j) for j in range(32)
            ]
            request = rank_pb2.RankRequest(user_id="u", k=5, context=context)

            def client() -> None:
                while not unhealthy.is_set():
                    try:
                        stub.Rank(request, timeout=20)
                        codes.append("OK")
                    except grpc.RpcError as e:
                        codes.append(e.code().name)

            threads = [threading.Thread(target=watch, daemon=True)]
            threads += [threading.Thread(target=client) for _ in range(8)]
            for t in threads:
                t.start()
            wait_for(lambda: len(codes) >= 50, 60)
            proc.send_signal(signal.SIGTERM)
            for t in threads[1:]:
                t.join(timeout=30)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    failed = [c for c in codes if c != "OK"]
    assert not failed, f"{len(failed)} of {len(codes)} calls failed: {sorted(set(failed))}"
