from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from offline_eval.metrics import metrics_from_ranks, target_log_loss, target_ranks


def test_ranks_count_strictly_greater_and_respect_exclusions() -> None:
    scores = torch.tensor(
        [
            [0.9, 0.5, 0.7, 0.1],  # target 1 (0.5): two greater -> rank 2
            [0.2, 0.2, 0.2, 0.2],  # target 3 tied with all -> rank 0
            [0.9, 0.8, 0.7, 0.6],  # target 3; items 0, 1 excluded -> rank 1
            [0.9, 0.8, 0.7, 0.6],  # target 0 excluded too: never masked -> rank 0
        ]
    )
    targets = torch.tensor([1, 3, 3, 0])
    exclude = torch.zeros(4, 4, dtype=torch.bool)
    exclude[2, [0, 1]] = True
    exclude[3, 0] = True
    assert target_ranks(scores.clone(), targets, exclude).tolist() == [2, 0, 1, 0]
    assert target_ranks(scores.clone(), targets).tolist() == [2, 0, 3, 0]


def test_nan_scores_never_look_like_a_good_ranking() -> None:
    """A diverged model (NaN scores) once got NDCG@10 = 1.0: NaN compared as not greater."""
    nan = math.nan
    scores = torch.tensor(
        [
            [nan, nan, nan, nan],  # all NaN -> the target ranks below every item
            [0.9, nan, 0.1, 0.5],  # target 3 (0.5): 0.9 and the NaN item are above -> rank 2
            [0.1, 0.3, nan, 0.2],  # NaN target -> last, exclusions or not
            [0.2, 0.2, 0.2, 0.2],  # ties still count in the target's favour
        ]
    )
    targets = torch.tensor([0, 3, 2, 1])
    assert target_ranks(scores.clone(), targets).tolist() == [4, 2, 4, 0]
    exclude = torch.zeros(4, 4, dtype=torch.bool)
    exclude[1, 1] = exclude[2, 0] = True  # an excluded NaN item does not count
    assert target_ranks(scores.clone(), targets, exclude).tolist() == [4, 1, 4, 0]
    assert metrics_from_ranks(np.array([4, 2, 4, 0]) + 60)["ndcg@10"] == 0.0


def test_metrics_hand_computed() -> None:
    ranks = np.array([0, 1, 9, 10, 49, 50])
    m = metrics_from_ranks(ranks)
    assert m["n"] == 6
    assert m["hr@10"] == pytest.approx(3 / 6)
    assert m["hr@50"] == pytest.approx(5 / 6)
    ndcg = (1.0 + 1 / math.log2(3) + 1 / math.log2(11)) / 6
    assert m["ndcg@10"] == pytest.approx(ndcg)
    assert m["mrr@10"] == pytest.approx((1 + 1 / 2 + 1 / 10) / 6)


def test_empty_is_not_an_error() -> None:
    m = metrics_from_ranks(np.zeros(0, dtype=np.int64))
    assert m["n"] == 0 and m["hr@10"] is None


def test_log_loss() -> None:
    scores = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    loss = target_log_loss(scores, torch.tensor([0, 2]))
    assert loss.tolist() == pytest.approx([math.log(2), -math.log(0.8)], rel=1e-5)
