"""RankBatch's batched path (``to_queries``, one ``EngineLoop.submit_many`` per call, the
responses filled in place) against its plain twins: ``to_query`` per request and the
servicer's ``_rank_batch_reference`` (one submission per request), on the same engine,
with failures of every kind mixed into the batches."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from proto.recmem.v1 import event_pb2, rank_pb2
from recmem.engine import EngineLoop, PartitionUnavailable
from recmem.ranking import RankQuery, RankResult
from recmem.routing import Ownership, Route
from recmem.server import limits_from_config
from recmem.server.metrics import RankMetrics
from recmem.server.routing import RoutingFailure
from recmem.server.servicer import RecMemServicer, Router
from recmem.server.validation import InvalidRequest, to_queries, to_query
from tests.recmem.rank_env import RankEnv, make_env, start_loop

TS = 5_000_000_000
"""A fixed request time: the read-out's clock is the same for both paths."""


def ask(user: str, k: int = 5, cands: list[str] | None = None, notes: int = 0,
        **kw: Any) -> rank_pb2.RankRequest:  # fmt: skip
    return rank_pb2.RankRequest(
        user_id=user,
        k=k,
        candidate_item_ids=cands or [],
        replay=rank_pb2.ReplayOptions(enabled=notes > 0, notes=notes),
        **{"request_ts_ms": TS, **kw},
    )


def mixed_requests() -> list[rank_pb2.RankRequest]:
    """Valid requests of every shape, and every kind of invalid one between them."""
    click = event_pb2.ACTION_CLICK
    context = [
        event_pb2.Event(item_id="item7", ts_ms=50_000_000, action=click),
        event_pb2.Event(item_id="item9", ts_ms=50_100_000, action=click),
    ]
    return [
        ask("user0"),
        ask("user1", cands=["item3", "item4", "item8"]),
        ask("user1", cands=["item3", "nope", "item8", "gone"]),  # unknown candidates
        ask("user2", notes=2, cands=[f"item{i}" for i in range(0, 40, 2)]),
        ask("user2", cands=["item3", "item4", "item3"]),  # duplicate
        ask("user3", k=6, context=context),
        ask("user3", k=0, cands=["nope"]),  # k and candidates: k is named
        ask("", cands=["item1"]),  # no user
        ask("user4", k=60),
        ask("user4", notes=999),  # replay beyond the limit
        ask("nobody", k=4, cands=["item1", "item2"]),  # cold start
        ask("user5", cands=[f"item{i}" for i in range(50)] * 2),  # duplicates
        ask("user5", request_ts_ms=-1),
        ask("user0", k=3, notes=2, context=context[::-1]),  # context out of order
        ask("user5", cands=["item0"]),
    ]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("rank-batch") / "spill")


@pytest.fixture(scope="module")
def loop(env: RankEnv) -> Iterator[EngineLoop]:
    env.engine.serving.add(0)
    started = start_loop(env)
    yield started
    started.stop()


def servicer(env: RankEnv, loop: EngineLoop, router: Router | None = None) -> RecMemServicer:
    limits = limits_from_config(env.cfg)
    return RecMemServicer(
        loop, env.vocab, limits, env.built.model_version, metrics=RankMetrics(), router=router
    )


