"""The engine loop: micro-batching of rank requests (a trivial ranker), and on the real
engine the consistency invariant (a rank call sees a user's state, latest events and notes
from the same point) while ingest pieces, checkpoint captures and checkpoint writes go on."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from recmem.engine import DeviceOutOfMemory, EngineLoop, LoopStopped
from recmem.engine.builder import BuiltEngine
from recmem.ranking import RankQuery, RankResult
from streams.validate import ValidEvent
from tests.recmem.rank_env import RankEnv, make_env, start_loop


class EchoRanker:
    """Answers each query with its k as the position; records batch sizes."""

    n_items = 1

    def __init__(self, hold_first: threading.Event | None = None) -> None:
        self.sizes: list[int] = []
        self.hold_first = hold_first

    def rank(self, queries: Sequence[RankQuery]) -> list[RankResult]:
        self.sizes.append(len(queries))
        if self.hold_first is not None and len(self.sizes) == 1:
            assert self.hold_first.wait(10)
        if any(q.k == 0 for q in queries):
            raise ZeroDivisionError("bad query")
        empty = np.zeros(0, dtype=np.int64)
        return [RankResult(empty, empty.astype(np.float32), q.k, False, 0, 0) for q in queries]


def q(k: int) -> RankQuery:
    return RankQuery("u", k=k)


def test_batch_closes_once_the_expected_requests_are_in() -> None:
    release = threading.Event()
    ranker = EchoRanker(hold_first=release)
    loop = EngineLoop(ranker, window_ms=60_000, max_batch=16, adaptive=True).start()
    try:
        first = loop.submit(q(1))  # lone: runs at once
        while not ranker.sizes:
            time.sleep(0.001)
        queued = [loop.submit(q(k)) for k in (2, 3, 4)]
        release.set()
        assert first.result(timeout=10).position == 1
        # expected next: 1 (the last batch) + 3 (queued while it ran) = 4; three are in, so
        # the batch waits (a 60 s window) for the fourth and then runs at once
        last = loop.submit(q(5))
        assert [f.result(timeout=10).position for f in [*queued, last]] == [2, 3, 4, 5]
        assert ranker.sizes == [1, 4]
    finally:
        loop.stop()


def test_a_callers_next_request_does_not_count_as_queued_while_its_batch_ran() -> None:
    """Closed-loop callers that send their next request on each answer (a done callback, so
    it reaches the inbox before the loop takes from it again): every batch holds the two
    callers and closes once both are in, never waiting out the 60 s window for a third."""
    ranker = EchoRanker()
    loop = EngineLoop(ranker, window_ms=60_000, max_batch=16, adaptive=True)
    finished = [Future[int](), Future[int]()]

    def call(caller: int, left: int) -> None:
        def on_answer(f: Future[RankResult]) -> None:
            if left:
                call(caller, left - 1)
            else:
                finished[caller].set_result(f.result().position)

        loop.submit(q(10 * caller + left + 1)).add_done_callback(on_answer)

    call(0, 3)
    call(1, 3)  # both queued before the loop starts: the first batch holds both
    loop.start()
    try:
        assert [f.result(timeout=10) for f in finished] == [1, 11]
        assert ranker.sizes == [2, 2, 2, 2]
    finally:
        loop.stop()


def test_fixed_window_is_waited_out_without_adaptive() -> None:
    ranker = EchoRanker()
    loop = EngineLoop(ranker, window_ms=200, max_batch=16, adaptive=False).start()
    try:
        futs = [loop.submit(q(k)) for k in (1, 2, 3)]
        assert [f.result(timeout=10).position for f in futs] == [1, 2, 3]
        assert ranker.sizes == [3] and loop.counts.batches == 1
    finally:
        loop.stop()


def test_stop_joins_both_threads() -> None:
    """No thread of a stopped loop is left to run while the interpreter finalises."""

    class SlowEngine:
        def compute(self, piece: object) -> None:
            time.sleep(0.5)

    loop = EngineLoop(EchoRanker(), window_ms=0).start()
    assert loop.submit(q(3)).result(timeout=10).position == 3
    names = {t.name for t in threading.enumerate()}
    assert {"engine-loop", "engine-loop-exec"} <= names
    loop.engine = SlowEngine()  # type: ignore[assignment]
    loop._exec_q.put((object(), None))  # the executor is mid model step when stop comes
    time.sleep(0.05)
    loop.stop()
    names = {t.name for t in threading.enumerate()}
    assert "engine-loop" not in names and "engine-loop-exec" not in names


def test_a_failing_batch_fails_its_requests_not_the_loop() -> None:
    loop = EngineLoop(EchoRanker(), window_ms=0, max_batch=4).start()
    try:
        with pytest.raises(ZeroDivisionError):
            loop.submit(q(0)).result(timeout=10)
        assert loop.submit(q(5)).result(timeout=10).position == 5
    finally:
        loop.stop()
    with pytest.raises(LoopStopped):
        loop.submit(q(1))
    with pytest.raises(LoopStopped):  # a loop without an engine takes no ingest work
        EngineLoop(EchoRanker()).submit_apply([])


def event(user: str, ts: int, offset: int, item: str = "item1") -> ValidEvent:
    return ValidEvent(user, item, ts, 1, 1.0, None, 0, offset)


@pytest.fixture
def env(tmp_path: Path) -> RankEnv:
    return make_env(tmp_path / "spill", n_users=2)


def test_ranks_do_not_wait_for_the_model_step_and_see_whole_pieces(env: RankEnv) -> None:
    """While an ingest piece's model step runs (held here), rank calls are answered at once
    from the installed state, with the latest events and notes from the same point; after
    the piece is installed they see all three moved together."""
    engine = env.engine
    inner = engine.compute
    started, release = threading.Event(), threading.Event()

    def held_compute(piece):  # the real step, held until released
        started.set()
        assert release.wait(30)
        inner(piece)

    engine.compute = held_compute  # type: ignore[method-assign]
    loop = start_loop(env)
    safety = threading.Timer(20.0, release.set)
    safety.start()
    try:
        notes_before = loop.read(lambda: engine.bank.note_count("user0")).result(10)
        ts = int(env.history["user0"].ts_ms[-1])
        # 8 new events: a whole archive chunk closes, so the notes change with the state
        batch = [event("user0", ts + 60_000 * (i + 1), 100 + i, f"item{i}") for i in range(8)]
        applied = loop.submit_apply(batch)
        assert started.wait(30)
        t0 = time.monotonic()
        during = loop.submit(RankQuery("user0", k=3, replay_notes=2)).result(timeout=10)
        seen = loop.read(
            lambda: (
                engine.recent_events("user0", 1).ts_ms.tolist(),
                engine.bank.note_count("user0"),
            )
        ).result(10)
        assert time.monotonic() - t0 < 5 and during.position == 40
        assert seen == ([ts], notes_before)
        release.set()
        assert applied.result(timeout=30).events == 8
        after = loop.submit(RankQuery("user0", k=3)).result(timeout=10)
        seen = loop.read(
            lambda: (
                engine.recent_events("user0", 1).ts_ms.tolist(),
                engine.bank.note_count("user0"),
            )
        ).result(10)
        assert after.position == 48 and seen == ([ts + 8 * 60_000], notes_before + 2)
    finally:
        release.set()
        safety.cancel()
        loop.stop()


def _two_batches_held(env: RankEnv) -> tuple[threading.Event, threading.Event]:
    """Wrap the engine's step so that the first piece's step waits for ``queued`` (both
    batches submitted) and every later step sets ``second`` as it starts."""
    engine, compute = env.engine, env.engine.compute
    queued, second = threading.Event(), threading.Event()
    calls: list[int] = []

    def held(piece):
        calls.append(len(piece.users))
        if len(calls) == 1:
            assert queued.wait(10)
        else:
            second.set()
        compute(piece)

    engine.compute = held  # type: ignore[method-assign]
    return queued, second


def _eight(user: str, ts: int, offset: int) -> list[ValidEvent]:
    """8 events a minute apart after ``ts``: a whole archive chunk (2 notes) closes."""
    return [event(user, ts + 60_000 * (i + 1), offset + i, f"item{i}") for i in range(8)]


def test_the_next_piece_computes_while_the_last_ones_notes_are_written(env: RankEnv) -> None:
    """The loop hands the executor the next piece before it writes the finished piece's
    notes, so the two overlap; the result is the same as one piece after the other."""
    engine = env.engine
    queued, second = _two_batches_held(env)
    commit_notes = engine.commit_notes
    overlapped: list[bool] = []

    def watched(piece):
        if not overlapped:
            overlapped.append(second.wait(10))  # the next step started meanwhile
        commit_notes(piece)

    engine.commit_notes = watched  # type: ignore[method-assign]
    loop = start_loop(env)
    try:
        notes = loop.read(lambda: [engine.bank.note_count(u) for u in ("user0", "user1")])
        before = notes.result(10)
        ts = [int(env.history[u].ts_ms[-1]) for u in ("user0", "user1")]
        a = loop.submit_apply(_eight("user0", ts[0], 100))
        b = loop.submit_apply(_eight("user1", ts[1], 200))
        queued.set()
        assert a.result(30).events == 8 and b.result(30).events == 8
        assert overlapped == [True]
        after = loop.read(
            lambda: (
                [engine.bank.note_count(u) for u in ("user0", "user1")],
                [int(engine.snapshot([u]).pos[0]) for u in ("user0", "user1")],
                [engine.recent_events(u, 1).ts_ms.tolist() for u in ("user0", "user1")],
            )
        ).result(10)
        assert after == ([n + 2 for n in before], [48, 48], [[t + 8 * 60_000] for t in ts])
    finally:
        queued.set()
        loop.stop()


def test_notes_that_fail_while_the_next_piece_runs_stop_ingest_and_drop_it(
    env: RankEnv,
) -> None:
    """When writing a piece's notes fails after the next piece was handed to the executor,
    ingest stops with the error, both batches fail, the next piece's result is never
    installed, and ranking goes on."""
    queued, second = _two_batches_held(env)

    def broken(piece):
        assert second.wait(10)
        raise OSError("archive disk full")

    env.engine.commit_notes = broken  # type: ignore[method-assign]
    loop = start_loop(env)
    try:
        ts = [int(env.history[u].ts_ms[-1]) for u in ("user0", "user1")]
        a = loop.submit_apply(_eight("user0", ts[0], 100))
        b = loop.submit_apply(_eight("user1", ts[1], 200))
        queued.set()
        for fut in (a, b):
            with pytest.raises(OSError, match="archive disk full"):
                fut.result(10)
        with pytest.raises(LoopStopped, match="archive disk full"):
            loop.submit_apply(_eight("user1", ts[1] + 10**6, 300))
        assert loop.submit(RankQuery("user1", k=2)).result(10).position == 40
        latest = loop.read(lambda: env.engine.recent_events("user1", 1).ts_ms.tolist())
        assert latest.result(10) == [ts[1]]
    finally:
        queued.set()
        loop.stop()


def test_capture_and_install_run_in_ingest_order(env: RankEnv) -> None:
    """A task submitted after a batch sees the batch installed; one submitted before a
    batch does not see it; ingest errors stop ingest but not ranking."""
    loop = start_loop(env)
    try:
        seen: list[int] = []
        ts = int(env.history["user1"].ts_ms[-1])
        loop.submit_apply([event("user1", ts + 1000, 500)])
        first: Future = loop.run_task(lambda e: seen.append(int(e.snapshot(["user1"]).pos[0])))
        loop.submit_apply([event("user1", ts + 2000, 501)])
        loop.call(lambda e: seen.append(int(e.snapshot(["user1"]).pos[0])))
        first.result(10)
        assert seen == [41, 42]

        def broken(piece):
            raise OSError("disk on fire")

        env.engine.compute = broken  # type: ignore[method-assign]
        bad = loop.submit_apply([event("user1", ts + 3000, 502)])
        with pytest.raises(OSError, match="disk on fire"):
            bad.result(10)
        with pytest.raises(LoopStopped, match="disk on fire"):
            loop.submit_apply([event("user1", ts + 4000, 503)])
        assert loop.submit(RankQuery("user1", k=2)).result(10).position == 42
    finally:
        loop.stop()


def test_an_ingest_step_out_of_device_memory_runs_again_once(env: RankEnv) -> None:
    """The model step of a piece that runs out of device memory (what torch raises when a
    CUDA allocation fails) runs once more after the allocator's cache is emptied; a second
    failure in a row stops ingest as any step error does, and ranking goes on."""
    loop = start_loop(env)
    real = env.engine.compute
    fails = {"left": 1, "calls": 0}

    def flaky(piece):
        fails["calls"] += 1
        if fails["left"] > 0:
            fails["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(piece)

    try:
        env.engine.compute = flaky  # type: ignore[method-assign]
        ts = int(env.history["user1"].ts_ms[-1])
        assert loop.submit_apply([event("user1", ts + 1000, 500)]).result(10).events == 1
        assert fails["calls"] == 2
        assert loop.submit(RankQuery("user1", k=2)).result(10).position == 41
        fails["left"] = 2
        bad = loop.submit_apply([event("user1", ts + 2000, 501)])
        with pytest.raises(DeviceOutOfMemory, match="out of device memory"):
            bad.result(10)
        assert loop.submit(RankQuery("user1", k=2)).result(10).position == 41
    finally:
        loop.stop()


def _gpu_engines(tmp_path: Path, n: int) -> list[BuiltEngine]:
    """``n`` engines on the GPU with the same model weights, pieces of at most 64 cells
    on the padded path (several per batch), NoteBanks on."""
    import copy

    from models.recommender import MemoryRecommender
    from recmem.engine.builder import build_engine
    from recmem.vocab import ItemVocab
    from tests.recmem.rank_env import N_ITEMS, small_config

    torch.manual_seed(3)
    out = []
    for i in range(n):
        cfg = small_config(tmp_path / f"spill{i}")
        cfg.state.device_capacity = cfg.state.host_capacity = 64
        cfg.state.packed_advance, cfg.state.length_buckets, cfg.state.piece_cells = "off", "off", 64
        if i == 0:
            model = MemoryRecommender(N_ITEMS, cfg.model.n_oov_buckets, cfg.memory, cfg.model)
        vocab = ItemVocab([f"item{j}" for j in range(N_ITEMS)], cfg.model.n_oov_buckets)
        out.append(
            build_engine(
                cfg, model=copy.deepcopy(model).eval(), vocab=vocab, device="cuda", start=False
            )
        )
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pieces_pipelined_on_the_loop_equal_one_step_after_the_other(tmp_path: Path) -> None:
    """On a GPU the executor computes each piece on a stream of its own while the loop
    copies the previous piece's results to the host (latest events, notes) and gathers the
    next one: the states, notes and latest queries equal those of the same batches applied
    one step after the other on one thread."""
    piped, serial = _gpu_engines(tmp_path, 2)
    rng = np.random.default_rng(5)
    users = [f"user{u}" for u in range(30)]
    batches, ts = [], 1_000_000
    for _ in range(16):
        batch = []
        for k in range(160):
            ts += int(rng.integers(1, 5_000))
            u = users[min(int(rng.zipf(1.4)) - 1, len(users) - 1)]  # a few long users
            item = f"item{int(rng.integers(60))}"
            batch.append(ValidEvent(u, item, ts, int(rng.integers(6)), 1.0, None, 0, k))
        batches.append(batch)
    for b in batches:
        serial.engine.apply(b)
    loop = piped.loop.start()
    try:
        futures = [loop.submit_apply(b) for b in batches]
        assert sum(f.result(120).events for f in futures) == sum(map(len, batches))

        def read(engine):  # type: ignore[no-untyped-def]
            s = engine.snapshot(users)
            return (
                {k: v.cpu() for k, v in s.to_fields().items()},
                [engine.bank.note_count(u) for u in users],
                [None if x is None else x.cpu() for x in engine.recent_queries_many(users, 8)],
            )

        got = loop.read(lambda: read(piped.engine)).result(30)
    finally:
        loop.stop()
    want = read(serial.engine)
    assert got[1] == want[1] and sum(want[1]) > 0
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
