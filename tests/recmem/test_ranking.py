"""The rank step on a real (small, freshly initialised) memory model: batching does not
change answers, replay and context follow their definitions, cold start, and the live
state is never changed by any number of rank calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recmem.ranking import RankQuery, UserEvents, train_popularity
from tests.recmem.rank_env import EVENTS_PER_USER, N_ITEMS, RankEnv, make_env, user_events


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(a, dtype=torch.int64)[None]


REQUEST_TS = 10**12 + 3_600_000
"""Every request here is asked at this time (after every event of rank_env)."""


@torch.no_grad()
def expected_vector(
    env: RankEnv, user: str, events: UserEvents, context: UserEvents | None = None
) -> torch.Tensor:
    """The user vector after ``events`` on a copy of the user's state, the obvious way: the
    memory read-out after them, read at REQUEST_TS over the window (+ the context)."""
    state = env.engine.snapshot([user])
    mem = state.h
    if len(events):
        mem = env.model.advance(
            _t(events.items), _t(events.actions), _t(events.ts_ms), torch.tensor([len(events)]),
            state.clone(),
        ).state.h  # fmt: skip
    if context is not None:
        state = env.model.push_window(
            state, _t(context.items), _t(context.actions), _t(context.ts_ms),
            torch.tensor([len(context)]),
        )  # fmt: skip
    return env.model.read_user(state, torch.tensor([REQUEST_TS]), mem=mem)[0]


def test_rank_matches_the_user_vector_and_catalog_scores(env: RankEnv) -> None:
    (res,) = env.ranker.rank([RankQuery("user0", k=10, request_ts_ms=REQUEST_TS)])
    vec = expected_vector(env, "user0", UserEvents.empty())
    scores = (env.model.item_weight() @ vec).detach()
    top = torch.topk(scores, 10)
    assert res.items.tolist() == top.indices.tolist()
    np.testing.assert_allclose(res.scores, top.values.numpy(), rtol=1e-5, atol=1e-6)
    assert res.position == EVENTS_PER_USER and not res.cold_start and res.notes_replayed == 0


def test_context_is_applied_after_the_state(env: RankEnv) -> None:
    ctx = user_events(np.random.default_rng(5), 3, t0=10**12)
    q = RankQuery("user1", k=N_ITEMS, context=ctx, request_ts_ms=REQUEST_TS)
    (res,) = env.ranker.rank([q])
    vec = expected_vector(env, "user1", ctx, context=ctx)
    scores = (env.model.item_weight() @ vec).detach().numpy()
    np.testing.assert_allclose(res.scores, scores[res.items], rtol=1e-5, atol=1e-6)
    assert res.context_applied == 3 and res.position == EVENTS_PER_USER


@torch.no_grad()
def routed_notes(env: RankEnv, user: str, query: UserEvents, r: int) -> list[UserEvents]:
    """The route step by hand: q~ of the query events on a copy, then the NoteBank vote."""
    res = env.model.advance(
        _t(query.items), _t(query.actions), _t(query.ts_ms), torch.tensor([len(query)]),
        env.engine.snapshot([user]), return_kq=True,
    )  # fmt: skip
    assert res.kq is not None
    notes = env.engine.bank.route(user, res.kq[1][0], r)
    return [UserEvents(n.items, n.actions, n.ts_ms) for n in notes]


def test_stored_queries_are_the_q_of_the_latest_event(env: RankEnv) -> None:
    """The routing query kept at ingest equals q~ of the user's last event computed from
    scratch over the whole history."""
    h = env.history["user2"]
    with torch.no_grad():
        res = env.model.advance(
            _t(h.items), _t(h.actions), _t(h.ts_ms), torch.tensor([len(h)]),
            env.model.init_state(1, "cpu"), return_kq=True,
        )  # fmt: skip
    assert res.kq is not None
    stored = env.engine.recent_queries("user2", 1)
    assert stored is not None and stored.shape == (1, 2, 2, 16)
    torch.testing.assert_close(stored[0], res.kq[1][0, -1], rtol=1e-4, atol=1e-5)
    recent = env.engine.recent_events("user2", 1)
    assert recent.items.tolist() == h.items[-1:].tolist()


@pytest.mark.parametrize("R", [1, 2, 4])
def test_replay_runs_routed_notes_then_the_query_events(env: RankEnv, R: int) -> None:
    assert env.engine.bank.note_count("user2") >= 4
    q = RankQuery("user2", k=N_ITEMS, replay_notes=R, request_ts_ms=REQUEST_TS)
    (res,) = env.ranker.rank([q])
    n_query = env.cfg.server.replay_query_events
    recent = env.engine.recent_events("user2", n_query)
    stored = env.engine.recent_queries("user2", n_query)
    assert len(recent) == n_query and stored is not None and len(stored) == n_query
    routed = env.engine.bank.route("user2", stored, R)
    notes = [UserEvents(n.items, n.actions, n.ts_ms) for n in routed]
    assert 1 <= len(notes) <= R and res.notes_replayed == len(notes)
    vec = expected_vector(env, "user2", UserEvents.concat([*notes, recent]))
    scores = (env.model.item_weight() @ vec).detach().numpy()
    np.testing.assert_allclose(res.scores, scores[res.items], rtol=1e-5, atol=1e-6)
    (off,) = env.ranker.rank([RankQuery("user2", k=N_ITEMS)])
    assert not np.allclose(np.sort(off.scores), np.sort(res.scores))


def test_replay_with_context_routes_on_the_context(env: RankEnv) -> None:
    ctx = user_events(np.random.default_rng(9), 3, t0=10**12)
    q = RankQuery("user4", k=N_ITEMS, replay_notes=2, context=ctx, request_ts_ms=REQUEST_TS)
    (res,) = env.ranker.rank([q])
    notes = routed_notes(env, "user4", ctx, 2)
    assert res.notes_replayed == len(notes) >= 1
    vec = expected_vector(env, "user4", UserEvents.concat([*notes, ctx]), context=ctx)
    scores = (env.model.item_weight() @ vec).detach().numpy()
    np.testing.assert_allclose(res.scores, scores[res.items], rtol=1e-5, atol=1e-6)


def test_micro_batch_gives_the_same_answers_as_single_requests(env: RankEnv) -> None:
    rng = np.random.default_rng(1)
    queries = [
        RankQuery("user0", k=5),
        RankQuery("user1", k=3, candidates=np.array([4, 9, 17, 33], np.int64)),
        RankQuery("user2", k=8, replay_notes=4),
        RankQuery("user3", k=4, context=user_events(rng, 5, t0=10**12)),
        RankQuery(
            "user4",
            k=6,
            candidates=np.arange(20, 40, dtype=np.int64),
            replay_notes=2,
            context=user_events(rng, 2, t0=10**12),
        ),
        RankQuery("stranger", k=5),
        RankQuery("stranger2", k=5, context=user_events(rng, 4, t0=10**12)),
        RankQuery("user0", k=2, candidates=np.array([1, 2, 3], np.int64)),
    ]
    batch = env.ranker.rank(queries)
    for q, got in zip(queries, batch):
        (alone,) = env.ranker.rank([q])
        assert got.items.tolist() == alone.items.tolist(), q.user_id
        np.testing.assert_allclose(got.scores, alone.scores, rtol=1e-5, atol=1e-6)
        assert (got.position, got.cold_start, got.notes_replayed, got.context_applied) == (
            alone.position,
            alone.cold_start,
            alone.notes_replayed,
            alone.context_applied,
        )
        assert len(got.items) == min(q.k, N_ITEMS if q.candidates is None else len(q.candidates))


def test_cold_start_is_train_popularity_and_context_only_otherwise(env: RankEnv) -> None:
    cold, ctx_only = env.ranker.rank(
        [
            RankQuery("new-user", k=4),
            RankQuery("new-user", k=N_ITEMS, context=user_events(np.random.default_rng(2), 3)),
        ]
    )
    assert cold.cold_start and cold.position == 0
    np.testing.assert_allclose(cold.scores, np.sort(env.popularity)[::-1][:4])
    assert not ctx_only.cold_start and ctx_only.context_applied == 3
    (replayed,) = env.ranker.rank([RankQuery("new-user", k=4, replay_notes=3)])
    assert replayed.cold_start and replayed.notes_replayed == 0
    cands = np.array([40, 5, 17, 3, 22, 59], dtype=np.int64)
    (among,) = env.ranker.rank([RankQuery("new-user", k=3, candidates=cands)])
    expected = sorted(cands.tolist(), key=lambda i: (-env.popularity[i], i))[:3]
    assert among.cold_start and among.items.tolist() == expected


def test_train_popularity_ignores_oov_indices() -> None:
    pop = train_popularity(np.array([0, 0, 1, 5, 7]), 3)
    np.testing.assert_allclose(pop, [2 / 3, 1 / 3, 0.0])


def test_live_state_is_unchanged_by_many_rank_calls(env: RankEnv) -> None:
    users = [f"user{u}" for u in range(6)]
    before = env.engine.snapshot(users)
    notes_before = [env.engine.bank.note_count(u) for u in users]
    tails_before = [env.engine.recent_events(u, 1).items.tolist() for u in users]
    rng = np.random.default_rng(3)
    for i in range(25):
        queries = [
            RankQuery(
                users[(i + j) % 6],
                k=5,
                replay_notes=(i + j) % 3,
                context=user_events(rng, j % 4, t0=10**12),
                candidates=None if j % 2 else np.arange(10, dtype=np.int64),
            )
            for j in range(4)
        ]
        env.ranker.rank(queries)
    after = env.engine.snapshot(users)
    assert [env.engine.bank.note_count(u) for u in users] == notes_before
    assert [env.engine.recent_events(u, 1).items.tolist() for u in users] == tails_before
    for name in ("S", "M", "pos", "last_ts", "h"):
        a, b = getattr(before, name), getattr(after, name)
        assert torch.equal(a, b), name
        assert a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()


def test_step_timers_count_each_step_once(env: RankEnv) -> None:
    """``Ranker.seconds`` times the read-out as its own step, apart from the replay (the
    replay timer used to include it)."""
    before = dict(env.ranker.seconds)
    env.ranker.rank([RankQuery("user1", k=5, request_ts_ms=REQUEST_TS)])
    spent = {k: v - before.get(k, 0.0) for k, v in env.ranker.seconds.items()}
    assert set(spent) == {"snapshot", "route", "replay", "readout", "score"}
    assert all(v >= 0.0 for v in spent.values())
    assert spent["readout"] > 0.0


def test_micro_batch_of_replays_reads_each_users_latest_events(
    env: RankEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context-free replay requests of several users (one twice, a stranger, one with R = 0)
    in one batch: each row routes on and replays its own user's latest events and q~ (the
    batched reads), as the single-request definition gives."""
    monkeypatch.setattr(env.ranker, "cache", None)  # every row takes the latest events
    users = ["user0", "user1", "user2", "user5", "user2", "stranger", "user3"]
    rs = [2, 3, 2, 1, 4, 2, 0]
    queries = [
        RankQuery(u, k=N_ITEMS, replay_notes=r, request_ts_ms=REQUEST_TS)
        for u, r in zip(users, rs, strict=True)
    ]
    batch = env.ranker.rank(queries)
    n_query = env.cfg.server.replay_query_events
    for q, got in zip(queries, batch, strict=True):
        if q.user_id == "stranger" or not q.replay_notes:
            assert got.notes_replayed == 0
            continue
        recent = env.engine.recent_events(q.user_id, n_query)
        stored = env.engine.recent_queries(q.user_id, n_query)
        assert stored is not None
        routed = env.engine.bank.route(q.user_id, stored, q.replay_notes)
        notes = [UserEvents(n.items, n.actions, n.ts_ms) for n in routed]
        assert got.notes_replayed == len(notes) >= 1, q.user_id
        vec = expected_vector(env, q.user_id, UserEvents.concat([*notes, recent]))
        scores = (env.model.item_weight() @ vec).detach().numpy()
        np.testing.assert_allclose(got.scores, scores[got.items], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_joined_padding_equals_concat_then_pad(seed: int) -> None:
    """The replay rows' padded arrays built in one piece equal ``_pad`` of each row's
    ``UserEvents.concat``: rows of 0..4 parts, empty parts, empty rows, int32 parts."""
    from recmem.ranking import _pad, _pad_joined

    rng = np.random.default_rng(seed)

    def part() -> UserEvents:
        n = int(rng.choice([0, 1, 3, 8]))
        dtype = np.int32 if rng.random() < 0.3 else np.int64
        return UserEvents(
            *(rng.integers(0, 10**6, n).astype(dtype) for _ in range(3))  # type: ignore[arg-type]
        )

    rows = [
        [part() for _ in range(int(rng.integers(0, 5)))] for _ in range(int(rng.integers(1, 9)))
    ]
    cpu = torch.device("cpu")
    got = _pad_joined(rows, cpu)
    want = _pad([UserEvents.concat(ps) for ps in rows], cpu)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g, w)
    assert [t.shape for t in _pad_joined([], cpu)] == [t.shape for t in _pad([], cpu)]
