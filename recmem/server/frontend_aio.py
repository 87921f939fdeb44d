"""The asyncio front end of ``server.frontend_mode = "aio"`` (docs/serving.md, "Front-end
processes"): the front end of recmem/server/frontend.py on ``grpc.aio``.

The threads front end wakes a handler thread per Rank call, which hands the request to the
batching thread and waits on a future the gRPC callback thread completes: three thread
hand-offs per call, each a GIL transfer. Here one event loop thread does all of it: each
Rank call is a coroutine that puts its request on the batcher's queue and awaits its own
future; the batcher (``AioRankBatcher``, an asyncio task) collects the calls as
``RankBatcher`` does (the same rule, ``server.frontend_in_flight`` batches at most) and awaits
the engine process's packed call (``server.frontend_packed``) or ``RankBatch`` on a ``grpc.aio``
channel, answering each caller's future. What a
caller sees is what the threads front end answers: the same server construction
(``AioGrpcServer``: TLS, bearer token, message size limit, undecodable payloads, health,
reflection, the drain), the same statuses, messages and trailing metadata, deadlines,
metrics and passthrough of RankBatch, InspectUser and Routing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.config import Config
from recmem.queries import RankQuery
from recmem.server import packed
from recmem.server.app import AioGrpcServer
from recmem.server.frontend import (
    BatchWindow,
    FrontEndMetrics,
    PackedClient,
    channel_options,
    failure_trailing,
    split_valid,
    status_code,
)
from recmem.server.packed import EngineDescription
from recmem.server.routing import FORWARDED

log = logging.getLogger(__name__)


class _Expired(Exception):
    """A caller's deadline passed before its batch answered."""


@dataclass
class _Call:
    request: rank_pb2.RankRequest
    forwarded: str
    deadline: float
    """monotonic seconds"""
    result: asyncio.Future[rank_pb2.RankBatchResult]


