"""The RecMem gRPC servicer: a thin adapter that validates requests, hands them to the engine
loop (recmem/engine/loop.py: micro-batches, one rank step per batch) and translates results
back."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import grpc

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.engine import LoopStopped, UserInfo
from recmem.ranking import RankQuery, RankResult
from recmem.server.metrics import RankMetrics
from recmem.server.validation import InvalidRequest, Limits, to_query
from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)


class RankBackend(Protocol):
    """What the servicer hands requests to: the engine loop."""

    def submit(self, query: RankQuery) -> Future[RankResult]: ...

    def inspect(self, user_id: str, timeout: float | None = 30.0) -> UserInfo | None: ...


class _Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RecMemServicer(rank_pb2_grpc.RecMemServicer):
    def __init__(
        self,
        backend: RankBackend,
        vocab: ItemVocab,
        limits: Limits,
        model_version: str,
        timeout_s: float = 30.0,
        metrics: RankMetrics | None = None,
    ) -> None:
        self._backend = backend
        self._vocab = vocab
        self._limits = limits
        self._model_version = model_version
        self._timeout_s = timeout_s
        self._metrics = metrics

    def Rank(
        self, request: rank_pb2.RankRequest, context: grpc.ServicerContext
    ) -> rank_pb2.RankResponse:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return self._rank(request, context.time_remaining())
        except _Failure as f:
            code = f.code
            context.abort(f.code, f.message)
            raise  # abort raises; this line only informs the type checker
        finally:
            if self._metrics is not None:
                self._metrics.requests.labels(code=code.name).inc()
                self._metrics.latency.observe(time.perf_counter() - start)

    def _rank(
        self, request: rank_pb2.RankRequest, remaining: float | None
    ) -> rank_pb2.RankResponse:
        try:
            query = to_query(request, self._vocab, self._limits)
        except InvalidRequest as e:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            fut = self._backend.submit(query)
        except LoopStopped as e:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        timeout = self._timeout_s if remaining is None else min(remaining, self._timeout_s)
        try:
            res = fut.result(timeout=max(timeout, 0.0))
        except FutureTimeout:
            fut.cancel()
            raise _Failure(
                grpc.StatusCode.DEADLINE_EXCEEDED, "rank did not finish in time"
            ) from None
        except LoopStopped as e:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except Exception:  # noqa: BLE001 - logged by the engine loop; the client gets INTERNAL
            raise _Failure(grpc.StatusCode.INTERNAL, "rank failed; see the server log") from None
        if self._metrics is not None:
            self._metrics.notes_replayed.inc(res.notes_replayed)
            if res.cold_start:
                self._metrics.cold_starts.inc()
            if res.from_cache:
                self._metrics.replay_cache_hits.inc()
        ids = self._vocab.item_ids
        return rank_pb2.RankResponse(
            items=[
                rank_pb2.ScoredItem(item_id=ids[int(i)], score=float(s))
                for i, s in zip(res.items, res.scores)
            ],
            model_version=self._model_version,
            position=res.position,
            cold_start=res.cold_start,
            notes_replayed=res.notes_replayed,
            context_applied=res.context_applied,
        )

    def InspectUser(
        self, request: rank_pb2.InspectUserRequest, context: grpc.ServicerContext
    ) -> rank_pb2.InspectUserResponse:
        if not request.user_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "user_id is empty")
        try:
            info = self._backend.inspect(request.user_id)
        except LoopStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
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
