"""A front-end process of ``server.frontends`` (docs/serving.md, "Front-end processes").

``recmem serve`` with ``server.frontends = N`` keeps the engine loop, ingest and the full
``RecMemServicer`` in its own process, bound to a private unix socket only, and runs N of
these processes (recmem/server/frontends.py starts and supervises them). Each binds the
public ``server.host:port`` with SO_REUSEPORT (the kernel spreads connections over them) and
serves the public API with the same server construction as the single process
(``GrpcServer``: TLS, bearer token, message size limit, undecodable payloads, health,
reflection), so the per-call gRPC and protobuf work runs in N processes:

- ``Rank``: concurrent calls are collected (``RankBatcher``: what queued while earlier
  batches were in flight, plus the micro-batch window, adaptive as in the engine loop) and
  sent to the engine process as one ``RankBatch``; each caller gets its own result, a
  failed one as the status, message and trailing metadata (``recmem-owner``,
  ``grpc-retry-pushback-ms``, ``recmem-partition``, ``recmem-generation``) Rank would have
  answered. So batches grow with load.
- ``RankBatch``, ``InspectUser``, ``Routing``: passed through as they are.
- Health mirrors the engine process's (NOT_SERVING until it is ready, and from its stop).

A call forwarded by another instance (``recmem-forwarded`` metadata) keeps that metadata on
its way to the engine process, so it is never forwarded again.

Run as ``python -m recmem.server.frontend``: the first line of stdin is the JSON spec (the
``[server]`` section, the engine's address, the port, the log level); the process prints
``ready`` once it listens, and stops (draining, within the grace given) on the stdin line
``stop <grace_s>`` or at end of file (the service is gone). Imports no torch and no engine.

This module is the ``server.frontend_mode = "threads"`` front end (a sync ``grpc.server``,
a handler thread per call, a batching thread); ``"aio"`` runs the same front end on one
asyncio event loop (recmem/server/frontend_aio.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.client import GENERATION, OWNER, PARTITION, RETRY_PUSHBACK
from recmem.config import Config, ServerConfig
from recmem.queries import RankQuery
from recmem.server import packed
from recmem.server.app import GrpcServer
from recmem.server.metrics import LATENCY_BUCKETS
from recmem.server.packed import EngineDescription
from recmem.server.routing import FORWARDED
from recmem.server.validation import InvalidRequest, to_queries

log = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Batches one front end keeps in flight to the engine process by default
(``server.frontend_in_flight``); Rank calls arriving meanwhile queue up for the next batch."""


def frontend_window_ms(s: ServerConfig) -> float:
    """A front end's batching window (``server.frontend_window_ms``; negative: the engine
    loop's ``server.batch_window_ms``)."""
    return float(s.batch_window_ms if s.frontend_window_ms < 0 else s.frontend_window_ms)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class _Call:
    request: rank_pb2.RankRequest
    forwarded: str
    """The caller's ``recmem-forwarded`` value ('' when not forwarded)."""
    deadline: float
    """monotonic seconds"""
    result: Future[rank_pb2.RankBatchResult]


class BatchWindow:
    """The collection rule of both batchers (``RankBatcher``, ``AioRankBatcher``): a batch
    holds at most ``max_requests``; it waits at most ``window_ms`` for more and, with
    ``adaptive``, only under concurrency (the previous batch held more than one request or
    more are queued), and has enough once it holds the previous batch's size plus what
    queued while that was sent."""

    def __init__(
        self, max_requests: int, window_ms: float, adaptive: bool, in_flight: int = IN_FLIGHT
    ) -> None:
        self.max = max_requests
        self.in_flight = in_flight
        """Batches a batcher keeps in flight at once."""
        self._window_s = window_ms / 1000.0
        self._adaptive = adaptive
        self._last_size = 1
        self._expected = 1

    @classmethod
    def from_config(cls, s: ServerConfig) -> BatchWindow:
        """A front end's rule from ``[server]``: ``max_batch_requests``, the window
        (``frontend_window_ms``), ``adaptive_window``, ``frontend_in_flight``."""
        return cls(s.max_batch_requests, frontend_window_ms(s), s.adaptive_window,
                   s.frontend_in_flight)  # fmt: skip

    def open(self, queued: bool) -> tuple[float, int]:
        """(monotonic deadline, requests that are enough) for a batch starting now, with
        ``queued``: more requests waiting."""
        wait, enough = self._window_s, self.max
        if self._adaptive:
            if self._last_size <= 1 and not queued:
                wait = 0.0
            enough = min(self._expected, self.max)
        return time.monotonic() + wait, enough

    def close(self, size: int, queued: int) -> None:
        """A batch of ``size`` is sent, ``queued`` requests waiting behind it."""
        self._last_size = size
        self._expected = max(1, size + queued)


