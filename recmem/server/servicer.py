"""The RecMem gRPC servicer: a thin adapter that validates requests, hands them to the engine
loop (recmem/engine/loop.py: micro-batches, one rank step per batch) and translates results
back. With a router (instances sharing a consumer group) each call goes where its user is
owned: here, forwarded, or redirected (recmem/server/routing.py)."""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.client import GENERATION, OWNER, PARTITION, RETRY_PUSHBACK
from recmem.engine import DeviceOutOfMemory, LoopStopped, PartitionUnavailable, UserInfo
from recmem.queries import RankQuery, RankResult
from recmem.routing import OwnerMap
from recmem.server import packed
from recmem.server.metrics import RankMetrics
from recmem.server.packed import fill_response
from recmem.server.routing import FORWARDED, Forwarder, RoutingFailure, passthrough
from recmem.server.validation import InvalidRequest, Limits, to_queries, to_query
from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)


class RankBackend(Protocol):
    """What the servicer hands requests to: the engine loop."""

    def submit(self, query: RankQuery, partition: int | None = None) -> Future[RankResult]: ...

    def submit_many(
        self, queries: Sequence[RankQuery], partitions: Sequence[int | None]
    ) -> Future[list[RankResult | BaseException]]: ...

    def inspect(
        self, user_id: str, timeout: float | None = 30.0, partition: int | None = None
    ) -> UserInfo | None: ...


_Failure = RoutingFailure


class Router:
    """Where calls go when instances share a group: the owner map, this instance's
    address, forward or redirect, and the retry hint of UNAVAILABLE answers."""

    def __init__(
        self,
        owners: OwnerMap,
        forwarder: Forwarder | None,
        retry_ms: int = 250,
    ) -> None:
        self.owners = owners
        self.forwarder = forwarder
        """None: redirect (``server.routing = redirect``)."""
        self.retry_ms = retry_ms

    def unavailable(self, message: str, partition: int | None = None) -> RoutingFailure:
        md: tuple[tuple[str, str], ...] = ((RETRY_PUSHBACK, str(self.retry_ms)),)
        if partition is not None:
            md += ((PARTITION, str(partition)),)
        md += ((GENERATION, str(self.owners.current.generation)),)
        return RoutingFailure(grpc.StatusCode.UNAVAILABLE, message, md)


