import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from models.sequences import EventSeqs
from recmem.archive.tuning import archive_grid, evidence_recall, evidence_recall_grid
from recmem.config import ArchiveConfig, MemoryConfig, ModelConfig


def _seqs(lengths: list[int], n_items: int, seed: int = 0) -> EventSeqs:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ts = np.concatenate([np.sort(rng.integers(0, 10**9, size=m)) for m in lengths])
    return EventSeqs(
        user_ids=[f"u{i}" for i in range(len(lengths))],
        offsets=offsets,
        items=rng.integers(0, n_items, size=n).astype(np.int64),
        actions=rng.integers(0, 6, size=n).astype(np.int64),
        ts_ms=ts.astype(np.int64),
        part=np.zeros(n, dtype=np.int64),
        global_idx=np.arange(n, dtype=np.int64),
    )


def test_evidence_recall_flags_are_consistent():
    torch.manual_seed(0)
    mem = MemoryConfig(n_layers=1, n_heads=2, key_dim=16, value_dim=8, n_blocks=2, horizon=16)
    model = MemoryRecommender(30, 4, mem, ModelConfig(embed_dim=16))
    seqs = _seqs([70, 5, 40], n_items=30)
    cfg = ArchiveConfig(
        chunk_events=8, window=2, spans_per_chunk=2, max_span=3, address_dim=8, replay_notes=2
    )
    rows = np.array([0, 10, 50, 69, 70, 72, 75 + 39, 75 + 20])
    rep = evidence_recall(model, seqs, rows, cfg, event_keys=seqs.items % 5)
    assert sorted(rep.rows.tolist()) == sorted([10, 50, 69, 72, 114, 95])  # first events dropped
    for f in (rep.routed, rep.recent, rep.random):
        assert not np.any(f & ~rep.archived)
    notes_at = dict(zip(rep.rows.tolist(), rep.notes.tolist()))
    assert notes_at[72] == 0 and not rep.archived[rep.rows == 72].any()
    assert notes_at[69] == 2 * (69 // 8)  # W=2 notes per closed chunk of 8
    assert notes_at[10] == 2
    s = rep.summary()
    assert s["targets"] == 6 and 0 <= s["routed"] <= s["archived"] <= 1
    assert rep.summary(rep.rows > 1000)["targets"] == 0


def test_archive_grid():
    grid = archive_grid(ArchiveConfig(), max_span=[4, 8], replay_notes=[1, 2, 4])
    assert len(grid) == 6 and {(c.max_span, c.replay_notes) for c in grid} == {
        (b, r) for b in (4, 8) for r in (1, 2, 4)
    }
    with pytest.raises(ValueError, match="unknown archive fields"):
        archive_grid(ArchiveConfig(), nope=[1])


def test_grid_runs_each_config_like_a_single_run():
    torch.manual_seed(1)
    mem = MemoryConfig(n_layers=1, n_heads=2, key_dim=16, value_dim=8, n_blocks=2, horizon=16)
    model = MemoryRecommender(30, 4, mem, ModelConfig(embed_dim=16))
    seqs = _seqs([50, 33], n_items=30, seed=2)
    rows = np.arange(1, 83)
    cfgs = archive_grid(
        ArchiveConfig(window=2, address_dim=8), chunk_events=[8, 16], replay_notes=[1, 3]
    )
    grid = evidence_recall_grid(model, seqs, rows, cfgs, event_keys=seqs.items % 4)
    for c, rep in zip(cfgs, grid):
        one = evidence_recall(model, seqs, rows, c, event_keys=seqs.items % 4)
        np.testing.assert_array_equal(rep.routed, one.routed)
        np.testing.assert_array_equal(rep.archived, one.archived)
        np.testing.assert_array_equal(rep.notes, one.notes)
