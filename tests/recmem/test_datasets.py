from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from models.sequences import ACTIONS
from offline_eval.split import strict_time_split
from recmem.config import DataConfig
from recmem.datasets import load_dataset

COLUMNS = ["user_id", "item_id", "ts_ms", "action", "value", "category"]


def _write_csv(path: Path, text: str) -> str:
    path.write_text(text)
    return f"csv:{path}"


def test_csv_seconds_categories_actions(tmp_path: Path) -> None:
    spec = _write_csv(
        tmp_path / "e.csv",
        "user_id,item_id,timestamp,category,rating,action\n"
        "u2,b,1000000001,Comedy|Animation,4,click\n"
        "u1,a,1000000001,Drama,,purchase\n"
        "u1,b,1000000000,Animation|Comedy,5,teleport\n"
        ",c,1000000002,Drama,3,view\n"
        "u3,c,,Drama,3,view\n"
        "u3,,1000000003,Drama,3,view\n",
    )
    d = load_dataset(spec, DataConfig())
    ev = d.events
    assert ev.columns == COLUMNS and ev.height == 3  # 3 rows without user/item/ts dropped
    assert ev["ts_ms"].dtype == pl.Int64 and ev["value"].dtype == pl.Float32
    # sorted by (ts, user, item); seconds -> ms
    assert ev["ts_ms"].to_list() == [1_000_000_000_000, 1_000_000_001_000, 1_000_000_001_000]
    assert ev["user_id"].to_list() == ["u1", "u1", "u2"]
    assert ev["action"].to_list() == ["other", "purchase", "click"]
    assert set(ev["action"].to_list()) <= set(ACTIONS)
    # a category set is one key, its order canonical
    assert ev["category"].to_list() == ["Animation|Comedy", "Drama", "Animation|Comedy"]
    assert ev["value"].to_list() == [5.0, 1.0, 4.0]
    assert not d.has_repeats


def test_csv_milliseconds_and_repeats(tmp_path: Path) -> None:
    spec = _write_csv(
        tmp_path / "ms.csv",
        "user_id,item_id,timestamp\nu,a,1700000000123\nu,a,1700000000456\n",
    )
    d = load_dataset(spec, DataConfig())
    assert d.events["ts_ms"].to_list() == [1_700_000_000_123, 1_700_000_000_456]
    assert d.has_repeats
    assert d.events["category"].null_count() == 2
    assert d.events["action"].to_list() == ["other", "other"]


def test_missing_column_names_it(tmp_path: Path) -> None:
    spec = _write_csv(tmp_path / "bad.csv", "user_id,item,timestamp\nu,a,1\n")
    with pytest.raises(ValueError, match="item_id"):
        load_dataset(spec, DataConfig())
    with pytest.raises(FileNotFoundError):
        load_dataset(f"csv:{tmp_path / 'absent.csv'}", DataConfig())
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("ml-20m", DataConfig())


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "e.parquet"
    pl.DataFrame(
        {"user_id": [1, 2], "item_id": [10, 11], "timestamp": [5, 4], "category": ["x", None]}
    ).write_parquet(path)
    d = load_dataset(f"parquet:{path}", DataConfig())
    assert d.events["user_id"].to_list() == ["2", "1"]
    assert d.events["ts_ms"].to_list() == [4000, 5000]
    assert d.events["category"].to_list() == [None, "x"]
    from datetime import datetime

    dt_path = tmp_path / "dt.parquet"
    pl.DataFrame(
        {"user_id": ["u"], "item_id": ["a"], "timestamp": [datetime(2001, 9, 9, 1, 46, 40)]}
    ).write_parquet(dt_path)
    d = load_dataset(f"parquet:{dt_path}", DataConfig())
    assert d.events["ts_ms"].to_list() == [1_000_000_000_000]


def test_integer_ids_sort_as_integers(tmp_path: Path) -> None:
    """SPEC 7.1: ties in time are cut by (user, item), integer ids compared as integers."""
    spec = _write_csv(
        tmp_path / "ints.csv",
        "user_id,item_id,timestamp\n10,2,5\n9,10,5\n9,9,5\n9,1,4\n100,7,6\n20,7,6\n",
    )
    ev = load_dataset(spec, DataConfig()).events
    assert ev["user_id"].to_list() == ["9", "9", "9", "10", "20", "100"]
    assert ev["item_id"].to_list() == ["1", "9", "10", "2", "7", "7"]
    # the split cuts ties the same way: TRAIN = the first floor(0.5 * 6) = 3 events, all of
    # user 9's (as strings, user "10" would come first at ts 5 and take a TRAIN slot)
    split = strict_time_split(load_dataset(spec, DataConfig()), 4, 0.5, 0.8)
    train = dict(zip(split.seqs.user_ids, split.train_prefix_lengths().tolist(), strict=True))
    assert train == {"10": 0, "100": 0, "20": 0, "9": 3}
    # global order inside the split: (20, 7) before (100, 7) at ts 6
    row = split.seqs.global_idx.tolist().index(4)
    assert split.seqs.user_ids[split.seqs.user_of_event()[row]] == "20"


def test_integer_ids_parquet_and_mixed_columns(tmp_path: Path) -> None:
    path = tmp_path / "ints.parquet"
    pl.DataFrame(
        {"user_id": [10, 9, 9], "item_id": ["b", "a", "10"], "timestamp": [1, 1, 1]}
    ).write_parquet(path)
    ev = load_dataset(f"parquet:{path}", DataConfig()).events
    assert ev["user_id"].to_list() == ["9", "9", "10"]  # integer column: numeric order
    assert ev["item_id"].to_list() == ["10", "a", "b"]  # mixed column: string order
    # equal numbers written differently keep a deterministic (text) order
    spec = _write_csv(tmp_path / "zeros.csv", "user_id,item_id,timestamp\n7,1,1\n07,1,1\n-3,1,1\n")
    assert load_dataset(spec, DataConfig()).events["user_id"].to_list() == ["-3", "07", "7"]
