"""Hand-made tiny datasets shared by the offline_eval tests."""

from __future__ import annotations

import polars as pl
import pytest

from recmem.datasets import Dataset, finish_events, has_repeats


def make_dataset(rows: list[tuple[str, str, int, str | None]], name: str = "tiny") -> Dataset:
    """rows: (user, item, ts_ms, category)."""
    frame = pl.DataFrame(
        {
            "user_id": [r[0] for r in rows],
            "item_id": [r[1] for r in rows],
            "ts_ms": [r[2] for r in rows],
            "action": ["rating"] * len(rows),
            "value": [1.0] * len(rows),
            "category": [r[3] for r in rows],
        },
        schema_overrides={"category": pl.String},
    )
    events = finish_events(frame)
    return Dataset(name, events, None, has_repeats(events))


@pytest.fixture
def tiny() -> Dataset:
    """10 events, 3 users, ties at ts 5 and 8; sorted order (ts, user, item):
    0 a/i1@1  1 b/i2@2  2 a/i2@3  3 c/i3@4  4 a/i3@5  5 b/i1@5  6 b/i3@6  7 a/i4@8
    8 c/i1@8  9 b/i2@9 -> TRAIN = 0..7, VALID = {8}, TEST = {9}."""
    rows = [
        ("a", "i1", 1, "X"),
        ("b", "i2", 2, "Y"),
        ("a", "i2", 3, "Y"),
        ("c", "i3", 4, "X|Z"),
        ("b", "i1", 5, "X"),
        ("a", "i3", 5, "X|Z"),
        ("b", "i3", 6, "X|Z"),
        ("c", "i1", 8, "X"),
        ("a", "i4", 8, None),
        ("b", "i2", 9, "Y"),
    ]
    return make_dataset(rows)
