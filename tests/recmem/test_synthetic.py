from __future__ import annotations

import numpy as np
import polars as pl

from recmem.config import DataConfig
from recmem.datasets import load_dataset
from recmem.synthetic import SyntheticSpec, generate

SMALL = SyntheticSpec(n_users=80, n_events=12_000, seed=3, chunk_events=2_000)


def test_deterministic_by_seed() -> None:
    a, b = generate(SMALL), generate(SMALL)
    assert a.events.equals(b.events)
    assert np.array_equal(a.planted["is_recall"], b.planted["is_recall"])
    c = generate(SyntheticSpec(n_users=80, n_events=12_000, seed=4, chunk_events=2_000))
    assert not a.events.equals(c.events)


def test_sizes_schema_and_order() -> None:
    d = generate(SMALL)
    ev = d.events
    assert ev.height == 12_000 and ev["user_id"].n_unique() == 80
    assert ev.columns == ["user_id", "item_id", "ts_ms", "action", "value", "category"]
    key = ev.select(["ts_ms", "user_id", "item_id"])
    assert key.equals(key.sort(["ts_ms", "user_id", "item_id"]))
    for name in ("is_recall", "long_term_session", "session_category"):
        assert d.planted[name].shape == (12_000,)


def test_planted_structure() -> None:
    spec = SMALL
    d = generate(spec)
    ev = d.events.with_columns(
        pl.Series("is_recall", d.planted["is_recall"]),
        pl.Series("lt", d.planted["long_term_session"]),
        pl.Series("scat", d.planted["session_category"]),
        pl.int_range(pl.len()).over("user_id").alias("pos"),
    )
    # recalls: the item was seen by the same user more than recall_gap events earlier
    rec = ev.filter(pl.col("is_recall"))
    assert 0.02 < rec.height / ev.height < 0.08
    first_pos = ev.group_by(["user_id", "item_id"]).agg(pl.col("pos").min().alias("first"))
    joined = rec.join(first_pos, on=["user_id", "item_id"])
    assert (joined["pos"] - joined["first"] > spec.recall_gap).all()
    # long-term sessions use the user's interest categories
    interests = d.planted["user_interests"]
    lt = ev.filter(pl.col("lt") & ~pl.col("is_recall"))
    users = lt["user_id"].str.slice(1).cast(pl.Int64).to_numpy()
    cats = lt["scat"].to_numpy()
    assert (interests[users] == cats[:, None]).any(axis=1).all()
    # non-recall items belong to the session's category
    plain = ev.filter(~pl.col("is_recall"))
    assert (plain["category"] == ("c" + plain["scat"].cast(pl.String))).all()
    share = ev["lt"].mean()
    assert 0.45 < float(share) < 0.75  # type: ignore[arg-type]


def test_hooked_into_load_dataset() -> None:
    d = load_dataset("synthetic", DataConfig(synthetic_users=30, synthetic_events=900))
    assert d.name == "synthetic" and d.events.height == 900 and d.has_repeats