class Context:
    """The servicer's view of a call: no deadline, no metadata; aborts raise."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise AssertionError(f"aborted: {code} {message}")


def codes(svc: RecMemServicer) -> dict[str, float]:
    assert svc._metrics is not None
    return {
        s.labels["code"]: s.value
        for m in svc._metrics.requests.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


def assert_same_batch(got: rank_pb2.RankBatchResponse, want: rank_pb2.RankBatchResponse) -> None:
    assert len(got.results) == len(want.results)
    for g, w in zip(got.results, want.results, strict=True):
        assert (g.code, g.message, g.owner, g.retry_pushback_ms) == (
            w.code, w.message, w.owner, w.retry_pushback_ms,
        )  # fmt: skip
        assert (g.HasField("partition"), g.partition, g.HasField("generation"), g.generation) == (
            w.HasField("partition"), w.partition, w.HasField("generation"), w.generation,
        )  # fmt: skip
        assert g.HasField("response") == w.HasField("response")
        a, b = g.response, w.response
        assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
        assert [i.score for i in a.items] == pytest.approx([i.score for i in b.items], abs=1e-5)
        fields = ("position", "cold_start", "notes_replayed", "context_applied", "model_version")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def test_to_queries_is_to_query_per_request(env: RankEnv) -> None:
    limits = limits_from_config(env.cfg)
    reqs = mixed_requests()
    got = to_queries(reqs, env.vocab, limits)
    assert len(got) == len(reqs)
    failed = 0
    for req, q in zip(reqs, got, strict=True):
        try:
            want = to_query(req, env.vocab, limits)
        except InvalidRequest as e:
            assert isinstance(q, InvalidRequest)
            assert str(q) == str(e)
            failed += 1
            continue
        assert isinstance(q, RankQuery)
        assert (q.user_id, q.k, q.replay_notes, q.request_ts_ms) == (
            want.user_id, want.k, want.replay_notes, want.request_ts_ms,
        )  # fmt: skip
        if want.candidates is None:
            assert q.candidates is None
        else:
            assert q.candidates is not None
            assert q.candidates.dtype == np.int64
            assert q.candidates.tolist() == want.candidates.tolist()
        assert q.context.items.tolist() == want.context.items.tolist()
        assert q.context.ts_ms.tolist() == want.context.ts_ms.tolist()
    assert failed == 8
    assert to_queries([], env.vocab, limits) == []


def test_rank_batch_is_the_per_request_path(env: RankEnv, loop: EngineLoop) -> None:
    fast, plain = servicer(env, loop), servicer(env, loop)
    reqs = mixed_requests()
    batch = rank_pb2.RankBatchRequest(requests=reqs)
    got = fast.RankBatch(batch, Context())  # type: ignore[arg-type]
    want = plain._rank_batch_reference(batch, Context())  # type: ignore[arg-type]
    assert_same_batch(got, want)
    assert [r.code for r in got.results].count(0) == 7
    # each answer is Rank's: the same result as one request alone
    for req, res in zip(reqs, got.results, strict=True):
        if res.code == 0:
            alone = fast._rank_batch_reference(
                rank_pb2.RankBatchRequest(requests=[req]),
                Context(),  # type: ignore[arg-type]
            )
            assert_same_batch(rank_pb2.RankBatchResponse(results=[res]), alone)
    assert codes(fast)["OK"] == 7 + 7
    assert codes(fast)["INVALID_ARGUMENT"] == codes(plain)["INVALID_ARGUMENT"] == 8


class Owners:
    """Where each user is served: ``user*`` here on partition 0, ``moving*`` here on a
    partition not served now, ``far*`` at another instance, ``lost*`` nowhere."""

    me = "here:1"
    current = Ownership(generation=7)

    def route(self, user_id: str) -> Route:
        if user_id.startswith("far"):
            return Route(3, "there:2", False, 7)
        if user_id.startswith("lost"):
            return Route(4, None, False, 7)
        if user_id.startswith("moving"):
            return Route(5, self.me, True, 7)
        return Route(0, self.me, True, 7)


class Forwarder:
    """The owner's answers: a fixed response, or UNAVAILABLE for ``far-down``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, method: str, address: str, request: Any, timeout: float | None) -> Any:
        self.calls.append(request.user_id)
        if request.user_id == "far-down":
            raise RoutingFailure(grpc.StatusCode.UNAVAILABLE, "owner down", (("x", "y"),))
        return rank_pb2.RankResponse(
            items=[rank_pb2.ScoredItem(item_id="item1", score=0.5)], model_version="remote"
        )


def test_routed_rank_batch_is_the_per_request_path(env: RankEnv, loop: EngineLoop) -> None:
    forwarders = Forwarder(), Forwarder()
    fast, plain = (
        servicer(env, loop, Router(Owners(), f, retry_ms=99))  # type: ignore[arg-type]
        for f in forwarders
    )
    reqs = [
        ask("user0"),
        ask("far1", cands=["item1"]),
        ask("lost1"),
        ask("moving1"),
        ask("user1", k=0),
        ask("far-down"),
        ask(""),
        ask("user2", notes=2, cands=["item2", "item5"]),
    ]
    batch = rank_pb2.RankBatchRequest(requests=reqs)
    got = fast.RankBatch(batch, Context())  # type: ignore[arg-type]
    want = plain._rank_batch_reference(batch, Context())  # type: ignore[arg-type]
    assert_same_batch(got, want)
    c = grpc.StatusCode
    assert [r.code for r in got.results] == [
        0, 0, c.UNAVAILABLE.value[0], c.UNAVAILABLE.value[0], c.INVALID_ARGUMENT.value[0],
        c.UNAVAILABLE.value[0], c.INVALID_ARGUMENT.value[0], 0,
    ]  # fmt: skip
    assert got.results[1].response.model_version == "remote"
    assert got.results[3].partition == 5 and got.results[3].retry_pushback_ms == 99
    assert forwarders[0].calls == forwarders[1].calls == ["far1", "far-down"]
    assert codes(fast) == codes(plain)


