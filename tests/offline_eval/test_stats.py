"""offline_eval.stats: per-target NDCG@10, the paired bootstrap interval, seed spread."""

from __future__ import annotations

import time

import numpy as np
import pytest

from offline_eval.metrics import metrics_from_ranks
from offline_eval.stats import (
    _means_by_index,
    _means_by_value,
    ndcg10_per_target,
    paired_bootstrap,
    spread,
)


def test_ndcg10_per_target_matches_the_metric() -> None:
    ranks = np.array([0, 1, 9, 10, 500])
    per = ndcg10_per_target(ranks)
    assert per[0] == 1.0 and per[1] == pytest.approx(1 / np.log2(3))
    assert per[2] == pytest.approx(1 / np.log2(11)) and per[3] == 0.0 and per[4] == 0.0
    assert per.mean() == pytest.approx(metrics_from_ranks(ranks)["ndcg@10"])


def test_identical_models_give_zero_interval() -> None:
    ranks = np.random.default_rng(0).integers(0, 40, size=5000)
    a = ndcg10_per_target(ranks)
    out = paired_bootstrap(a, a.copy())
    assert out == {"diff": 0.0, "lo": 0.0, "hi": 0.0, "n": 5000}


def test_better_on_every_target_lies_above_zero() -> None:
    rng = np.random.default_rng(1)
    b = ndcg10_per_target(rng.integers(1, 12, size=3000))
    a = ndcg10_per_target(np.zeros(3000, dtype=np.int64))  # rank 0 everywhere: 1.0 > b
    assert (a > b).all()
    out = paired_bootstrap(a, b)
    assert out["diff"] is not None and out["lo"] is not None and out["hi"] is not None
    assert 0.0 < out["lo"] <= out["diff"] <= out["hi"]
    worse = paired_bootstrap(b, a)
    assert worse["hi"] is not None and worse["hi"] < 0.0


def test_small_example_by_hand() -> None:
    # differences [0, 0, 0, 1]: a resample's mean is k / 4 with k ~ Binomial(4, 1/4):
    # P(k <= 0) = 81/256 = 0.316 > 0.025, so the 2.5 % quantile is 0;
    # P(k <= 2) = 243/256 = 0.949 < 0.975 <= P(k <= 3) = 255/256, so the 97.5 % one is 3/4
    a = np.array([0.5, 0.2, 0.0, 1.0])
    b = np.array([0.5, 0.2, 0.0, 0.0])
    out = paired_bootstrap(a, b, resamples=4000, seed=3)
    assert out == {"diff": 0.25, "lo": 0.0, "hi": 0.75, "n": 4}
    # two targets, differences [0, 1]: means 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4
    out = paired_bootstrap(np.array([1.0, 1.0]), np.array([1.0, 0.0]))
    assert (out["lo"], out["hi"]) == (0.0, 1.0)


def test_both_resampling_ways_draw_the_same_distribution() -> None:
    # the mean of n draws of a 0/1 difference with P(1) = p: mean p, std sqrt(p (1 - p) / n)
    n, p = 4000, 0.3
    d = np.zeros(n)
    d[: int(p * n)] = 1.0
    values, counts = np.unique(d, return_counts=True)
    by_value = _means_by_value(values, counts, 20000, np.random.default_rng(0))
    by_index = _means_by_index(d, 20000, np.random.default_rng(1))
    sd = np.sqrt(p * (1 - p) / n)
    for means in (by_value, by_index):
        assert means.mean() == pytest.approx(p, abs=4 * sd / np.sqrt(20000))
        assert means.std() == pytest.approx(sd, rel=0.03)
    q = [0.025, 0.975]
    assert np.quantile(by_value, q) == pytest.approx(np.quantile(by_index, q), abs=0.2 * sd)


def test_fixed_seed_and_speed_on_100k_targets() -> None:
    rng = np.random.default_rng(2)
    a = ndcg10_per_target(rng.geometric(0.05, size=100_000) - 1)
    b = ndcg10_per_target(rng.geometric(0.06, size=100_000) - 1)
    t0 = time.perf_counter()
    first = paired_bootstrap(a, b)
    assert time.perf_counter() - t0 < 5.0
    assert paired_bootstrap(a, b) == first
    assert first["lo"] < first["diff"] < first["hi"]  # type: ignore[operator]
    # all distinct differences take the index path: still seconds, still centred
    x, y = rng.random(100_000), rng.random(100_000)
    t0 = time.perf_counter()
    out = paired_bootstrap(x, y)
    assert time.perf_counter() - t0 < 20.0
    assert out["lo"] < out["diff"] < out["hi"]  # type: ignore[operator]


def test_empty_and_mismatched_inputs() -> None:
    assert paired_bootstrap(np.zeros(0), np.zeros(0))["lo"] is None
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros(3), np.zeros(4))


def test_spread() -> None:
    s = spread([0.1, 0.2, 0.3])
    assert s["mean"] == pytest.approx(0.2) and s["std"] == pytest.approx(0.1)
    assert (s["min"], s["max"], s["n"]) == (0.1, 0.3, 3)
    assert spread([0.25]) == {"mean": 0.25, "std": 0.0, "min": 0.25, "max": 0.25, "n": 1}
    assert spread([0.1, None])["mean"] is None
