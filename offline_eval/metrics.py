"""Full-ranking metrics (never sampled): HR@10, NDCG@10, MRR@10, HR@50.

The target's rank is the number of allowed items whose score is STRICTLY greater than the
target's score (0 = top). Ties therefore count in the target's favour; a model that gives
every item the same score gets rank 0 for every target, so scorers must break ties in their
scores if that matters (Pop adds a tiny id-based tie-break). Excluded items (already seen by
the user, when the protocol says so) never count; the target itself is never excluded.
A NaN score (a diverged model) counts against the model: a NaN item ranks above the target,
and a NaN target ranks below every item, so NaN can never look like a perfect ranking.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

METRIC_KEYS = ("hr@10", "ndcg@10", "mrr@10", "hr@50")


def target_ranks(
    scores: torch.Tensor, targets: torch.Tensor, exclude: torch.Tensor | None = None
) -> torch.Tensor:
    """[n] int64 0-based rank of each target among the non-excluded items.

    scores [n, n_items] (excluded entries are set to -inf in place); targets [n];
    exclude: bool [n, n_items], True = not ranked (ignored where it hits the target).
    """
    idx = torch.arange(scores.shape[0], device=scores.device)
    target_score = scores[idx, targets].clone()
    if exclude is not None:
        scores.masked_fill_(exclude, -math.inf)
        scores[idx, targets] = target_score
    # not (score <= target) = above the target, NaN on either side included; ties stay below
    return (~(scores <= target_score.unsqueeze(1))).sum(dim=1)


def target_log_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] cross-entropy -log softmax(scores)[target] over the non-excluded items
    (excluded items carry -inf scores and so no probability)."""
    wide = scores if scores.dtype == torch.float64 else scores.float()
    logp = torch.log_softmax(wide, dim=1)
    return -logp[torch.arange(scores.shape[0], device=scores.device), targets]


def metrics_from_ranks(ranks: np.ndarray | torch.Tensor) -> dict[str, float | int | None]:
    """HR@10, NDCG@10, MRR@10, HR@50 (means over targets) and n. With n = 0 the metric
    values are None (JSON null), never an error."""
    r = ranks.detach().cpu().numpy() if isinstance(ranks, torch.Tensor) else np.asarray(ranks)
    n = int(r.shape[0])
    if n == 0:
        return {**{k: None for k in METRIC_KEYS}, "n": 0}
    r = r.astype(np.float64)
    top10 = r < 10
    return {
        "hr@10": float(top10.mean()),
        "ndcg@10": float(np.where(top10, 1.0 / np.log2(r + 2.0), 0.0).mean()),
        "mrr@10": float(np.where(top10, 1.0 / (r + 1.0), 0.0).mean()),
        "hr@50": float((r < 50).mean()),
        "n": n,
    }


def mean_metrics(parts: Mapping[str, np.ndarray]) -> dict[str, dict[str, float | int | None]]:
    """metrics_from_ranks for each named group of ranks."""
    return {name: metrics_from_ranks(r) for name, r in parts.items()}