def test_submit_many_answers_each_request_as_submit(env: RankEnv, loop: EngineLoop) -> None:
    limits = limits_from_config(env.cfg)
    queries = [to_query(ask(u, notes=2), env.vocab, limits) for u in ("user0", "user1", "user2")]
    got = loop.submit_many(queries, [0, 9, None]).result(30)
    assert isinstance(got[1], PartitionUnavailable) and got[1].partition == 9
    for q, res in zip(queries[::2], got[::2], strict=True):
        assert isinstance(res, RankResult)
        alone = loop.submit(q, 0).result(30)
        assert res.items.tolist() == alone.items.tolist()
        assert res.notes_replayed == alone.notes_replayed == 2
    assert loop.submit_many([], []).result(1) == []


class Failing:
    """A ranker whose every batch fails."""

    n_items = 60

    def rank(self, queries: Any) -> list[RankResult]:
        raise RuntimeError("boom")


def test_a_failed_batch_or_a_stopped_loop_fails_each_request(env: RankEnv) -> None:
    limits = limits_from_config(env.cfg)
    failing = EngineLoop(Failing()).start()  # type: ignore[arg-type]
    svc = RecMemServicer(failing, env.vocab, limits, "m", metrics=RankMetrics())
    batch = rank_pb2.RankBatchRequest(requests=[ask("user0"), ask("user1", k=0), ask("user2")])
    got = svc.RankBatch(batch, Context())  # type: ignore[arg-type]
    want = svc._rank_batch_reference(batch, Context())  # type: ignore[arg-type]
    assert_same_batch(got, want)
    internal = grpc.StatusCode.INTERNAL.value[0]
    assert [r.code for r in got.results] == [internal, 3, internal]
    failing.stop()
    got = svc.RankBatch(batch, Context())  # type: ignore[arg-type]
    assert_same_batch(got, svc._rank_batch_reference(batch, Context()))  # type: ignore[arg-type]
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert [r.code for r in got.results] == [unavailable, 3, unavailable]


class OutOfMemory:
    """The real ranker, but its first ``fails`` batches raise a device out-of-memory error
    (what torch raises when a CUDA allocation fails; this machine may have no GPU)."""

    def __init__(self, ranker: Any, fails: int) -> None:
        self.ranker, self.fails, self.calls = ranker, fails, 0
        self.n_items = ranker.n_items

    def rank(self, queries: Any) -> list[RankResult]:
        self.calls += 1
        if self.calls <= self.fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.ranker.rank(queries)


def test_a_batch_out_of_device_memory_is_retried_once_then_refused(env: RankEnv) -> None:
    """One out-of-memory failure: the batch runs again (the allocator's cache emptied) and
    every request gets its answer; two in a row: RESOURCE_EXHAUSTED, not INTERNAL."""
    limits = limits_from_config(env.cfg)
    batch = rank_pb2.RankBatchRequest(requests=[ask("user0"), ask("user1", k=0), ask("user2")])
    plain = EngineLoop(env.ranker).start()
    want = RecMemServicer(plain, env.vocab, limits, "m").RankBatch(batch, Context())  # type: ignore[arg-type]
    plain.stop()
    for fails, code in ((1, 0), (2, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])):
        ranker = OutOfMemory(env.ranker, fails)
        loop = EngineLoop(ranker).start()  # type: ignore[arg-type]
        try:
            svc = RecMemServicer(loop, env.vocab, limits, "m", metrics=RankMetrics())
            got = svc.RankBatch(batch, Context())  # type: ignore[arg-type]
        finally:
            loop.stop()
        assert [r.code for r in got.results] == [code, 3, code]
        assert ranker.calls == 2
        if fails == 1:
            assert [r.response.items for r in got.results] == [
                r.response.items for r in want.results
            ]
        else:
            assert "out of memory" in got.results[0].message


def test_a_cancelled_group_is_skipped() -> None:
    class Spin:
        n_items = 1

        def rank(self, queries: Any) -> list[RankResult]:
            return [RankResult(np.zeros(0), np.zeros(0), 0, True, 0, 0) for _ in queries]

    loop = EngineLoop(Spin())  # not started: the group waits in the inbox
    fut = loop.submit_many([RankQuery("u", 1)], [None])
    assert fut.cancel()
    loop.start()
    later: Future[RankResult] = loop.submit(RankQuery("v", 1))
    assert later.result(10).cold_start
    loop.stop()
    assert loop.counts.requests == 1
