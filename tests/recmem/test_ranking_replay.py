"""The rank step with the replay mechanisms of issue 12: a learned fusion of the live and
replayed read-outs (with and without context), lexical and candidate-aware routing, and
micro-batches that give every request its answer alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recmem.archive.routing import overlap_weights
from recmem.config import Config
from recmem.ranking import RankQuery, UserEvents
from tests.recmem.rank_env import N_ITEMS, RankEnv, make_env, user_events
from tests.recmem.test_ranking import REQUEST_TS, _t

CATS = (np.arange(N_ITEMS) % 5).astype(np.int64)


def fused_env(tmp: Path, routing: str) -> RankEnv:
    def edit(cfg: Config) -> None:
        cfg.model.replay_fusion = "gate"
        cfg.archive.routing = routing
        cfg.archive.route_candidates = 7

    env = make_env(tmp, edit=edit, item_categories=CATS)
    assert env.model.fusion is not None
    with torch.no_grad():  # a fusion far from "no replay"
        for p in env.model.fusion.parameters():
            p.normal_(0.0, 0.5)
    return env


@torch.no_grad()
def readout(env: RankEnv, user: str, events: UserEvents) -> torch.Tensor:
    state = env.engine.snapshot([user])
    return env.model.advance(
        _t(events.items), _t(events.actions), _t(events.ts_ms), torch.tensor([len(events)]),
        state,
    ).state.h  # fmt: skip


@torch.no_grad()
def fused_vector(env: RankEnv, user: str, notes: list[UserEvents], query: UserEvents,
                 context: UserEvents | None) -> torch.Tensor:  # fmt: skip
    """The fused user vector by hand: live read-out (after the context, if any), replayed
    read-out (notes, then the query events), the head over the window (+ context)."""
    state = env.engine.snapshot([user])
    live = state.h if context is None else readout(env, user, context)
    replayed = readout(env, user, UserEvents.concat([*notes, query]))
    if context is not None:
        state = env.model.push_window(
            state, _t(context.items), _t(context.actions), _t(context.ts_ms),
            torch.tensor([len(context)]),
        )  # fmt: skip
    return env.model.read_user(
        state, torch.tensor([REQUEST_TS]), mem=live, replayed=replayed,
        replayed_ok=torch.tensor([bool(notes)]),
    )[0]  # fmt: skip


def check(env: RankEnv, q: RankQuery, notes: list[UserEvents], query: UserEvents,
          context: UserEvents | None) -> None:  # fmt: skip
    (res,) = env.ranker.rank([q])
    assert res.notes_replayed == len(notes) >= 1
    vec = fused_vector(env, q.user_id, notes, query, context)
    scores = (env.model.item_weight() @ vec).detach().numpy()
    np.testing.assert_allclose(res.scores, scores[res.items], rtol=1e-5, atol=1e-6)
    (off,) = env.ranker.rank([RankQuery(q.user_id, k=N_ITEMS, context=q.context,
                                        request_ts_ms=REQUEST_TS)])  # fmt: skip
    assert not np.allclose(np.sort(off.scores), np.sort(res.scores))  # the fusion shows


def test_fusion_reads_live_and_replayed(tmp_path: Path) -> None:
    env = fused_env(tmp_path, "native")
    n_query = env.cfg.server.replay_query_events
    q = RankQuery("user2", k=N_ITEMS, replay_notes=2, request_ts_ms=REQUEST_TS)
    recent = env.engine.recent_events("user2", n_query)
    stored = env.engine.recent_queries("user2", n_query)
    notes = [UserEvents(n.items, n.actions, n.ts_ms)
             for n in env.engine.bank.route("user2", stored, 2)]  # fmt: skip
    check(env, q, notes, recent, None)
    # with context: the live read-out is the context's, the replay runs notes then context
    ctx = user_events(np.random.default_rng(9), 3, t0=10**12)
    q = RankQuery("user4", k=N_ITEMS, replay_notes=2, context=ctx, request_ts_ms=REQUEST_TS)
    with torch.no_grad():
        res = env.model.advance(_t(ctx.items), _t(ctx.actions), _t(ctx.ts_ms),
                                torch.tensor([3]), env.engine.snapshot(["user4"]),
                                return_kq=True)  # fmt: skip
    assert res.kq is not None
    notes = [UserEvents(n.items, n.actions, n.ts_ms)
             for n in env.engine.bank.route("user4", res.kq[1][0], 2)]  # fmt: skip
    check(env, q, notes, ctx, ctx)


@pytest.mark.parametrize("routing", ["lexical", "candidates"])
def test_overlap_routing(tmp_path: Path, routing: str) -> None:
    env = fused_env(tmp_path, routing)
    n_query = env.cfg.server.replay_query_events
    recent = env.engine.recent_events("user1", n_query)
    cand = np.array([3, 8, 13, 21, 40], dtype=np.int64)
    if routing == "lexical":
        item_w, cat_w = overlap_weights(recent.items, CATS)
        q = RankQuery("user1", k=N_ITEMS, replay_notes=3, request_ts_ms=REQUEST_TS)
    else:
        item_w, cat_w = overlap_weights(cand, CATS, with_items=False)
        assert not item_w and set(cat_w) == {3, 1, 0}
        q = RankQuery("user1", k=5, candidates=cand, replay_notes=3, request_ts_ms=REQUEST_TS)
    (routed,) = env.engine.bank.route_overlap_many([("user1", item_w, cat_w, 3)], CATS)
    notes = [UserEvents(n.items, n.actions, n.ts_ms) for n in routed]
    for n in notes:  # every routed note overlaps
        assert any(int(i) in item_w or int(CATS[i]) in cat_w for i in n.items)
    if routing == "lexical":
        check(env, q, notes, recent, None)
    else:
        (res,) = env.ranker.rank([q])
        assert res.notes_replayed == len(notes) >= 1
        vec = fused_vector(env, "user1", notes, recent, None)
        scores = (env.model.item_weight()[torch.as_tensor(cand)] @ vec).detach().numpy()
        got = dict(zip(res.items.tolist(), res.scores.tolist(), strict=True))
        for i, c in enumerate(cand.tolist()):
            assert got[c] == pytest.approx(float(scores[i]), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("routing", ["native", "lexical", "candidates"])
def test_micro_batches_with_fusion_equal_single_requests(tmp_path: Path, routing: str) -> None:
    env = fused_env(tmp_path, routing)
    rng = np.random.default_rng(2)
    queries = [
        RankQuery("user0", k=5, replay_notes=2),
        RankQuery("user1", k=3, candidates=np.array([4, 9, 17, 33], np.int64), replay_notes=1),
        RankQuery("user2", k=8),
        RankQuery("user3", k=4, replay_notes=3, context=user_events(rng, 5, t0=10**12)),
        RankQuery("user5", k=6, context=user_events(rng, 2, t0=10**12)),
        RankQuery("stranger", k=5, replay_notes=2),
    ]
    batch = env.ranker.rank(queries)
    assert sum(r.notes_replayed for r in batch) > 0
    for q, got in zip(queries, batch, strict=True):
        (alone,) = env.ranker.rank([q])
        assert got.items.tolist() == alone.items.tolist(), q.user_id
        np.testing.assert_allclose(got.scores, alone.scores, rtol=1e-5, atol=1e-6)
        assert got.notes_replayed == alone.notes_replayed
