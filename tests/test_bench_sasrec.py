"""bench/bench_rank.py's SASRec baseline: one batched forward per micro-batch answers as one
forward per request does (the same top-k, scores within float noise), for candidate lists,
the catalog, context events, unknown users and histories longer than the window."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from models.sasrec import SASRec, SASRecConfig
from recmem.ranking import RankQuery, UserEvents

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_rank import SASRecRanker  # noqa: E402


def _queries(rng: np.random.Generator, n_items: int, catalog: bool) -> list[RankQuery]:
    out = []
    for i in range(24):
        n = int(rng.integers(0, 3))
        ctx = UserEvents(rng.integers(0, n_items, n), np.zeros(n, np.int64), np.zeros(n, np.int64))
        cand = None if catalog else rng.choice(n_items, 50, replace=False).astype(np.int64)
        out.append(RankQuery(f"u{i}", 10, cand, context=ctx))
    out.append(RankQuery("stranger", 10, None if catalog else np.arange(50, dtype=np.int64)))
    return out


def test_batched_sasrec_ranks_as_one_forward_per_request() -> None:
    torch.manual_seed(0)
    n_items = 300
    model = SASRec(n_items, 4, SASRecConfig()).eval()
    rng = np.random.default_rng(0)
    history = {f"u{i}": rng.integers(0, n_items, int(rng.integers(0, 260))) for i in range(24)}
    for catalog in (False, True):
        qs = _queries(rng, n_items, catalog)
        want = SASRecRanker(model, history, per_request=True).rank(qs)
        got = SASRecRanker(model, history).rank(qs)
        for a, b in zip(want, got, strict=True):
            assert a.items.tolist() == b.items.tolist()
            np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)
            assert (a.position, a.cold_start, a.context_applied) == (
                b.position, b.cold_start, b.context_applied,
            )  # fmt: skip