class RecMemServicer(rank_pb2_grpc.RecMemServicer):
    def __init__(
        self,
        backend: RankBackend,
        vocab: ItemVocab,
        limits: Limits,
        model_version: str,
        timeout_s: float = 30.0,
        metrics: RankMetrics | None = None,
        router: Router | None = None,
    ) -> None:
        self._backend = backend
        self._vocab = vocab
        self._limits = limits
        self._model_version = model_version
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._router = router

    def Rank(
        self, request: rank_pb2.RankRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankResponse:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return self._routed(  # type: ignore[no-any-return,unused-ignore]
                "Rank", request, context, lambda p: self._rank(request, context, p)
            )
        except _Failure as f:
            code = f.code
            self._abort(context, f)
            raise  # abort raises; this line only informs the type checker
        finally:
            if self._metrics is not None:
                self._metrics.requests.labels(code=code.name).inc()
                self._metrics.latency.observe(time.perf_counter() - start)

    @staticmethod
    def _abort(context: grpc.ServicerContext, f: RoutingFailure) -> None:
        if f.metadata:
            context.set_trailing_metadata(f.metadata)
        context.abort(f.code, f.message)

    def _route_count(self, route: str) -> None:
        if self._metrics is not None:
            self._metrics.routes.labels(route=route).inc()

    def _routed(
        self,
        method: str,
        request: Any,
        context: grpc.ServicerContext,
        local: Callable[[int | None], Any],
    ) -> Any:
        """``local(partition)`` where the user is owned here (partition None: no router);
        else forward the call to its owner, or redirect, or UNAVAILABLE with a hint."""
        place = self._place(request, context)
        if isinstance(place, _Remote):
            return self._forward(method, request, context, place)
        return local(place.partition)

    def _place(self, request: Any, context: grpc.ServicerContext) -> _Local | _Remote:
        """Where a call's user is served: here (on which partition), or by the owner the
        call is forwarded to; raises the redirect or UNAVAILABLE failure otherwise."""
        router = self._router
        if router is None:
            return _Local(None)
        user_id = getattr(request, "user_id", "")
        if not user_id:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, "user_id is empty")
        route = router.owners.route(user_id)
        if route.partition is None:
            self._route_count("unavailable")
            raise router.unavailable("this instance has no partition assignment yet")
        if route.local:
            self._route_count("local")
            return _Local(route.partition)
        if route.owner is None:
            self._route_count("unavailable")
            raise router.unavailable(
                f"partition {route.partition} has no owner now (moving between instances)",
                route.partition,
            )
        owner_md = (
            (OWNER, route.owner),
            (PARTITION, str(route.partition)),
            (GENERATION, str(route.generation)),
        )
        forwarded = any(k == FORWARDED for k, _ in (context.invocation_metadata() or ()))
        if router.forwarder is None or forwarded:
            self._route_count("redirected")
            raise _Failure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"user {user_id!r} (partition {route.partition}) is served by {route.owner}",
                owner_md,
            )
        self._route_count("forwarded")
        return _Remote(route.owner, route.partition)

    def _forward(
        self, method: str, request: Any, context: grpc.ServicerContext, to: _Remote
    ) -> Any:
        """The owner's answer to the call (its failure raised as Rank would answer it)."""
        router = self._router
        assert router is not None and router.forwarder is not None
        remaining = context.time_remaining()
        timeout = self._timeout_s if remaining is None else min(remaining, self._timeout_s)
        try:
            return router.forwarder.call(method, to.owner, request, max(timeout, 0.0))
        except grpc.RpcError as e:
            raise passthrough(e, to.owner, to.partition, router.retry_ms) from None

    def _unavailable(self, message: str, partition: int | None) -> RoutingFailure:
        if self._router is not None:
            return self._router.unavailable(message, partition)
        return _Failure(grpc.StatusCode.UNAVAILABLE, message)

    def _deadline(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        return max(self._timeout_s if remaining is None else min(remaining, self._timeout_s), 0.0)

    def _rank(
        self,
        request: rank_pb2.RankRequest,
        context: grpc.ServicerContext,
        partition: int | None,
    ) -> rank_pb2.RankResponse:
        timeout = self._deadline(context)
        return self._finish(self._submit(request, partition), timeout)

    def _submit(self, request: rank_pb2.RankRequest, partition: int | None) -> Future[RankResult]:
        """Validate one request and hand it to the engine loop."""
        try:
            query = to_query(request, self._vocab, self._limits)
        except InvalidRequest as e:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            return self._backend.submit(query, partition)
        except LoopStopped as e:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def _finish(self, fut: Future[RankResult], timeout: float) -> rank_pb2.RankResponse:
        """Wait for a submitted request's result and translate it (or its failure)."""
        try:
            res = fut.result(timeout=timeout)
        except FutureTimeout:
            fut.cancel()
            raise _Failure(
                grpc.StatusCode.DEADLINE_EXCEEDED, "rank did not finish in time"
            ) from None
        except Exception as e:  # noqa: BLE001 - translated; see _failure
            raise self._failure(e) from None
        response = rank_pb2.RankResponse()
        self._fill(response, res)
        self._count_many([res])
        return response

    def _failure(self, error: BaseException) -> RoutingFailure:
        """What the client gets for a request the engine failed."""
        if isinstance(error, PartitionUnavailable):
            return self._unavailable(
                f"partition {error.partition} is being restored here; retry shortly",
                error.partition,
            )
        if isinstance(error, LoopStopped):
            return _Failure(grpc.StatusCode.UNAVAILABLE, str(error))
        if isinstance(error, DeviceOutOfMemory):
            return _Failure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the service's GPU is out of memory; retry later",
            )
        # logged by the engine loop; the client gets INTERNAL
        return _Failure(grpc.StatusCode.INTERNAL, "rank failed; see the server log")

    def _count_many(self, results: Sequence[RankResult]) -> None:
        """Count results in the metrics (notes replayed, cold starts, replay cache hits):
        one update per metric, not per result."""
        m = self._metrics
        if m is None or not results:
            return
        m.notes_replayed.inc(sum(r.notes_replayed for r in results))
        if cold := sum(r.cold_start for r in results):
            m.cold_starts.inc(cold)
        if cached := sum(r.from_cache for r in results):
            m.replay_cache_hits.inc(cached)

    def _count_codes(self, codes: Sequence[grpc.StatusCode]) -> None:
        """Count answered requests by status: one update per status present."""
        if self._metrics is not None:
            for name, n in collections.Counter(c.name for c in codes).items():
                self._metrics.requests.labels(code=name).inc(n)

    def _fill(self, response: rank_pb2.RankResponse, res: RankResult) -> None:
        """Write a result into an empty RankResponse."""
        fill_response(
            response,
            self._vocab.item_ids,
            res.items.tolist(),
            res.scores.tolist(),
            self._model_version,
            res.position,
            res.cold_start,
            res.notes_replayed,
            res.context_applied,
        )

    def describe_packed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The packed path's description (recmem/server/packed.py): offered only without a
        router, whose per-request routing the packed path does not do."""
        return packed.describe(self._router is None, self._model_version, self._vocab, self._limits)

    def rank_packed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A front end's packed batch of validated queries: handed to the engine loop as one
        submission, as RankBatch hands the requests it owns, each answered (and counted in
        the metrics) as RankBatch would answer it."""
        if self._router is not None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the packed path is not offered by an instance that routes calls",
            )
        try:
            queries = packed.unpack_queries(request, self._vocab.n_items)
        except packed.PackedError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        n, most = len(queries), self._limits.max_batch_requests
        if not 1 <= n <= most:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a packed batch holds {n} requests; 1 to {most} are accepted",
            )
        if self._metrics is not None:
            self._metrics.packed_requests.inc(n)
        timeout = self._deadline(context)
        got = self._wait_many(self._submit_many(queries, [None] * n), n, timeout)
        out: list[RankResult | rank_pb2.RankBatchResult] = []
        codes: list[grpc.StatusCode] = []
        for res in got:
            if isinstance(res, RankResult):
                out.append(res)
                codes.append(grpc.StatusCode.OK)
            else:
                failure = res if isinstance(res, RoutingFailure) else self._failure(res)
                out.append(_batch_failure(failure))
                codes.append(failure.code)
        self._count_many([r for r in out if isinstance(r, RankResult)])
        self._count_codes(codes)
        return packed.pack_results(out)

    def packed_handler(self) -> grpc.GenericRpcHandler:
        """The packed path's methods, for the engine process's private server."""
        return grpc.method_handlers_generic_handler(
            packed.SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(method)
                for name, method in (
                    ("Describe", self.describe_packed),
                    ("RankPacked", self.rank_packed),
                )
            },
        )

    def RankBatch(
        self, request: rank_pb2.RankBatchRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankBatchResponse:
        """Each request is answered as Rank would answer it, with its status in its result:
        the requests owned here are validated together and handed to the engine loop as
        one submission (so they share engine steps), then the others are forwarded (or
        redirected) one at a time, as Rank would, while those run. Each request is counted in the request
        metrics with its own status. ``_rank_batch_reference`` is the plain form, one
        request at a time."""
        n, most = len(request.requests), self._limits.max_batch_requests
        if not 1 <= n <= most:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"RankBatch holds {n} requests; 1 to {most} are accepted (server.max_batch_requests)",
            )
        timeout = self._deadline(context)
        reqs = list(request.requests)
        # per request: where it is served (None: here, or failed), then its answer
        places: list[_Local | _Remote | None] = [_Local(None)] * n
        answers: list[RankResult | rank_pb2.RankResponse | BaseException | None] = [None] * n
        if self._router is not None:
            for i, r in enumerate(reqs):
                try:
                    places[i] = self._place(r, context)
                except _Failure as f:
                    places[i], answers[i] = None, f
        local = [i for i in range(n) if isinstance(places[i], _Local)]
        queries = to_queries([reqs[i] for i in local], self._vocab, self._limits)
        valid: list[int] = []
        valid_queries: list[RankQuery] = []
        partitions: list[int | None] = []
        for i, q in zip(local, queries):
            if isinstance(q, InvalidRequest):
                answers[i] = _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(q))
            else:
                valid.append(i)
                valid_queries.append(q)
                partitions.append(places[i].partition)  # type: ignore[union-attr]
        submitted = self._submit_many(valid_queries, partitions)
        for i, place in enumerate(places):
            if isinstance(place, _Remote):
                try:
                    answers[i] = self._forward("Rank", reqs[i], context, place)
                except _Failure as f:
                    answers[i] = f
        for i, ranked in zip(valid, self._wait_many(submitted, len(valid), timeout), strict=True):
            answers[i] = ranked
        out = rank_pb2.RankBatchResponse()
        codes: list[grpc.StatusCode] = []
        for got in answers:
            result = out.results.add()
            if isinstance(got, BaseException):
                failure = got if isinstance(got, RoutingFailure) else self._failure(got)
                result.CopyFrom(_batch_failure(failure))
                codes.append(failure.code)
            else:
                if isinstance(got, RankResult):
                    self._fill(result.response, got)
                else:
                    assert got is not None
                    result.response.CopyFrom(got)
                result.response.SetInParent()
                codes.append(grpc.StatusCode.OK)
        self._count_many([a for a in answers if isinstance(a, RankResult)])
        self._count_codes(codes)
        return out

    def _submit_many(
        self, queries: list[RankQuery], partitions: list[int | None]
    ) -> Future[list[RankResult | BaseException]] | RoutingFailure | None:
        """Hand valid queries to the engine loop in one submission (None: there are none)."""
        if not queries:
            return None
        try:
            return self._backend.submit_many(queries, partitions)
        except LoopStopped as e:
            return _Failure(grpc.StatusCode.UNAVAILABLE, str(e))

    def _wait_many(
        self,
        submitted: Future[list[RankResult | BaseException]] | RoutingFailure | None,
        n: int,
        timeout: float,
    ) -> Sequence[RankResult | BaseException]:
        """Each submitted query's result or failure (one failure for all when the
        submission failed or the deadline passed)."""
        if submitted is None:
            return []
        if isinstance(submitted, RoutingFailure):
            return [submitted] * n
        try:
            return submitted.result(timeout=timeout)
        except FutureTimeout:
            submitted.cancel()
            late = _Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "rank did not finish in time")
            return [late] * n

    def _rank_batch_reference(
        self, request: rank_pb2.RankBatchRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankBatchResponse:
        """RankBatch one request at a time (the plain form the tests hold RankBatch to):
        every request owned here is submitted before any is awaited, the others are
        forwarded (or redirected) as Rank would."""
        timeout = self._deadline(context)
        started: list[Future[RankResult] | rank_pb2.RankResponse | RoutingFailure] = []
        for r in request.requests:
            try:
                started.append(self._routed("Rank", r, context, functools.partial(self._submit, r)))
            except _Failure as f:
                started.append(f)
        results = []
        for item in started:
            try:
                if isinstance(item, RoutingFailure):
                    raise item
                resp = self._finish(item, timeout) if isinstance(item, Future) else item
                results.append(rank_pb2.RankBatchResult(code=0, response=resp))
                code = grpc.StatusCode.OK
            except _Failure as f:
                results.append(_batch_failure(f))
                code = f.code
            if self._metrics is not None:
                self._metrics.requests.labels(code=code.name).inc()
        return rank_pb2.RankBatchResponse(results=results)

    def InspectUser(
        self, request: rank_pb2.InspectUserRequest, context: grpc.ServicerContext
    ) -> rank_pb2.InspectUserResponse:
        if not request.user_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "user_id is empty")
        try:
            return self._routed(  # type: ignore[no-any-return]
                "InspectUser", request, context, lambda p: self._inspect(request, p)
            )
        except _Failure as f:
            self._abort(context, f)
            raise

    def Routing(
        self, request: rank_pb2.RoutingRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RoutingResponse:
        if self._router is None:
            return rank_pb2.RoutingResponse(generation=-1, model_version=self._model_version)
        own = self._router.owners.current
        return rank_pb2.RoutingResponse(
            generation=own.generation,
            partitions=own.partitions,
            owners=[
                rank_pb2.PartitionOwner(partition=p, address=a)
                for p, a in sorted(own.owners.items())
            ],
            address=self._router.owners.me,
            model_version=self._model_version,
        )

    def _inspect(
        self, request: rank_pb2.InspectUserRequest, partition: int | None
    ) -> rank_pb2.InspectUserResponse:
        try:
            info = self._backend.inspect(request.user_id, partition=partition)
        except PartitionUnavailable as e:
            raise self._unavailable(
                f"partition {e.partition} is being restored here; retry shortly", e.partition
            ) from None
        except LoopStopped as e:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if info is None:
            return rank_pb2.InspectUserResponse(
                user_id=request.user_id,
                known=False,
                last_ts_ms=-1,
                model_version=self._model_version,
            )
        return rank_pb2.InspectUserResponse(
            user_id=request.user_id,
            known=True,
            position=info.position,
            unlocked_blocks=info.unlocked_blocks,
            total_blocks=info.total_blocks,
            note_count=info.note_count,
            resident_tier=info.resident_tier,
            last_ts_ms=info.last_ts_ms,
            model_version=self._model_version,
        )


@dataclass(frozen=True)
class _Local:
    """A RankBatch request owned here, on ``partition`` (None: no router)."""

    partition: int | None


@dataclass(frozen=True)
class _Remote:
    """A call forwarded to ``owner``, which serves the user's ``partition``."""

    owner: str
    partition: int


def _batch_failure(f: RoutingFailure) -> rank_pb2.RankBatchResult:
    """One RankBatch request's failure: what Rank would have aborted with, as a result."""
    md = dict(f.metadata or ())
    result = rank_pb2.RankBatchResult(
        code=f.code.value[0],
        message=f.message,
        owner=md.get(OWNER, ""),
        retry_pushback_ms=int(md.get(RETRY_PUSHBACK, 0) or 0),
    )
    if PARTITION in md:
        result.partition = int(md[PARTITION])
    if GENERATION in md:
        result.generation = int(md[GENERATION])
    return result