class RankBatcher:
    """Collects Rank requests into RankBatch calls on ``stub`` (the engine process's).

    A batch (``window``, a ``BatchWindow``) takes the first request queued, waits until fewer
    than ``window.in_flight`` batches are in flight, then takes whatever has queued
    meanwhile, up to ``window.max`` (``server.max_batch_requests``, the most one RankBatch
    may hold). It then waits at most the window for more, and when adaptive (as the engine
    loop's micro-batches) only under concurrency, closing as soon as it holds as many
    requests as the previous batch plus those queued while that was sent."""

    def __init__(self, stub: Any, window: BatchWindow, packed: PackedClient | None = None) -> None:
        self._stub = stub
        self._packed = packed
        self._window = window
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._in_flight = threading.Semaphore(window.in_flight)
        self.batches = 0
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name="rank-batcher", daemon=True)
        self._thread.start()

    def submit(
        self, request: rank_pb2.RankRequest, forwarded: str, deadline: float
    ) -> Future[rank_pb2.RankBatchResult]:
        call = _Call(request, forwarded, deadline, Future())
        self._queue.put(call)
        return call.result

    def close(self) -> None:
        """Send what is queued, then end the batching thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            self._in_flight.acquire()
            batch, closing = self._collect(first)
            self._send(batch)
            if closing:
                return

    def _collect(self, first: _Call) -> tuple[list[_Call], bool]:
        batch = [first]
        deadline, enough = self._window.open(not self._queue.empty())
        closing = False
        while len(batch) < self._window.max:
            remaining = deadline - time.monotonic() if len(batch) < enough else 0.0
            try:
                call = (
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if call is None:
                closing = True
                break
            batch.append(call)
        self._window.close(len(batch), self._queue.qsize())
        return batch, closing

    def _send(self, batch: list[_Call]) -> None:
        live = [c for c in batch if c.result.set_running_or_notify_cancel()]
        groups: dict[str, list[_Call]] = {}
        for c in live:
            groups.setdefault(c.forwarded, []).append(c)
        jobs = [(calls, self._rank_batch(forwarded, calls)) for forwarded, calls in groups.items()]
        described = self._packed.ready() if self._packed is not None and "" in groups else None
        if described is not None:
            jobs = [j for j in jobs if j[0] is not groups[""]]
            good, bad = split_valid(groups[""], described)
            if bad:  # the engine process answers (and counts) them as RankBatch does
                jobs.append((bad, self._rank_batch("", bad)))
            if good:
                jobs.append(([c for c, _ in good], self._rank_packed(good, described)))
        if not jobs:
            self._in_flight.release()
            return
        self.batches += 1
        self.requests += len(live)
        left = [len(jobs)]
        lock = threading.Lock()

        def finished() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self._in_flight.release()

        def done(calls: list[_Call], answers: _Answers, fut: grpc.Future) -> None:
            try:
                results = answers(fut.result())
                if len(results) != len(calls):
                    raise RuntimeError(f"{len(results)} results for {len(calls)} requests")
                for c, r in zip(calls, results):
                    c.result.set_result(r)
            except BaseException as e:  # noqa: BLE001 - each caller answers with it
                for c in calls:
                    c.result.set_exception(e)
            finally:
                finished()

        now = time.monotonic()
        for calls, (start, answers) in jobs:
            timeout = max(max(c.deadline for c in calls) - now, 0.001)
            try:
                fut = start(timeout)
            except BaseException as e:  # noqa: BLE001 - e.g. the channel closed: callers get it
                for c in calls:
                    c.result.set_exception(e)
                finished()
                continue
            fut.add_done_callback(lambda f, calls=calls, answers=answers: done(calls, answers, f))

    def _rank_batch(self, forwarded: str, calls: list[_Call]) -> tuple[_Start, _Answers]:
        """How ``calls`` go to the engine process as one RankBatch, and its answers."""
        metadata = ((FORWARDED, forwarded),) if forwarded else ()
        request = rank_pb2.RankBatchRequest(requests=[c.request for c in calls])

        def start(timeout: float) -> grpc.Future:
            return self._stub.RankBatch.future(request, timeout=timeout, metadata=metadata)

        return start, lambda response: list(response.results)

    def _rank_packed(
        self, good: list[tuple[_Call, RankQuery]], described: EngineDescription
    ) -> tuple[_Start, _Answers]:
        """How validated calls go to the engine process packed, and its answers as the
        RankBatchResults RankBatch would have given."""
        assert self._packed is not None
        request = packed.pack_queries([q for _, q in good])
        rank = self._packed.rank

        def start(timeout: float) -> grpc.Future:
            return rank.future(request, timeout=timeout)

        def answers(response: bytes) -> list[rank_pb2.RankBatchResult]:
            return packed.unpack_results(
                response, len(good), described.vocab.item_ids, described.model_version
            )

        return start, answers


class _Requested(Protocol):
    request: rank_pb2.RankRequest


C = TypeVar("C", bound=_Requested)


def split_valid(
    calls: Sequence[C], described: EngineDescription
) -> tuple[list[tuple[C, RankQuery]], list[C]]:
    """Of queued ``calls`` (the threads' or the aio batcher's), those whose requests pass
    the engine's own checks (``validation.to_queries`` against its vocabulary and limits),
    with their queries, and the others (which go as RankBatch: the engine answers and
    counts them)."""
    good: list[tuple[C, RankQuery]] = []
    bad: list[C] = []
    queries = to_queries([c.request for c in calls], described.vocab, described.limits)
    for c, q in zip(calls, queries, strict=True):
        if isinstance(q, InvalidRequest):
            bad.append(c)
        else:
            good.append((c, q))
    return good, bad


_Start = Callable[[float], grpc.Future]
"""Starts a call to the engine process with a timeout (seconds)."""
_Answers = Callable[[Any], Sequence[rank_pb2.RankBatchResult]]
"""Turns the engine process's answer into one RankBatchResult per call, in order."""


