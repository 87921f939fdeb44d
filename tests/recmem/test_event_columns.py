"""Events as columns: rechunking, a dataset as a stream, the events file and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recmem.datasets import load_table
from recmem.event_columns import (
    COLUMNS,
    EventColumns,
    dataset_stream,
    read_event_file,
    rechunk,
    write_event_file,
)
from recmem.producing import stream_events
from streams.codec import make_event


def columns(n: int, start: int = 0) -> EventColumns:
    k = np.arange(start, start + n)
    return EventColumns(k, k % 7, 1000 + k, (k % 6).astype(np.int8), k.astype(np.float32))


@pytest.mark.parametrize("size", [1, 3, 10, 11, 100])
def test_rechunk_keeps_every_event_in_order(size: int) -> None:
    parts = [columns(4), columns(0, 4), columns(7, 4)]
    out = list(rechunk(parts, size))
    assert all(len(c) == size for c in out[:-1]) and 0 < len(out[-1]) <= size
    assert np.array_equal(EventColumns.concat(out).user, np.arange(11))
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        list(rechunk(parts, 0))


def small_dataset(tmp_path: Path):
    csv = tmp_path / "events.csv"
    rows = ["user_id,item_id,timestamp,action"]
    rows += [f"user{i % 4},item{(i * 3) % 5},{1_600_000_000 + i},click" for i in range(30)]
    rows += ["user9,item1,1600000100,purchase"]
    csv.write_text("\n".join(rows) + "\n")
    return load_table(csv, "csv")


def test_a_dataset_round_trips_through_the_file(tmp_path: Path) -> None:
    data = small_dataset(tmp_path)
    rows = data.events.select(["user_id", "item_id", "ts_ms", "action", "value"]).rows()
    want = [make_event(*row) for row in rows]  # what producing row by row would send
    stream = dataset_stream(data)
    assert list(stream_events(stream, 4)) == want
    path = tmp_path / "out" / "events.npz"
    assert write_event_file(path, stream, progress=False) == 31
    back = read_event_file(path)
    assert back.name == data.name and back.meta["events"] == 31
    assert list(stream_events(back, 5)) == want
    # --limit: the first events only
    assert write_event_file(path, back, limit=5, progress=False) == 5
    assert list(stream_events(read_event_file(path))) == want[:5]


def test_bad_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="events file not found"):
        read_event_file(tmp_path / "absent.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="is not an events file"):
        read_event_file(tmp_path / "text.npz")
    np.savez(tmp_path / "other.npz", user=np.zeros(3))
    with pytest.raises(ValueError, match="no item, ts_ms, action, value, user_ids"):
        read_event_file(tmp_path / "other.npz")
    good = {c: getattr(columns(3), c) for c in COLUMNS}
    ids = {"user_ids": np.array(["a", "b", "c"]), "item_ids": np.array(["x"] * 7)}
    meta = {"format": "recmem-events", "version": 99}
    np.savez(tmp_path / "v99.npz", **good, **ids, meta=np.array(json.dumps(meta)))
    with pytest.raises(ValueError, match="version 99, expected 'recmem-events' version 1"):
        read_event_file(tmp_path / "v99.npz")
    meta["version"] = 1
    bad = {**good, "user": np.array([0, 1, 3])}
    np.savez(tmp_path / "codes.npz", **bad, **ids, meta=np.array(json.dumps(meta)))
    with pytest.raises(ValueError, match="user or item code is outside its id table"):
        read_event_file(tmp_path / "codes.npz")
    bad = {**good, "action": np.array([0, 6, 1], dtype=np.int8)}
    np.savez(tmp_path / "actions.npz", **bad, **ids, meta=np.array(json.dumps(meta)))
    with pytest.raises(ValueError, match="action code is outside 0..5"):
        read_event_file(tmp_path / "actions.npz")
