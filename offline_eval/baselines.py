"""Pop: the TRAIN-popularity baseline, as a :class:`offline_eval.evaluate.Scorer` with D = 1.

Score of item i = log(1 + TRAIN count of i) minus a tie-break below the smallest gap between
distinct counts (lower vocabulary index wins ties), in float64 so the tie-break survives. The
softmax of the scores is (almost exactly) the smoothed popularity distribution, so the
per-target loss is meaningful too.
"""

from __future__ import annotations

import numpy as np
import torch

from models.sequences import EventSeqs
from offline_eval.split import TimeSplit


def train_popularity(split: TimeSplit) -> np.ndarray:
    """[n_items] TRAIN interaction count of every vocabulary item."""
    seqs = split.seqs
    train_items = seqs.items[(seqs.part == 0) & (seqs.items < split.n_items)]
    return np.bincount(train_items, minlength=split.n_items).astype(np.float64)


class PopScorer:
    """Same ranking for every user: TRAIN popularity."""

    def __init__(self, split: TimeSplit) -> None:
        counts = train_popularity(split)
        self.counts = counts
        n = max(1, split.n_items)
        min_gap = np.log1p(counts.max() + 1.0) - np.log1p(counts.max()) if counts.size else 1.0
        tie_break = 0.5 * min_gap * np.arange(split.n_items) / n
        self._items = torch.from_numpy(np.log1p(counts) - tie_break).unsqueeze(1)

    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        return torch.ones(len(query_rows), 1, dtype=torch.float64)

    def item_matrix(self) -> torch.Tensor:
        return self._items


def make_pop(split: TimeSplit, cfg: object) -> tuple[PopScorer, float, dict[str, object]]:
    """Registry factory: (scorer, train_seconds, config)."""
    import time

    t0 = time.perf_counter()
    scorer = PopScorer(split)
    return scorer, time.perf_counter() - t0, {"kind": "pop", "score": "log1p(train count)"}