class AioRankBatcher:
    """``RankBatcher`` (recmem/server/frontend.py) as an asyncio task on the running loop:
    the same collection rule (``window``: first queued call, at most ``window.in_flight``
    batches in flight, what queued meanwhile up to ``window.max``, the window, the adaptive
    close), one call per ``recmem-forwarded`` value, awaited on the aio ``stub``: with
    ``packed`` (``server.frontend_packed``) the valid requests of a call not forwarded go
    packed as ``RankBatcher`` sends them, the rest as a RankBatch. A call whose
    future is done before its batch is sent (its deadline passed, its caller went away) is
    left out."""

    def __init__(self, stub: Any, window: BatchWindow, packed: AioPackedClient | None = None):
        self._stub = stub
        self._packed = packed
        self._window = window
        self._queue: collections.deque[_Call | None] = collections.deque()
        self._wake = asyncio.Event()
        self._in_flight = asyncio.Semaphore(window.in_flight)
        self._sending: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.requests = 0
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rank-batcher")

    def submit(
        self, request: rank_pb2.RankRequest, forwarded: str, deadline: float
    ) -> asyncio.Future[rank_pb2.RankBatchResult]:
        call = _Call(request, forwarded, deadline, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        self._wake.set()
        return call.result

    async def close(self) -> None:
        """Send what is queued, wait for the batches in flight, end the batching task."""
        self._queue.append(None)
        self._wake.set()
        await self._task
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    async def _next(self, timeout: float | None) -> _Call | None | bool:
        """The next queued item, or False when none came within ``timeout`` (None: wait)."""
        if not self._queue:
            if timeout is not None and timeout <= 0:
                return False
            end = None if timeout is None else time.monotonic() + timeout
            while not self._queue:
                self._wake.clear()
                if end is None:
                    await self._wake.wait()
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    return False
        return self._queue.popleft()

    async def _run(self) -> None:
        while True:
            first = await self._next(None)
            if first is None:
                return
            assert isinstance(first, _Call)
            await self._in_flight.acquire()
            batch, closing = await self._collect(first)
            self._send(batch)
            if closing:
                return

    async def _collect(self, first: _Call) -> tuple[list[_Call], bool]:
        batch = [first]
        deadline, enough = self._window.open(bool(self._queue))
        closing = False
        while len(batch) < self._window.max:
            remaining = deadline - time.monotonic() if len(batch) < enough else 0.0
            call = await self._next(remaining)
            if call is False:
                break
            if call is None:
                closing = True
                break
            assert isinstance(call, _Call)
            batch.append(call)
        self._window.close(len(batch), len(self._queue))
        return batch, closing

    def _send(self, batch: list[_Call]) -> None:
        groups: dict[str, list[_Call]] = {}
        for c in batch:
            if not c.result.done():
                groups.setdefault(c.forwarded, []).append(c)
        if not groups:
            self._in_flight.release()
            return
        self.batches += 1
        self.requests += sum(len(g) for g in groups.values())
        left = [len(groups)]
        now = time.monotonic()
        for forwarded, calls in groups.items():
            timeout = max(max(c.deadline for c in calls) - now, 0.001)
            task = asyncio.get_running_loop().create_task(
                self._send_group(calls, forwarded, timeout, left)
            )
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_group(
        self, calls: list[_Call], forwarded: str, timeout: float, left: list[int]
    ) -> None:
        """One group's calls to the engine process: packed where the engine offers it (the
        requests that validate; the others, and forwarded ones, as RankBatch), each call
        answered; the batch's in-flight slot freed after its last group."""
        try:
            client = None if forwarded else self._packed
            described = None if client is None else await client.ready_async()
            if described is None:
                await self._answer(calls, self._via_rank_batch(calls, forwarded, timeout))
                return
            good, bad = split_valid(calls, described)
            jobs = []
            if good:
                sent = self._via_packed([q for _, q in good], described, timeout)
                jobs.append(self._answer([c for c, _ in good], sent))
            if bad:
                jobs.append(self._answer(bad, self._via_rank_batch(bad, "", timeout)))
            await asyncio.gather(*jobs)
        finally:
            left[0] -= 1
            if left[0] == 0:
                self._in_flight.release()

    @staticmethod
    async def _answer(
        calls: list[_Call], results: Coroutine[Any, Any, list[rank_pb2.RankBatchResult]]
    ) -> None:
        """Each call's result from the awaited ``results`` (one per call), or its failure."""
        try:
            got = await results
            if len(got) != len(calls):
                raise RuntimeError(f"{len(got)} results for {len(calls)} requests")
            for c, r in zip(calls, got):
                if not c.result.done():
                    c.result.set_result(r)
        except BaseException as e:  # noqa: BLE001 - each caller answers with it
            for c in calls:
                if not c.result.done():
                    c.result.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _via_rank_batch(
        self, calls: list[_Call], forwarded: str, timeout: float
    ) -> list[rank_pb2.RankBatchResult]:
        metadata = ((FORWARDED, forwarded),) if forwarded else ()
        request = rank_pb2.RankBatchRequest(requests=[c.request for c in calls])
        response = await self._stub.RankBatch(request, timeout=timeout, metadata=metadata)
        return list(response.results)

    async def _via_packed(
        self, queries: list[RankQuery], described: EngineDescription, timeout: float
    ) -> list[rank_pb2.RankBatchResult]:
        assert self._packed is not None
        data = await self._packed.rank(packed.pack_queries(queries), timeout=timeout)
        return packed.unpack_results(
            data, len(queries), described.vocab.item_ids, described.model_version
        )


class AioPackedClient(PackedClient):
    """``PackedClient`` on a ``grpc.aio`` channel: ``ready_async`` awaits the description
    (the same rule: asked on first use, again at most every ``RETRY_S``, not again once
    the engine process does not offer the path)."""

    async def ready_async(self) -> EngineDescription | None:
        if not self._due():
            return self.description
        try:
            return self._took(EngineDescription.parse(await self._describe(b"", timeout=2.0)))
        except grpc.aio.AioRpcError as e:
            self._failed(e)
            return None


class _Refused(Exception):
    """What a Rank call is answered with instead of a response."""

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


def _refusal_of(e: BaseException) -> _Refused:
    """The answer for a failed call to the engine process: its status, message and trailing
    metadata, else INTERNAL (logged)."""
    if isinstance(e, grpc.aio.AioRpcError):
        md = tuple((str(k), str(v)) for k, v in e.trailing_metadata() or ())
        return _Refused(e.code(), e.details() or "", md)
    log.error("call to the engine process failed: %r", e)
    return _Refused(grpc.StatusCode.INTERNAL, "rank failed; see the server log")


class AioFrontEndServicer(rank_pb2_grpc.RecMemServicer):
    """``FrontEndServicer`` with coroutine methods, over the engine process's aio
    ``channel``. Build it inside the running event loop."""

    def __init__(
        self, channel: grpc.aio.Channel, cfg: Config, metrics: FrontEndMetrics | None = None
    ) -> None:
        self._metrics = metrics
        s = cfg.server
        self._stub = rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]
        self._timeout_s = s.request_timeout_s
        self.batcher = AioRankBatcher(
            self._stub,
            BatchWindow.from_config(s),
            packed=AioPackedClient(channel) if s.frontend_packed else None,
        )

    @staticmethod
    def _forwarded(context: grpc.aio.ServicerContext[Any, Any]) -> str:
        return next((v for k, v in (context.invocation_metadata() or ()) if k == FORWARDED), "")

    async def Rank(  # type: ignore[override]
        self, request: rank_pb2.RankRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rank_pb2.RankResponse:
        start = time.perf_counter()
        code = "OK"
        try:
            return await self._rank(request, context)
        except _Refused as f:
            code = f.code.name
            await context.abort(f.code, f.message, f.trailing)
            raise  # abort raises
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if self._metrics is not None:
                self._metrics.latency.observe(time.perf_counter() - start)
                self._metrics.requests.labels(code=code).inc()

    async def _rank(
        self, request: rank_pb2.RankRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rank_pb2.RankResponse:
        remaining = context.time_remaining()
        timeout = max(self._timeout_s if remaining is None else min(remaining, self._timeout_s), 0)
        fut = self.batcher.submit(request, self._forwarded(context), time.monotonic() + timeout)
        timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
        try:
            res = await fut
        except _Expired:
            raise _Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED, "rank did not finish in time"
            ) from None
        except Exception as e:  # noqa: BLE001 - the engine process's answer, passed on
            raise _refusal_of(e) from None
        finally:
            timer.cancel()
        if res.code == 0:
            return res.response
        raise _Refused(status_code(res.code), res.message, failure_trailing(res))

    async def _pass(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        forwarded = self._forwarded(context)
        remaining = context.time_remaining()
        try:
            return await getattr(self._stub, method)(
                request,
                timeout=self._timeout_s + 1.0 if remaining is None else max(remaining, 0.001),
                metadata=((FORWARDED, forwarded),) if forwarded else (),
            )
        except grpc.aio.AioRpcError as e:
            f = _refusal_of(e)
            await context.abort(f.code, f.message, f.trailing)

    async def RankBatch(  # type: ignore[override]
        self, request: rank_pb2.RankBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rank_pb2.RankBatchResponse:
        return await self._pass("RankBatch", request, context)  # type: ignore[no-any-return]

    async def InspectUser(  # type: ignore[override]
        self, request: rank_pb2.InspectUserRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rank_pb2.InspectUserResponse:
        return await self._pass("InspectUser", request, context)  # type: ignore[no-any-return]

    async def Routing(  # type: ignore[override]
        self, request: rank_pb2.RoutingRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rank_pb2.RoutingResponse:
        return await self._pass("Routing", request, context)  # type: ignore[no-any-return]


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class AioFrontEnd:
    """``FrontEnd`` on the running event loop: the public aio server over an aio channel to
    the engine process at ``engine``, on ``port`` of ``server.host`` (SO_REUSEPORT), with a
    task mirroring the engine process's health. Build it inside the running event loop."""

    def __init__(self, cfg: Config, engine: str, port: int, metrics: FrontEndMetrics | None):
        self.channel = grpc.aio.insecure_channel(engine, options=channel_options())
        self.servicer = AioFrontEndServicer(self.channel, cfg, metrics)
        self.server = AioGrpcServer(
            cfg,
            self.servicer,
            port=port,
            reuse_port=True,
            undecodable=metrics.count_undecodable if metrics is not None else None,
        )
        self._stopping = asyncio.Event()
        self._watch: Any = None
        self._mirror: asyncio.Task[None] | None = None

    async def start(self) -> AioFrontEnd:
        await self.server.start(ready=False)
        self._mirror = asyncio.get_running_loop().create_task(self._mirror_health())
        return self

    async def _mirror_health(self) -> None:
        """Report what the engine process reports (its service ``""``), NOT_SERVING while it
        cannot be reached."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        while not self._stopping.is_set():
            try:
                self._watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                async for status in self._watch:
                    await self.server.set_serving(status.status == serving)
            except grpc.RpcError:
                pass
            await self.server.set_serving(False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), 0.2)

    async def stop(self, grace: float) -> None:
        """Drain this front end's callers (AioGrpcServer.stop), send what is still queued,
        close the channel."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.cancel()
        await self.server.stop(grace)
        if self._mirror is not None:
            self._mirror.cancel()
            await asyncio.gather(self._mirror, return_exceptions=True)
        await self.servicer.batcher.close()
        await self.channel.close()


async def serve(cfg: Config, spec: dict[str, Any], metrics: FrontEndMetrics | None) -> None:
    """``frontend.main`` for the aio mode: serve until SIGTERM or the stdin line ``stop
    <grace_s>`` (or its end), then drain within the grace."""
    loop = asyncio.get_running_loop()
    front = await AioFrontEnd(cfg, spec["engine"], int(spec["port"]), metrics).start()
    stop = asyncio.Event()
    grace = [cfg.server.shutdown_grace_s]
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def read_stop() -> None:
        line = sys.stdin.readline()  # "stop <grace_s>", or "" once the service is gone
        parts = line.split()
        grace[0] = float(parts[1]) if len(parts) == 2 and parts[0] == "stop" else 1.0
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_stop, name="stdin", daemon=True).start()
    print(f"ready {os.getpid()}", flush=True)
    await stop.wait()
    await front.stop(grace[0])
    log.info(
        "front end %d stopped: %d Rank calls in %d RankBatch calls",
        spec["index"],
        front.servicer.batcher.requests,
        front.servicer.batcher.batches,
    )
