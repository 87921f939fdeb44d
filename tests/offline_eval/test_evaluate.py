from __future__ import annotations

import numpy as np
import pytest
import torch

from models.sequences import EventSeqs
from offline_eval.baselines import PopScorer
from offline_eval.evaluate import evaluate
from offline_eval.split import TimeSplit, strict_time_split
from recmem.config import EvalConfig

from .conftest import make_dataset


class LastItemScorer:
    """Scores item j by (j == the user's item at the query row): one-hot user vectors."""

    def __init__(self, split: TimeSplit) -> None:
        self.n = split.n_items
        self.calls: list[int] = []

    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        self.calls.append(len(query_rows))
        out = torch.zeros(len(query_rows), self.n)
        items = seqs.items[query_rows]
        known = items < self.n
        out[np.flatnonzero(known), items[known]] = 1.0
        return out

    def item_matrix(self) -> torch.Tensor:
        return torch.eye(self.n) + torch.arange(self.n).flip(0).unsqueeze(1) * 1e-3


def _split() -> TimeSplit:
    rng = np.random.default_rng(0)
    rows = [
        (f"u{u}", f"i{int(rng.integers(0, 30))}", int(t), f"c{int(rng.integers(0, 4))}")
        for t, u in enumerate(rng.integers(0, 12, size=400))
    ]
    return strict_time_split(make_dataset(rows, "rand"), 8, 0.6, 0.8)


def test_pop_matches_direct_computation() -> None:
    split = _split()
    cfg = EvalConfig(exclude_seen="no")
    res = evaluate(PopScorer(split), split, "test", cfg, batch_users=3, return_per_target=True)
    t = split.targets("test", "no")
    counts = np.bincount(split.seqs.items[split.seqs.part == 0], minlength=split.n_items)
    order = sorted(range(split.n_items), key=lambda i: (-counts[i], i))
    expected = np.array([order.index(i) for i in t.items])
    assert np.array_equal(res["per_target"]["ranks"], expected)
    assert res["overall"]["n"] == t.n == res["n_targets"]
    assert res["overall"]["hr@10"] == pytest.approx(float((expected < 10).mean()))
    assert sum(res[k]["n"] for k in ("recent", "long_term", "new")) == t.n
    assert res["excluded_cold_item"] == t.excluded_cold_item
    assert res["loss"] > 0


def test_exclusion_and_user_chunks() -> None:
    split = _split()
    scorer = LastItemScorer(split)
    yes = evaluate(
        scorer,
        split,
        "test",
        EvalConfig(exclude_seen="yes"),
        batch_users=5,
        return_per_target=True,
        progress=False,
    )
    assert max(scorer.calls) <= yes["n_targets"] and len(scorer.calls) >= 2
    no = evaluate(
        scorer,
        split,
        "test",
        EvalConfig(exclude_seen="no"),
        batch_users=5,
        return_per_target=True,
        progress=False,
    )
    # excluding seen items can only improve ranks
    assert (yes["per_target"]["ranks"] <= no["per_target"]["ranks"]).all()
    assert (yes["per_target"]["ranks"] < no["per_target"]["ranks"]).any()
    # brute force for the 'yes' ranks
    t = split.targets("test", "yes")
    items = scorer.item_matrix()
    for j in range(t.n):
        s = scorer.user_vectors(split.seqs, t.query_rows[j : j + 1])[0] @ items.T
        seen = split.seqs.items[t.seen_start[j] : t.query_rows[j] + 1]
        seen = [i for i in seen if i < split.n_items and i != t.items[j]]
        s[seen] = -np.inf
        assert yes["per_target"]["ranks"][j] == int((s > s[t.items[j]]).sum())
