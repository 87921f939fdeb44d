"""Replay-aware training and the offline replay scorer (offline_eval/replay_training.py):
the offline computation equals the served rank path (NotebankScorer: the engine and the
Ranker) for every routing, with a fusion in the way; learned fusions start as "no replay";
routes read only the archive as it stood; no event after a target reaches its vector, its
notes or its unlock decisions (the causality test); the training stage moves what it
should and nothing else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from models.sequences import EventSeqs
from offline_eval.notebank_eval import NotebankScorer
from offline_eval.replay_archive import build_note_archive
from offline_eval.replay_training import (
    QuerySet,
    ReplayScorer,
    ReplaySettings,
    piecewise_states,
    replay_vectors,
    tail_concat,
)
from recmem.config import Config
from recmem.vocab import ItemVocab
from tests.recmem.rank_env import N_ITEMS, small_config, user_events

N_CATS = 7
ITEM_CAT = (np.arange(N_ITEMS) % N_CATS).astype(np.int64)


def make_model(cfg: Config, seed: int = 0, fusion_scale: float = 0.0) -> MemoryRecommender:
    torch.manual_seed(seed)
    model = MemoryRecommender(N_ITEMS, cfg.model.n_oov_buckets, cfg.memory, cfg.model).eval()
    if model.fusion is not None and fusion_scale:
        with torch.no_grad():  # a trained-looking fusion: replay must show in the vectors
            for p in model.fusion.parameters():
                p.normal_(0.0, fusion_scale)
    return model


def histories(n_users: int = 6, n_events: int = 40, seed: int = 0) -> EventSeqs:
    rng = np.random.default_rng(seed)
    hist = [user_events(rng, n_events) for _ in range(n_users)]
    n = n_users * n_events
    return EventSeqs(
        user_ids=[f"user{u}" for u in range(n_users)],
        offsets=np.arange(0, n + 1, n_events, dtype=np.int64),
        items=np.concatenate([h.items for h in hist]),
        actions=np.concatenate([h.actions for h in hist]),
        ts_ms=np.concatenate([h.ts_ms for h in hist]),
        part=np.zeros(n, dtype=np.int64),
        global_idx=np.arange(n, dtype=np.int64),
    )


def rows_from(seqs: EventSeqs, pos: int) -> np.ndarray:
    return np.concatenate(
        [np.arange(seqs.offsets[u] + pos, seqs.offsets[u + 1]) for u in range(seqs.n_users)]
    )


def vocab() -> ItemVocab:
    return ItemVocab([str(i) for i in range(N_ITEMS)], 8)


@pytest.mark.parametrize("routing", ["native", "lexical", "candidates"])
@pytest.mark.parametrize("fusion", ["none", "gate", "lowrank"])
def test_offline_replay_equals_the_served_path(tmp_path: Path, routing: str, fusion: str):
    cfg = small_config(tmp_path / "spill")
    cfg.archive.routing = routing
    cfg.archive.route_candidates = 10
    cfg.model.replay_fusion = fusion
    model = make_model(cfg, fusion_scale=0.3)
    seqs = histories()
    rows = rows_from(seqs, 3)
    served = NotebankScorer(model, cfg, vocab(), replay_notes=2, batch_users=4,
                            item_categories=ITEM_CAT)  # fmt: skip
    offline = ReplayScorer(model, cfg, item_categories=ITEM_CAT, replay_notes=2, batch_users=4)
    want = served.user_vectors(seqs, rows)
    got = offline.user_vectors(seqs, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert offline.stats["replayed"] == served.stats["replayed"] > 0
    assert offline.stats["notes_replayed"] == served.stats["notes_replayed"]
    plain = model.user_vectors(seqs, rows)
    assert (got - plain).abs().amax() > 1e-3  # replay (through the fusion) shows


@pytest.mark.parametrize("fusion", ["gate", "lowrank"])
def test_a_new_fusion_is_no_replay(tmp_path: Path, fusion: str):
    cfg = small_config(tmp_path / "spill")
    cfg.model.replay_fusion = fusion
    model = make_model(cfg)
    seqs = histories()
    rows = rows_from(seqs, 3)
    scorer = ReplayScorer(model, cfg, replay_notes=2)
    torch.testing.assert_close(
        scorer.user_vectors(seqs, rows), model.user_vectors(seqs, rows), atol=1e-5, rtol=1e-5
    )
    assert scorer.stats["replayed"] > 0


def test_routes_read_the_archive_as_it_stood(tmp_path: Path):
    """One archive over whole histories, asked at position p, holds what an archive of the
    first p events holds (notes closed by p, the per-user cap applied), and routes alike."""
    cfg = small_config(tmp_path / "spill")
    cfg.archive.notes_per_user = 5
    model = make_model(cfg)
    seqs = histories()
    users = np.arange(seqs.n_users)
    full = build_note_archive(model, seqs, users, seqs.lengths(), cfg.archive, 0)
    rng = np.random.default_rng(1)
    for p in (7, 8, 9, 23, 31, 40):
        then = build_note_archive(model, seqs, users, np.full(len(users), p), cfg.archive, 0)
        for u in users:
            lo, hi = full.eligible(u, p)
            un, was = full.notes_of(u), then.notes_of(u)
            kept = 0 if was is None else min(len(was), cfg.archive.notes_per_user)
            assert hi - lo == kept, (u, p)
            if not kept:
                continue
            assert un is not None and was is not None
            for a, b in zip(un.items[lo:hi], was.items[-kept:], strict=True):
                assert np.array_equal(a, b)
            np.testing.assert_allclose(un.addresses[lo:hi], was.addresses[-kept:], atol=1e-6)
            assert (un.closed[lo:hi] <= p).all()
            q = rng.standard_normal((3, 4, cfg.archive.address_dim)).astype(np.float32)
            q_full = np.zeros((3, 4, cfg.memory.key_dim), np.float32)
            q_full[..., full.coords] = q
            r1 = full.route_native([u], [p], [q_full], 2)[0]
            r2 = then.route_native([u], [p], [q_full], 2)[0]
            assert (r1.picked + r1.lo).tolist() == (r2.picked + r2.lo).tolist()


def test_tail_concat_keeps_the_latest_rows():
    buf = torch.tensor([[1, 2, 0], [0, 0, 0], [7, 8, 9]])
    new = torch.tensor([[3, 4], [5, 0], [0, 0]])
    out, n = tail_concat(buf, torch.tensor([2, 0, 3]), new, torch.tensor([2, 1, 0]), 3)
    assert out.tolist() == [[2, 3, 4], [5, 0, 0], [7, 8, 9]] and n.tolist() == [3, 1, 3]


def plant_after(seqs: EventSeqs, user: int, row: int, item: int) -> EventSeqs:
    """``seqs`` with one more event of ``user`` right after event ``row`` (1 ms later)."""
    at = row + 1
    offsets = seqs.offsets.copy()
    offsets[user + 1 :] += 1

    def ins(a: np.ndarray, v: int) -> np.ndarray:
        return np.insert(a, at, v)

    return EventSeqs(
        seqs.user_ids, offsets, ins(seqs.items, item), ins(seqs.actions, 1),
        ins(seqs.ts_ms, int(seqs.ts_ms[row]) + 1), ins(seqs.part, 0),
        np.arange(seqs.n_events + 1),
    )  # fmt: skip


@pytest.mark.parametrize("routing", ["native", "lexical"])
def test_causality_no_later_event_reaches_a_target(tmp_path: Path, routing: str):
    """Plant an event right after a target (inside the target's open chunk): the target's
    user vector with replay, the notes routed for it and the unlock decisions of its state
    are the same with and without it, offline (one archive over the whole history) and
    served (the engine replays the stream); later targets do see it."""
    cfg = small_config(tmp_path / "spill")
    cfg.archive.routing = routing
    cfg.memory.unlock = "surprise"
    cfg.memory.unlock_threshold = 0.9
    cfg.memory.horizon = 16  # a decision every 4 events
    cfg.model.replay_fusion = "gate"
    model = make_model(cfg, fusion_scale=0.3)
    seqs = histories()
    user, target_pos = 2, 21  # the target is the 21st event; chunks close at 8, 16, 24
    target_row = int(seqs.offsets[user]) + target_pos - 1
    planted = plant_after(seqs, user, target_row, item=N_ITEMS - 1)
    q_before = np.arange(seqs.offsets[user], target_row)  # queries up to the target's
    q_after = q_before + 0  # same rows: the planted event comes after all of them
    settings = ReplaySettings.from_config(cfg, ITEM_CAT, replay_notes=2)
    for name, scorer_of in (
        ("offline", lambda: ReplayScorer(model, cfg, item_categories=ITEM_CAT, replay_notes=2)),
        (
            "served",
            lambda: NotebankScorer(model, cfg, vocab(), replay_notes=2, item_categories=ITEM_CAT),
        ),  # fmt: skip
    ):
        a = scorer_of().user_vectors(seqs, q_before)
        b = scorer_of().user_vectors(planted, q_after)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    later = np.arange(target_row + 2, seqs.offsets[user + 1] + 1)  # rows after the plant
    moved = ReplayScorer(model, cfg, item_categories=ITEM_CAT, replay_notes=2).user_vectors(
        planted, later
    )
    base = ReplayScorer(model, cfg, item_categories=ITEM_CAT, replay_notes=2).user_vectors(
        seqs, later - 1
    )
    assert (moved - base).abs().amax() > 1e-4  # the planted event does reach later targets

    # the notes and unlock state the target's query used, with and without the plant
    def used(s: EventSeqs) -> tuple[list[list[int]], list[torch.Tensor]]:
        archive = build_note_archive(model, s, np.array([user]), s.lengths()[[user]],
                                     cfg.archive, 0)  # fmt: skip
        positions = np.arange(1, target_pos)  # queries up to the one before the target
        request = np.full(len(positions), int(s.ts_ms[target_row]))
        qs = QuerySet(np.full(len(positions), user), positions, request)
        notes, unlocks = [], []

        def step(qidx, states, f, fl):
            out = replay_vectors(model, s, archive, qs, qidx, states, f, fl, settings)
            for r in out.routed:  # the routed notes' events
                notes.append(archive.replay_events(r)[0].tolist())
            assert states.unlocks is not None and states.unlock_acc is not None
            unlocks.append(torch.cat([states.unlocks.double(), states.unlock_acc.flatten(1)], 1))

        piecewise_states(model, s, qs, settings.query_events, step)
        return notes, unlocks

    n1, u1 = used(seqs)
    n2, u2 = used(planted)
    assert n1 == n2 and any(n1)  # the same notes, and notes were routed
    assert sum(u[0, 0] for u in u1) > 0  # unlock decisions were taken
    for x, y in zip(u1, u2, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def tiny_train_cfg(tmp_path: Path) -> tuple[Config, Path]:
    from tests.offline_eval.test_training import tiny_cfg, write_csv

    csv = tmp_path / "events.csv"
    write_csv(csv, n_users=16, per_user=40)
    cfg = tiny_cfg(tmp_path, f"csv:{csv}")
    cfg.train.epochs = 1
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.address_dim = 8
    return cfg, csv


def test_replay_training_frozen_moves_only_the_fusion(tmp_path: Path):
    from offline_eval.replay_training import train_replay
    from offline_eval.training import prepare_split, train_on_split

    cfg, _ = tiny_train_cfg(tmp_path)
    cfg.model.replay_fusion = "gate"
    split = prepare_split(cfg)
    model, _ = train_on_split(split, cfg, "memory")  # the base (replay_steps = 0)
    assert isinstance(model, MemoryRecommender) and model.fusion is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg.train.replay_steps = 3
    result = train_replay(model, split.seqs, split.train_prefix_lengths(), cfg, split.item_cat)
    assert result.steps == 3 and result.notes > 0
    for k, v in model.state_dict().items():
        if k.startswith("fusion."):
            continue
        assert torch.equal(v, before[k]), k  # the base keeps its weights: replay off is as before
    assert model.fusion.scale.abs().max() > 0  # the fusion learned
    assert all(p.requires_grad for p in model.parameters())  # restored after the stage
    # and through train_on_split, the stage runs after the base training and is recorded
    _, res = train_on_split(split, cfg, "memory")
    assert res.replay["steps"] == 3 and res.replay["notes"] == result.notes


def test_replay_training_joint_with_a_routing_projection(tmp_path: Path):
    from offline_eval.training import prepare_split, train_on_split

    cfg, _ = tiny_train_cfg(tmp_path)
    cfg.model.replay_fusion = "lowrank"
    cfg.model.route_dim = 8
    cfg.train.replay_steps = 2
    cfg.train.replay_freeze = False
    split = prepare_split(cfg)
    torch.manual_seed(0)
    model, result = train_on_split(split, cfg, "memory")
    assert isinstance(model, MemoryRecommender) and model.route_proj is not None
    assert result.replay["steps"] == 2
    w = model.route_proj.weight
    assert ((w != 0) & (w != 1)).any()  # moved off its coordinate selection
    assert all(p.requires_grad for p in model.parameters())  # restored after the stage
    # the served path routes with the learned features and equals the offline scorer
    seqs = split.seqs
    rows = np.flatnonzero(seqs.position_in_user() > 10)[:40]
    served = NotebankScorer(model, cfg, split.vocab, item_categories=split.item_cat)
    offline = ReplayScorer(model, cfg, item_categories=split.item_cat)
    torch.testing.assert_close(
        offline.user_vectors(seqs, rows), served.user_vectors(seqs, rows), atol=1e-4, rtol=1e-4
    )
    assert served.stats["replayed"] > 0


def test_replay_training_needs_something_to_train(tmp_path: Path):
    from offline_eval.training import prepare_split, train_on_split

    cfg, _ = tiny_train_cfg(tmp_path)
    cfg.train.replay_steps = 1
    with pytest.raises(ValueError, match="replay_fusion"):
        train_on_split(prepare_split(cfg), cfg, "memory")