class PackedClient:
    """A front end's side of the packed path (recmem/server/packed.py, ``server.frontend_packed``):
    the engine process's description, asked for on first use and again at most every
    ``RETRY_S`` while it cannot be had. An engine that does not offer the path (an
    instance that routes calls, or one without the methods) is not asked again: RankBatch
    serves every call."""

    RETRY_S = 1.0

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        self._describe = channel.unary_unary(packed.DESCRIBE)
        self.rank = channel.unary_unary(packed.RANK)
        self.description: EngineDescription | None = None
        self.off = False
        self._asked_at = -math.inf

    def ready(self) -> EngineDescription | None:
        """The description, or None where the packed path is not (yet) to be used."""
        if not self._due():
            return self.description
        try:
            return self._took(EngineDescription.parse(self._describe(b"", timeout=2.0)))
        except grpc.RpcError as e:
            self._failed(e)
            return None

    def _due(self) -> bool:
        """Whether to ask the engine process now (nothing known, the last ask long enough
        ago); notes the time when so."""
        if self.description is not None or self.off:
            return False
        now = time.monotonic()
        if now - self._asked_at < self.RETRY_S:
            return False
        self._asked_at = now
        return True

    def _took(self, described: EngineDescription) -> EngineDescription | None:
        if not described.packed:
            self.off = True
            log.info("the engine process routes calls; RankBatch serves every call")
            return None
        self.description = described
        return described

    def _failed(self, e: grpc.RpcError) -> None:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
            self.off = True
            log.info("the engine process has no packed path; RankBatch serves every call")
        else:
            log.warning("the engine process's description failed (RankBatch meanwhile): %s", e)


