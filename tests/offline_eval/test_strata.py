from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from models.sequences import EventSeqs
from offline_eval.split import strict_time_split
from offline_eval.strata import assign_strata, gap_to_previous, position_buckets
from recmem.config import DataConfig
from recmem.datasets import Dataset, load_dataset


def _seqs(lengths: list[int], items: list[int]) -> EventSeqs:
    n = sum(lengths)
    z = np.zeros(n, dtype=np.int64)
    return EventSeqs(
        [str(i) for i in range(len(lengths))],
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.array(items, dtype=np.int64),
        z,
        z,
        z,
        np.arange(n),
    )


def test_strata_hand_made_history() -> None:
    # user 0: keys 5 7 5 9 8 7 | user 1: keys 7 3 7 (key 7 of user 0 never leaks into user 1)
    seqs = _seqs([6, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2])
    cat = np.array([5, 7, 5, 9, 8, 7, 7, 3, 7])
    assert gap_to_previous(seqs, cat).tolist() == [-1, -1, 2, -1, -1, 4, -1, -1, 2]
    rows = np.array([2, 3, 5, 6, 8])
    m = assign_strata(seqs, cat, rows, recent_window=3, repeat_gap=50, with_repeat=False)
    assert m["recent"].tolist() == [True, False, False, False, True]
    assert m["long_term"].tolist() == [False, False, True, False, False]
    assert m["new"].tolist() == [False, True, False, True, False]
    assert not m["repeat"].any()
    total = m["recent"].astype(int) + m["long_term"] + m["new"]
    assert (total == 1).all()


def test_repeat_rule() -> None:
    # items 1 2 3 1 2 1: item 1 at row 3 last seen 3 events earlier, at row 5 2 earlier
    seqs = _seqs([6], [1, 2, 3, 1, 2, 1])
    cat = np.zeros(6, dtype=np.int64)
    rows = np.array([3, 4, 5])
    m = assign_strata(seqs, cat, rows, recent_window=20, repeat_gap=2, with_repeat=True)
    assert m["repeat"].tolist() == [True, True, False]


def test_whole_set_keys_on_split(tiny: Dataset) -> None:
    s = strict_time_split(tiny, 4, 0.8, 0.9)
    valid = s.targets("valid")
    test = s.targets("test")
    mv = assign_strata(s.seqs, s.event_cat, valid.rows, recent_window=20)
    # c saw 'X|Z' and now 'X': a different whole-set key -> NEW, not RECENT
    assert mv["new"].tolist() == [True]
    mt = assign_strata(s.seqs, s.event_cat, test.rows, recent_window=2, repeat_gap=2)
    # b saw key Y 3 events earlier (outside a window of 2) and item i2 3 events earlier
    assert mt["long_term"].tolist() == [True] and mt["repeat"].tolist() == [True]


def test_position_buckets() -> None:
    pos = np.array([1, 10, 11, 50, 51, 200, 201, 500, 501, 5000])
    assert position_buckets(pos).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.slow
def test_ml1m_test_strata_shares() -> None:
    """SPEC section 7: whole-set keys split ML-1M TEST targets about 50 / 27 / 23."""
    cache = Path(os.environ.get("RECMEM_TEST_CACHE", "~/.cache/recmem")).expanduser()
    split = strict_time_split(load_dataset("ml-1m", DataConfig(cache_dir=str(cache))), 64)
    t = split.targets("test")
    assert (t.n, t.excluded_cold_item, t.excluded_first_event) == (99_894, 98, 29)
    m = assign_strata(split.seqs, split.event_cat, t.rows, with_repeat=split.has_repeats)
    shares = [float(m[k].mean()) for k in ("recent", "long_term", "new")]
    assert shares == pytest.approx([0.496, 0.273, 0.231], abs=0.005)
    assert not m["repeat"].any()
