"""Events as numpy columns, and the events file (.npz) that carries them between machines.

An :class:`EventStream` is what ``recmem produce`` sends and ``--write`` saves: two id tables
(``user_ids``, ``item_ids``: code -> id string) and the events in time order as
:class:`EventColumns` chunks (user and item codes, ``ts_ms``, action index into
``proto.actions.ACTIONS``, value). It comes from a loaded dataset (:func:`dataset_stream`),
the benchmark workload generator (``recmem.workload``) or an events file
(:func:`read_event_file`), and it never needs polars past the dataset case, so the file
also serves machines without it (the lent GPU image).

The events file is an uncompressed ``.npz`` (no pickles): ``user``, ``item`` (int32 codes),
``ts_ms`` (int64), ``action`` (int8), ``value`` (float32), ``user_ids``, ``item_ids``
(unicode arrays) and ``meta`` (a JSON string: ``format``, ``version``, where the events
came from).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from proto.actions import ACTIONS

if TYPE_CHECKING:
    from recmem.datasets import Dataset

FILE_FORMAT = "recmem-events"
FILE_VERSION = 1
COLUMNS = ("user", "item", "ts_ms", "action", "value")
FILE_DTYPES = {
    "user": np.int32,
    "item": np.int32,
    "ts_ms": np.int64,
    "action": np.int8,
    "value": np.float32,
}


@dataclass(frozen=True)
class EventColumns:
    """Events as equal-length arrays: ``user`` and ``item`` codes into the stream's id
    tables, ``ts_ms``, ``action`` (index into ACTIONS) and ``value``."""

    user: np.ndarray
    item: np.ndarray
    ts_ms: np.ndarray
    action: np.ndarray
    value: np.ndarray

    def __len__(self) -> int:
        return len(self.user)

    def slice(self, start: int, stop: int) -> EventColumns:
        return EventColumns(*(getattr(self, c)[start:stop] for c in COLUMNS))

    @staticmethod
    def concat(parts: list[EventColumns]) -> EventColumns:
        if len(parts) == 1:
            return parts[0]
        return EventColumns(*(np.concatenate([getattr(p, c) for p in parts]) for c in COLUMNS))


def rechunk(parts: Iterable[EventColumns], size: int) -> Iterator[EventColumns]:
    """The events of ``parts`` again, in chunks of exactly ``size`` (the last one shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    held: list[EventColumns] = []
    n_held = 0
    for part in parts:
        held.append(part)
        n_held += len(part)
        if n_held < size:
            continue
        joined = EventColumns.concat(held)
        cut = n_held - n_held % size
        for a in range(0, cut, size):
            yield joined.slice(a, a + size)
        held = [joined.slice(cut, n_held)] if cut < n_held else []
        n_held -= cut
    if n_held:
        yield EventColumns.concat(held)


@dataclass
class EventStream:
    """Events in time order with their id tables; ``chunks(size)`` starts a fresh pass."""

    name: str
    user_ids: np.ndarray
    item_ids: np.ndarray
    n_events: int
    chunks: Callable[[int], Iterator[EventColumns]]
    meta: dict[str, Any] = field(default_factory=dict)


def table_stream(
    name: str,
    user_ids: np.ndarray,
    item_ids: np.ndarray,
    columns: EventColumns,
    meta: dict[str, Any],
) -> EventStream:
    """A stream over columns already in memory."""

    def chunks(size: int) -> Iterator[EventColumns]:
        return rechunk([columns], size)

    return EventStream(name, user_ids, item_ids, len(columns), chunks, meta)


def dataset_stream(data: Dataset) -> EventStream:
    """A loaded dataset's events (already sorted by time) as a stream; ids are coded by their
    sorted order, the category column is dropped (it does not travel on the wire)."""
    import polars as pl

    ev = data.events
    codes = {name: i for i, name in enumerate(ACTIONS)}
    action = ev["action"].replace_strict(codes, return_dtype=pl.Int8).to_numpy()
    columns = EventColumns(
        user=(ev["user_id"].rank("dense") - 1).to_numpy().astype(np.int64),
        item=(ev["item_id"].rank("dense") - 1).to_numpy().astype(np.int64),
        ts_ms=ev["ts_ms"].to_numpy(),
        action=action,
        value=ev["value"].to_numpy(),
    )
    user_ids = ev["user_id"].unique().sort().to_numpy().astype(str)
    item_ids = ev["item_id"].unique().sort().to_numpy().astype(str)
    return table_stream(data.name, user_ids, item_ids, columns, {"source": data.name})


def write_event_file(
    path: Path, stream: EventStream, *, limit: int = 0, progress: bool = True
) -> int:
    """Write the first ``limit`` (0: all) events of ``stream`` to ``path`` (written aside,
    then renamed); returns how many were written."""
    from tqdm import tqdm

    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    for name, ids in (("users", stream.user_ids), ("items", stream.item_ids)):
        if len(ids) > np.iinfo(np.int32).max:
            raise ValueError(f"{len(ids)} {name} do not fit the file's int32 codes")
    n = min(stream.n_events, limit) if limit else stream.n_events
    out: dict[str, Any] = {c: np.empty(n, dtype=FILE_DTYPES[c]) for c in COLUMNS}
    done = 0
    with tqdm(total=n, unit="ev", desc=f"write {path.name}", disable=not progress) as bar:
        for chunk in stream.chunks(1 << 16):
            take = min(len(chunk), n - done)
            for c in COLUMNS:
                out[c][done : done + take] = getattr(chunk, c)[:take]
            done += take
            bar.update(take)
            if done == n:
                break
    if done < n:
        raise ValueError(f"{stream.name}: the stream ended after {done} of {n} events")
    meta = {**stream.meta, "format": FILE_FORMAT, "version": FILE_VERSION, "events": n}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        out.update(user_ids=stream.user_ids, item_ids=stream.item_ids)
        np.savez(f, meta=np.array(json.dumps(meta)), **out)
    os.replace(tmp, path)
    return n


def read_event_file(path: Path) -> EventStream:
    """The stream saved in an events file; a clear error for anything else."""
    if not path.is_file():
        raise FileNotFoundError(f"events file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not an events file (.npz): {e}") from None
    missing = [k for k in (*COLUMNS, "user_ids", "item_ids", "meta") if k not in arrays]
    if missing:
        raise ValueError(f"{path} is not an events file: no {', '.join(missing)}")
    meta = json.loads(str(arrays["meta"]))
    if meta.get("format") != FILE_FORMAT or meta.get("version") != FILE_VERSION:
        raise ValueError(
            f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected {FILE_FORMAT!r} version {FILE_VERSION}"
        )
    columns = EventColumns(*(arrays[c] for c in COLUMNS))
    n = len(columns)
    if any(len(getattr(columns, c)) != n for c in COLUMNS):
        raise ValueError(f"{path}: the event columns differ in length")
    user_ids, item_ids = arrays["user_ids"], arrays["item_ids"]
    for codes, size in ((columns.user, len(user_ids)), (columns.item, len(item_ids))):
        if n and (codes.min() < 0 or codes.max() >= size):
            raise ValueError(f"{path}: a user or item code is outside its id table")
    if n and (columns.action.min() < 0 or columns.action.max() >= len(ACTIONS)):
        raise ValueError(f"{path}: an action code is outside 0..{len(ACTIONS) - 1}")
    name = str(meta.get("source", path.stem))
    return table_stream(name, user_ids, item_ids, columns, meta)