def status_code(code: int) -> grpc.StatusCode:
    """The status of a RankBatchResult's ``code``."""
    return _CODES.get(code, grpc.StatusCode.UNKNOWN)


def failure_trailing(res: rank_pb2.RankBatchResult) -> tuple[tuple[str, str], ...]:
    """The trailing metadata Rank answers a failed RankBatchResult with."""
    trailing: list[tuple[str, str]] = []
    if res.owner:
        trailing.append((OWNER, res.owner))
    if res.retry_pushback_ms:
        trailing.append((RETRY_PUSHBACK, str(res.retry_pushback_ms)))
    if res.HasField("partition"):
        trailing.append((PARTITION, str(res.partition)))
    if res.HasField("generation"):
        trailing.append((GENERATION, str(res.generation)))
    return tuple(trailing)


def channel_options() -> list[tuple[str, int]]:
    """Options of a front end's channel to the engine process: no message size limit (a
    RankBatch answer holds many responses), no retries (the caller's client retries)."""
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.enable_retries", 0),
    ]


def _abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    trailing: tuple[tuple[str, str], ...] = (),
) -> NoReturn:
    if trailing:
        context.set_trailing_metadata(trailing)
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # it raises


def _abort_as(context: grpc.ServicerContext, e: BaseException) -> NoReturn:
    """Answer the caller as the engine process answered this front end."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None  # type: ignore[attr-defined]
        md = tuple((m.key, m.value) for m in trailing or ())
        _abort(context, e.code(), e.details() or "", md)  # type: ignore[attr-defined]
    log.error("call to the engine process failed: %r", e)
    _abort(context, grpc.StatusCode.INTERNAL, "rank failed; see the server log")


class FrontEndMetrics:
    """What a front end measures itself: each Rank call's time as its caller sees it (less
    the network), and its status. In the process's default registry, which under
    ``PROMETHEUS_MULTIPROC_DIR`` (set by the service, recmem/server/frontends.py) writes to
    files the service's metrics endpoint sums over every front end."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.latency = Histogram(
            "recmem_frontend_rank_latency_seconds",
            "Rank call time at the front ends (batching, the engine process's answer)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "recmem_frontend_rank_requests",
            "Rank calls answered by the front ends, by gRPC status code",
            ["code"],
            registry=registry,
        )
        self.undecodable = Counter(
            "recmem_frontend_undecodable_requests",
            "Calls whose payload did not parse at the front ends (answered INVALID_ARGUMENT), "
            "by method",
            ["method"],
            registry=registry,
        )

    def count_undecodable(self, method: str) -> None:
        self.undecodable.labels(method=method).inc()


