"""The asyncio front end's batcher and Rank path (recmem/server/frontend_aio.py) against a
stand-in engine stub, on one event loop: batches form from concurrent calls, a failed
result becomes the status and trailing metadata Rank answers, a call past its deadline
gets DEADLINE_EXCEEDED and is left out of later batches. The whole front end over real
processes: test_frontends.py (both modes)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from proto.recmem.v1 import rank_pb2
from recmem.client import OWNER, RETRY_PUSHBACK
from recmem.config import Config
from recmem.server import frontend_aio
from recmem.server.frontend_aio import AioFrontEndServicer


class Engine:
    """A stand-in aio stub: RankBatch answers each request with its user id as the model
    version (user "fail": code FAILED_PRECONDITION with an owner), after ``gate`` opens."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def RankBatch(  # noqa: N802 - gRPC name
        self, request: rank_pb2.RankBatchRequest, timeout: float, metadata: Any
    ) -> rank_pb2.RankBatchResponse:
        self.batches.append([r.user_id for r in request.requests])
        await self.gate.wait()
        results = []
        for r in request.requests:
            if r.user_id == "fail":
                results.append(
                    rank_pb2.RankBatchResult(
                        code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                        message="owned elsewhere",
                        owner="other:1",
                        retry_pushback_ms=250,
                    )
                )
            else:
                response = rank_pb2.RankResponse(model_version=r.user_id)
                results.append(rank_pb2.RankBatchResult(code=0, response=response))
        return rank_pb2.RankBatchResponse(results=results)


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def servicer(engine: Engine, window_ms: float = 4.0) -> AioFrontEndServicer:
    cfg = Config()
    cfg.server.batch_window_ms = window_ms
    # a channel that is never used: the batcher's stub is the stand-in
    svc = AioFrontEndServicer(grpc.aio.insecure_channel("unix:/nonexistent"), cfg)
    svc.batcher._stub = engine
    return svc


def test_concurrent_calls_share_batches_and_each_gets_its_own_answer() -> None:
    async def main() -> None:
        engine = Engine()
        svc = servicer(engine)
        users = [f"u{i}" for i in range(20)]
        got = await asyncio.gather(
            *(svc._rank(rank_pb2.RankRequest(user_id=u), Context(5.0)) for u in users)  # type: ignore[arg-type]
        )
        assert [r.model_version for r in got] == users
        assert sorted(u for b in engine.batches for u in b) == sorted(users)
        assert len(engine.batches) < len(users)
        await svc.batcher.close()

    asyncio.run(main())


def test_a_failed_result_is_the_status_and_trailing_metadata_of_rank() -> None:
    async def main() -> None:
        svc = servicer(Engine())
        with pytest.raises(frontend_aio._Refused) as err:
            await svc._rank(rank_pb2.RankRequest(user_id="fail"), Context(5.0))  # type: ignore[arg-type]
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.message == "owned elsewhere"
        assert dict(err.value.trailing) == {OWNER: "other:1", RETRY_PUSHBACK: "250"}
        await svc.batcher.close()

    asyncio.run(main())


def test_a_call_past_its_deadline_is_answered_and_left_out() -> None:
    async def main() -> None:
        engine = Engine()
        svc = servicer(engine, window_ms=0.0)
        engine.gate.clear()  # the engine holds its batches
        held = []
        for i in range(2):  # a batch each, taking both in-flight slots
            request = rank_pb2.RankRequest(user_id=f"held{i}")
            held.append(asyncio.ensure_future(svc._rank(request, Context(5.0))))  # type: ignore[arg-type]
            while len(engine.batches) <= i:
                await asyncio.sleep(0.01)
        with pytest.raises(frontend_aio._Refused) as err:
            await svc._rank(rank_pb2.RankRequest(user_id="late"), Context(0.05))  # type: ignore[arg-type]
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        engine.gate.set()
        assert [r.model_version for r in await asyncio.gather(*held)] == ["held0", "held1"]
        await svc.batcher.close()
        assert "late" not in [u for b in engine.batches for u in b]

    asyncio.run(main())
