from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.sequences import EventSeqs
from offline_eval import runner
from offline_eval.notebank_eval import NotebankScorer
from recmem.ranking import RankQuery
from tests.recmem.rank_env import EVENTS_PER_USER, N_ITEMS, RankEnv, make_env


@pytest.fixture
def env(tmp_path: Path) -> RankEnv:
    """6 users x 40 events ingested into the real engine + NoteBank stack (chunks of 8)."""
    return make_env(tmp_path / "spill")


def seqs_of(env: RankEnv) -> EventSeqs:
    users = list(env.history)
    hist = [env.history[u] for u in users]
    n = sum(len(h) for h in hist)
    return EventSeqs(
        user_ids=users,
        offsets=np.r_[0, np.cumsum([len(h) for h in hist])].astype(np.int64),
        items=np.concatenate([h.items for h in hist]),
        actions=np.concatenate([h.actions for h in hist]),
        ts_ms=np.concatenate([h.ts_ms for h in hist]),
        part=np.zeros(n, dtype=np.int64),
        global_idx=np.arange(n, dtype=np.int64),
    )


def query_rows(seqs: EventSeqs, from_pos: int) -> np.ndarray:
    """Every user's rows from position ``from_pos`` (0-based) to its end."""
    return np.concatenate(
        [np.arange(seqs.offsets[u] + from_pos, seqs.offsets[u + 1]) for u in range(seqs.n_users)]
    )


def test_no_notes_equals_plain_model_exactly(env: RankEnv) -> None:
    seqs = seqs_of(env)
    rows = query_rows(seqs, 3)
    plain = env.model.user_vectors(seqs, rows)
    r0 = NotebankScorer(env.model, env.cfg, replay_notes=0).user_vectors(seqs, rows)
    assert torch.equal(r0, plain)
    cfg = copy.deepcopy(env.cfg)
    cfg.archive.chunk_events = 1000  # no chunk ever closes: no notes, the full loop runs
    cfg.archive.window = 2
    scorer = NotebankScorer(env.model, cfg, replay_notes=4, batch_users=4)
    # without notes the rank path reads the live state: the plain vector up to float noise
    torch.testing.assert_close(scorer.user_vectors(seqs, rows), plain, atol=1e-5, rtol=1e-5)
    assert scorer.stats["replayed"] == 0


def test_replay_changes_vectors_and_leaves_live_state(env: RankEnv) -> None:
    seqs = seqs_of(env)
    rows = query_rows(seqs, 3)
    plain = env.model.user_vectors(seqs, rows)
    scorer = NotebankScorer(env.model, env.cfg, replay_notes=2, batch_users=4)
    vec = scorer.user_vectors(seqs, rows)
    changed = (vec - plain).abs().amax(dim=1) > 1e-5
    # the first chunk closes at the 8th event: before it no notes, after it always some
    pos = rows - seqs.offsets[seqs.user_of_event()[rows]]
    assert not changed[torch.as_tensor(pos < 7)].any()
    assert changed[torch.as_tensor(pos >= 7)].all()
    assert scorer.stats["replayed"] == int((pos >= 7).sum())
    # each query alone (fresh archive, fresh state) gives the vector of the joint run
    for i in [0, 10, 37, len(rows) - 1]:
        alone = NotebankScorer(env.model, env.cfg, replay_notes=2).user_vectors(
            seqs, rows[i : i + 1]
        )
        torch.testing.assert_close(alone[0], vec[i], atol=1e-4, rtol=1e-4)


def test_matches_the_service_rank_path(env: RankEnv) -> None:
    """The last event's replayed vector scores the catalog as the live Ranker does after the
    same events came through Engine.apply (R = 2, no context)."""
    seqs = seqs_of(env)
    last = seqs.offsets[1:] - 1
    scorer = NotebankScorer(env.model, env.cfg, replay_notes=2)
    vec = scorer.user_vectors(seqs, last)
    assert scorer.stats["replayed"] == len(last)
    ours = env.model.score(vec)
    res = env.ranker.rank(
        [  # asked at the time offline evaluation uses for a user's last event: its own
            RankQuery(user, k=N_ITEMS, replay_notes=2, request_ts_ms=int(seqs.ts_ms[r]))
            for user, r in zip(seqs.user_ids, last, strict=True)
        ]
    )
    for b, r in enumerate(res):
        assert r.position == EVENTS_PER_USER and r.notes_replayed == 2
        torch.testing.assert_close(
            torch.as_tensor(r.scores), ours[b, torch.as_tensor(r.items)], atol=1e-4, rtol=1e-4
        )


def test_run_eval_end_to_end(tmp_path: Path) -> None:
    from recmem.config import Config

    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.synthetic_users = 30
    cfg.data.synthetic_events = 1500
    cfg.memory.n_layers = 1
    cfg.memory.n_heads = 2
    cfg.memory.key_dim = 8
    cfg.memory.n_blocks = 4
    cfg.memory.horizon = 32
    cfg.memory.value_dim = 8
    cfg.model.embed_dim = 16
    cfg.train.epochs = 1
    cfg.train.device = "cpu"
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.replay_notes = 2
    models = ["memory-proteus", "memory-proteus-notebank"]
    summary = runner.run_eval(cfg, "synthetic", models, tmp_path / "o", write_report=False)
    on_disk = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert on_disk["models"].keys() == set(models)
    nb, mp = summary["models"]["memory-proteus-notebank"], summary["models"]["memory-proteus"]
    assert nb["overall"]["n"] == mp["overall"]["n"] == summary["split"]["n_test_targets"] > 0
    assert 0.0 <= nb["overall"]["ndcg@10"] <= 1.0
    assert nb["config"]["notebank"]["replay_notes"] == 2
    assert nb["config"]["notebank"]["archive"]["chunk_events"] == 8
    stats = nb["config"]["notebank"]["stats"]
    assert stats["queries"] >= nb["overall"]["n"] and stats["replayed"] > 0
    # one training serves both: the same weights underneath, replay makes the difference
    assert nb["config"]["reused_training"] and not mp["config"]["reused_training"]
    assert nb["config"]["best_valid"] == mp["config"]["best_valid"]
    by_pos = json.loads((tmp_path / "o" / "by_position.json").read_text())
    loss = {m: [b["loss"] for b in by_pos[m].values() if b["n"]] for m in models}
    assert loss["memory-proteus"] != loss["memory-proteus-notebank"]
