"""The packed path between a front end and the engine process (recmem/server/packed.py):
its buffers round-trip, malformed ones are refused with a message, and the engine's
``rank_packed`` answers each query as ``RankBatch`` answers the same requests (the same
rankings, failures, statuses and metrics). The front ends' end-to-end use of it is in
test_frontends.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from proto.recmem.v1 import rank_pb2
from recmem.engine import EngineLoop
from recmem.queries import RankQuery, RankResult, UserEvents
from recmem.server import limits_from_config, packed
from recmem.server.metrics import RankMetrics
from recmem.server.packed import EngineDescription, PackedError
from recmem.server.servicer import RecMemServicer
from recmem.server.validation import InvalidRequest, to_queries
from tests.recmem.rank_env import RankEnv, make_env, start_loop
from tests.recmem.server.test_rank_batch import (
    Context,
    Failing,
    assert_same_batch,
    codes,
    mixed_requests,
    servicer,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("packed") / "spill")


@pytest.fixture(scope="module")
def loop(env: RankEnv) -> Iterator[EngineLoop]:
    started = start_loop(env)
    yield started
    started.stop()


class Refusing(Context):
    """A call context whose abort raises the status it was given."""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def random_queries(rng: np.random.Generator, n: int, n_items: int) -> list[RankQuery]:
    out = []
    for i in range(n):
        m = int(rng.integers(0, 4))
        context = (
            UserEvents(
                rng.integers(0, n_items, m),
                rng.integers(0, 5, m),
                np.sort(rng.integers(1, 10**12, m)),
            )
            if m
            else UserEvents.empty()
        )
        cands = None if rng.random() < 0.3 else rng.permutation(n_items)[: rng.integers(0, 9)]
        out.append(
            RankQuery(
                user_id=f"usér-{i}-" + "x" * int(rng.integers(0, 5)),
                k=int(rng.integers(1, 50)),
                candidates=cands,
                replay_notes=int(rng.integers(0, 3)),
                context=context,
                request_ts_ms=int(rng.integers(0, 10**13)),
            )
        )
    return out


def test_queries_round_trip() -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 17):
        queries = random_queries(rng, n, 60)
        got = packed.unpack_queries(packed.pack_queries(queries), 60)
        assert len(got) == n
        for g, w in zip(got, queries, strict=True):
            assert (g.user_id, g.k, g.replay_notes, g.request_ts_ms) == (
                w.user_id, w.k, w.replay_notes, w.request_ts_ms,
            )  # fmt: skip
            if w.candidates is None:
                assert g.candidates is None
            else:
                assert g.candidates is not None and g.candidates.dtype == np.int64
                assert g.candidates.tolist() == w.candidates.tolist()
            for field in ("items", "actions", "ts_ms"):
                assert getattr(g.context, field).tolist() == getattr(w.context, field).tolist()


def test_results_round_trip_as_rank_batch_results() -> None:
    ids = [f"item{i}" for i in range(10)]
    failure = rank_pb2.RankBatchResult(code=14, message="gone", retry_pushback_ms=250)
    failure.partition = 3
    results: list[RankResult | rank_pb2.RankBatchResult] = [
        RankResult(np.array([4, 1]), np.array([0.5, 0.25], np.float32), 7, False, 2, 1),
        failure,
        RankResult(np.zeros(0, np.int64), np.zeros(0, np.float32), 0, True, 0, 0),
    ]
    got = packed.unpack_results(packed.pack_results(results), 3, ids, "v1")
    assert got[1] == failure
    assert [(i.item_id, i.score) for i in got[0].response.items] == [
        ("item4", 0.5),
        ("item1", 0.25),
    ]
    r = got[0].response
    assert (r.model_version, r.position, r.cold_start, r.notes_replayed, r.context_applied) == (
        "v1", 7, False, 2, 1,
    )  # fmt: skip
    assert got[2].code == 0 and got[2].HasField("response") and got[2].response.cold_start
    with pytest.raises(PackedError, match="do not answer 2"):
        packed.unpack_results(packed.pack_results(results), 2, ids, "v1")
    with pytest.raises(PackedError, match="do not answer"):
        packed.unpack_results(packed.pack_results(results[:1]), 1, ids[:3], "v1")  # item 4


def test_malformed_buffers_are_refused() -> None:
    good = packed.pack_queries(random_queries(np.random.default_rng(0), 3, 60))
    arrays = packed.unpack_arrays(good)
    bad_code = bytearray(good)
    bad_code[8:16] = (9).to_bytes(8, "little")
    negative = [a.copy() for a in arrays]
    negative[0][0] = -1
    short = [a.copy() for a in arrays]
    short[2] = short[2][:-1]
    cases = {
        "truncated": good[:-3],
        "trailing": good + b"\0",
        "dtype": bytes(bad_code),
        "empty": b"",
        "arrays": packed.pack_arrays(arrays[:10]),
        "negative": packed.pack_arrays(negative),
        "columns": packed.pack_arrays(short),
    }
    for name, data in cases.items():
        with pytest.raises(PackedError):
            packed.unpack_queries(data, 60)
            pytest.fail(name)
    with pytest.raises(PackedError, match="outside the catalog"):
        packed.unpack_queries(good, 5)


def test_the_description_round_trips(env: RankEnv) -> None:
    limits = limits_from_config(env.cfg)
    d = EngineDescription.parse(packed.describe(True, "m7", env.vocab, limits))
    assert (d.packed, d.model_version, d.limits) == (True, "m7", limits)
    assert d.vocab.item_ids == env.vocab.item_ids and d.vocab.n_oov == env.vocab.n_oov


def packed_answers(svc: RecMemServicer, reqs: list[rank_pb2.RankRequest], env: RankEnv) -> Any:
    """What the front end gets for ``reqs`` (all valid) on the packed path."""
    queries = to_queries(reqs, env.vocab, limits_from_config(env.cfg))
    assert not any(isinstance(q, InvalidRequest) for q in queries)
    data = svc.rank_packed(packed.pack_queries(queries), Context())  # type: ignore[arg-type, arg-type]
    results = packed.unpack_results(data, len(reqs), env.vocab.item_ids, env.built.model_version)
    return rank_pb2.RankBatchResponse(results=results)


def valid_requests(env: RankEnv) -> list[rank_pb2.RankRequest]:
    limits = limits_from_config(env.cfg)
    reqs = mixed_requests()
    return [
        r for r, q in zip(reqs, to_queries(reqs, env.vocab, limits)) if isinstance(q, RankQuery)
    ]


def test_rank_packed_answers_as_rank_batch(env: RankEnv, loop: EngineLoop) -> None:
    fast, plain = servicer(env, loop), servicer(env, loop)
    reqs = valid_requests(env)
    assert len(reqs) == 7
    got = packed_answers(fast, reqs, env)
    want = plain.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), Context())  # type: ignore[arg-type]
    assert_same_batch(got, want)
    assert codes(fast) == codes(plain) == {"OK": 7}
    assert fast._metrics is not None and plain._metrics is not None
    for name in ("notes_replayed", "cold_starts"):  # (the second call may hit the replay cache)
        assert (
            getattr(fast._metrics, name)._value.get() == getattr(plain._metrics, name)._value.get()
        )
    # counted once per batch, as many as the answers say
    answered = [r.response for r in want.results]
    assert plain._metrics.notes_replayed._value.get() == sum(r.notes_replayed for r in answered)
    assert plain._metrics.cold_starts._value.get() == sum(r.cold_start for r in answered) > 0
    assert fast._metrics.packed_requests._value.get() == 7
    assert plain._metrics.packed_requests._value.get() == 0


def test_rank_packed_fails_each_request_as_rank_batch(env: RankEnv) -> None:
    limits = limits_from_config(env.cfg)
    failing = EngineLoop(Failing()).start()  # type: ignore[arg-type]
    svc = RecMemServicer(failing, env.vocab, limits, "m", metrics=RankMetrics())
    reqs = valid_requests(env)[:3]
    for _ in range(2):  # a failing ranker, then a stopped loop
        got = packed_answers(svc, reqs, env)
        want = svc.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), Context())  # type: ignore[arg-type]
        assert_same_batch(got, want)
        assert {r.code for r in got.results} <= {13, 14} and len({r.code for r in got.results}) == 1
        failing.stop()
    assert codes(svc) == {"INTERNAL": 6, "UNAVAILABLE": 6}


def test_rank_packed_refuses_bad_calls(env: RankEnv, loop: EngineLoop) -> None:
    svc = servicer(env, loop)
    for data in (b"junk", packed.pack_queries([])):
        with pytest.raises(Aborted) as err:
            svc.rank_packed(data, Refusing())  # type: ignore[arg-type]
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert codes(svc) == {}
