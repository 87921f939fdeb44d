from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from offline_eval.split import TimeSplit, split_bounds, strict_time_split
from recmem.datasets import Dataset

from .conftest import make_dataset


def test_bounds_are_floors() -> None:
    assert split_bounds(10, 0.8, 0.9) == (8, 9)
    assert split_bounds(1_000_209, 0.8, 0.9) == (800_167, 900_188)
    with pytest.raises(ValueError):
        split_bounds(10, 0.9, 0.8)


def test_split_boundaries_with_ties(tiny: Dataset) -> None:
    s = strict_time_split(tiny, 4, 0.8, 0.9)
    assert (s.n_events, s.n_train) == (10, 8)
    # a/i4@8 is TRAIN (index 7), c/i1@8 is VALID (index 8): the tie is cut by (user, item)
    assert (s.boundary_valid_ts, s.boundary_test_ts) == (8, 9)
    assert s.seqs.user_ids == ["a", "b", "c"]
    assert s.vocab.item_ids == ["i1", "i2", "i3", "i4"]
    assert s.seqs.offsets.tolist() == [0, 4, 8, 10]
    assert s.seqs.part.tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 0, 1]
    assert s.seqs.global_idx.tolist() == [0, 2, 4, 7, 1, 5, 6, 9, 3, 8]
    assert s.seqs.ts_ms.tolist() == [1, 3, 5, 8, 2, 5, 6, 9, 4, 8]
    assert s.train_prefix_lengths().tolist() == [4, 3, 1]
    assert s.has_repeats  # b sees i2 twice
    # whole-set category keys; a missing category is the item's own key
    keys = [s.cat_keys[k] for k in s.item_cat]
    assert keys == ["X", "Y", "X|Z", "#i4"]


def test_targets_exclusions_and_query_rows() -> None:
    rows = [
        ("u", "a", 1, None),
        ("u", "b", 2, None),
        ("v", "a", 3, None),
        ("u", "c", 4, None),
        ("w", "a", 5, None),
        ("u", "a", 6, None),
        ("v", "z", 7, None),
        ("v", "b", 8, None),
        ("x", "a", 9, None),
        ("u", "b", 10, None),
    ]
    s = strict_time_split(make_dataset(rows), 2, 0.5, 0.7)
    # TRAIN = first 5 events (items a, b, c); VALID idx 5, 6; TEST idx 7, 8, 9
    valid = s.targets("valid", "no")
    test = s.targets("test", "no")
    assert valid.n == 1 and valid.excluded_cold_item == 1 and valid.excluded_first_event == 0
    assert test.excluded_first_event == 1  # x's only event
    assert test.excluded_cold_item == 0 and test.n == 2
    assert np.array_equal(test.query_rows, test.rows - 1)
    users = [s.seqs.user_ids[u] for u in test.users]
    assert users == ["u", "v"]
    assert [s.vocab.item_ids[i] for i in test.items] == ["b", "b"]
    # v's target b is predicted after its cold item z (an OOV bucket row)
    assert s.seqs.items[test.query_rows[1]] >= s.n_items
    assert test.positions.tolist() == [5, 3]
    assert s.targets("test", "yes").exclude_seen and not test.exclude_seen
    assert s.targets("test", "auto").exclude_seen == (not s.has_repeats)


def test_save_load_round_trip(tiny: Dataset, tmp_path: Path) -> None:
    s = strict_time_split(tiny, 4, 0.8, 0.9)
    path = tmp_path / "split.npz"
    s.save(path)
    t = TimeSplit.load(path)
    for name in ("offsets", "items", "actions", "ts_ms", "part", "global_idx"):
        assert np.array_equal(getattr(s.seqs, name), getattr(t.seqs, name)), name
    assert t.seqs.user_ids == s.seqs.user_ids and t.vocab.item_ids == s.vocab.item_ids
    assert t.vocab.n_oov == 4
    assert np.array_equal(t.event_cat, s.event_cat) and np.array_equal(t.item_cat, s.item_cat)
    assert t.cat_keys == s.cat_keys
    assert (t.n_train, t.boundary_valid_ts, t.has_repeats) == (8, 8, True)
    assert not list(tmp_path.glob("*.tmp*"))
    np.load(path, allow_pickle=False).close()  # no pickled objects inside


def test_saved_split_evaluates_without_polars(tiny: Dataset, tmp_path: Path) -> None:
    """The GPU image has no polars: loading a split and evaluating Pop must not import it."""
    import subprocess
    import sys

    path = tmp_path / "split.npz"
    strict_time_split(tiny, 4, 0.8, 0.9).save(path)
    code = f"""
import sys
class NoPolars:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'polars':
            raise ImportError('polars is blocked')
sys.meta_path.insert(0, NoPolars())
from offline_eval.split import TimeSplit
from offline_eval.evaluate import evaluate
from offline_eval.baselines import PopScorer
from recmem.config import EvalConfig
s = TimeSplit.load({str(path)!r})
r = evaluate(PopScorer(s), s, 'test', EvalConfig(), progress=False)
assert r['overall']['n'] == 1 and 'polars' not in sys.modules
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
