"""The front end's batcher against a real gRPC server on loopback whose RankBatch handler
holds its calls until released: how many batches it keeps in flight
(``server.frontend_in_flight``) and that calls arriving meanwhile go out together."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.config import Config
from recmem.server.frontend import BatchWindow, RankBatcher, frontend_window_ms

TIMEOUT = 10.0


class HoldingEngine(rank_pb2_grpc.RecMemServicer):
    """Answers each RankBatch (one empty result per request) once ``release`` is set,
    recording the batch sizes and the most calls it held at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sizes: list[int] = []
        self.held = 0
        self.most_held = 0
        self._lock = threading.Lock()

    def RankBatch(self, request: Any, context: Any) -> rank_pb2.RankBatchResponse:
        with self._lock:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            self.sizes.append(len(request.requests))
        self.release.wait(TIMEOUT)
        with self._lock:
            self.held -= 1
        return rank_pb2.RankBatchResponse(
            results=[rank_pb2.RankBatchResult() for _ in request.requests]
        )


@pytest.fixture
def engine() -> Iterator[tuple[HoldingEngine, grpc.Channel]]:
    servicer = HoldingEngine()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    rank_pb2_grpc.add_RecMemServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    servicer.release.set()
    channel.close()
    server.stop(0)


def wait_until(cond: Any, what: str) -> None:
    end = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("in_flight", [1, 3])
def test_at_most_in_flight_batches_then_the_rest_together(
    engine: tuple[HoldingEngine, grpc.Channel], in_flight: int
) -> None:
    servicer, channel = engine
    stub = rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]
    batcher = RankBatcher(stub, BatchWindow(256, 0.0, True, in_flight=in_flight))
    try:
        deadline = time.monotonic() + TIMEOUT
        first = []
        for i in range(in_flight):  # one at a time: each goes out as a batch of its own
            first.append(batcher.submit(rank_pb2.RankRequest(user_id=f"u{i}"), "", deadline))
            wait_until(lambda i=i: len(servicer.sizes) == i + 1, f"batch {i + 1} to arrive")
        # every slot is taken: these queue at the front end and leave together
        later = [
            batcher.submit(rank_pb2.RankRequest(user_id=f"v{i}"), "", deadline) for i in range(5)
        ]
        time.sleep(0.2)
        assert servicer.sizes == [1] * in_flight
        assert servicer.most_held == in_flight
        servicer.release.set()
        for f in first + later:
            assert f.result(TIMEOUT) == rank_pb2.RankBatchResult()
        assert servicer.sizes == [1] * in_flight + [5]
        assert servicer.most_held == in_flight
    finally:
        batcher.close()


def test_the_front_end_window_defaults_to_the_engine_loops() -> None:
    s = Config().server
    assert s.frontend_window_ms < 0
    assert frontend_window_ms(s) == s.batch_window_ms
    s.frontend_window_ms = 0.0
    assert frontend_window_ms(s) == 0.0
    s.frontend_window_ms = 1.5
    s.frontend_in_flight = 3
    assert frontend_window_ms(s) == 1.5
    window = BatchWindow.from_config(s)
    assert (window.max, window.in_flight) == (s.max_batch_requests, 3)