class FrontEndServicer(rank_pb2_grpc.RecMemServicer):
    """The public RecMem API of a front end, over the engine process's ``channel``."""

    def __init__(
        self, channel: grpc.Channel, cfg: Config, metrics: FrontEndMetrics | None = None
    ) -> None:
        self._metrics = metrics
        s = cfg.server
        self._stub = rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]
        self._timeout_s = s.request_timeout_s
        self.batcher = RankBatcher(
            self._stub,
            BatchWindow.from_config(s),
            packed=PackedClient(channel) if s.frontend_packed else None,
        )

    def _timeout(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        return max(self._timeout_s if remaining is None else min(remaining, self._timeout_s), 0)

    @staticmethod
    def _forwarded(context: grpc.ServicerContext) -> str:
        return next((v for k, v in (context.invocation_metadata() or ()) if k == FORWARDED), "")

    def Rank(
        self, request: rank_pb2.RankRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankResponse:
        if self._metrics is None:
            return self._rank(request, context)
        start = time.perf_counter()
        code = "OK"
        try:
            return self._rank(request, context)
        except BaseException:
            status = context.code()  # set by context.abort
            code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            self._metrics.latency.observe(time.perf_counter() - start)
            self._metrics.requests.labels(code=code).inc()

    def _rank(
        self, request: rank_pb2.RankRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankResponse:
        timeout = self._timeout(context)
        fut = self.batcher.submit(request, self._forwarded(context), time.monotonic() + timeout)
        try:
            res = fut.result(timeout=timeout)
        except FutureTimeout:
            fut.cancel()
            _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "rank did not finish in time")
        except BaseException as e:  # noqa: BLE001 - the engine process's answer, passed on
            _abort_as(context, e)
        if res.code == 0:
            return res.response
        _abort(context, status_code(res.code), res.message, failure_trailing(res))

    def _pass(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        forwarded = self._forwarded(context)
        remaining = context.time_remaining()
        try:
            return getattr(self._stub, method)(
                request,
                timeout=self._timeout_s + 1.0 if remaining is None else max(remaining, 0.001),
                metadata=((FORWARDED, forwarded),) if forwarded else (),
            )
        except grpc.RpcError as e:
            _abort_as(context, e)

    def RankBatch(
        self, request: rank_pb2.RankBatchRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankBatchResponse:
        return self._pass("RankBatch", request, context)  # type: ignore[no-any-return]

    def InspectUser(
        self, request: rank_pb2.InspectUserRequest, context: grpc.ServicerContext
    ) -> rank_pb2.InspectUserResponse:
        return self._pass("InspectUser", request, context)  # type: ignore[no-any-return]

    def Routing(
        self, request: rank_pb2.RoutingRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RoutingResponse:
        return self._pass("Routing", request, context)  # type: ignore[no-any-return]


class FrontEnd:
    """A front end: the public server over a channel to the engine process at ``engine``
    (a gRPC address), on ``port`` of ``server.host`` shared with the other front ends."""

    def __init__(self, cfg: Config, engine: str, port: int) -> None:
        self.channel = grpc.insecure_channel(engine, options=channel_options())
        metrics = FrontEndMetrics() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        self.servicer = FrontEndServicer(self.channel, cfg, metrics)
        self.server = GrpcServer(
            cfg,
            self.servicer,
            port=port,
            reuse_port=True,
            undecodable=metrics.count_undecodable if metrics is not None else None,
        )
        self._watch: Any = None
        self._stopping = threading.Event()
        self._mirror = threading.Thread(target=self._mirror_health, name="health", daemon=True)

    def start(self) -> FrontEnd:
        self.server.start(ready=False)
        self._mirror.start()
        return self

    def _mirror_health(self) -> None:
        """Report what the engine process reports (its service ``""``), NOT_SERVING while
        it cannot be reached."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        while not self._stopping.is_set():
            try:
                self._watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                for status in self._watch:
                    self.server.set_serving(status.status == serving)
            except grpc.RpcError:
                pass
            self.server.set_serving(False)
            self._stopping.wait(0.2)

    def stop(self, grace: float) -> None:
        """Drain this front end's callers (GrpcServer.stop), send what is still queued, close
        the channel."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.cancel()
        self.server.stop(grace)
        self.servicer.batcher.close()
        self.channel.close()


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    logging.basicConfig(
        level=spec.get("log_level", logging.INFO),
        format=f"%(asctime)s %(levelname)s frontend {spec['index']} %(name)s: %(message)s",
    )
    # the service stops its front ends itself (stdin); a terminal's Ctrl-C reaches the
    # whole process group, and a front end must not quit before the service drains it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = Config.from_dict({"server": spec["server"]})
    if cfg.server.frontend_mode == "aio":
        import asyncio

        from recmem.server.frontend_aio import serve

        metrics = FrontEndMetrics() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        asyncio.run(serve(cfg, spec, metrics))
        return 0
    front = FrontEnd(cfg, spec["engine"], int(spec["port"])).start()
    stop = threading.Event()
    grace = [cfg.server.shutdown_grace_s]

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)

    def read_stop() -> None:
        line = sys.stdin.readline()  # "stop <grace_s>", or "" once the service is gone
        parts = line.split()
        grace[0] = float(parts[1]) if len(parts) == 2 and parts[0] == "stop" else 1.0
        stop.set()

    threading.Thread(target=read_stop, name="stdin", daemon=True).start()
    print(f"ready {os.getpid()}", flush=True)
    while not stop.wait(0.5):
        pass
    front.stop(grace[0])
    log.info(
        "front end %d stopped: %d Rank calls in %d RankBatch calls",
        spec["index"],
        front.servicer.batcher.requests,
        front.servicer.batcher.batches,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
