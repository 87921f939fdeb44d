"""Strict global time split (SPEC section 7) and the evaluation targets it defines.

All events are sorted by (ts_ms, user_id, item_id); with n events, indices below
floor(valid_frac * n) are TRAIN, those below floor(test_frac * n) VALID, the rest TEST.
The split keeps EVERY event of every user in one :class:`models.sequences.EventSeqs`
(each user's events in global order, ``part`` 0/1/2), because every VALID/TEST target is
predicted from all of that user's earlier events, whatever part they belong to.

A saved split is one ``.npz`` (plain numeric and fixed-width string arrays, no pickle) plus
a small ``.json``; loading needs numpy only, so a split prepared on one machine can be
evaluated on another that has no polars.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.sequences import ACTIONS, EventSeqs
from recmem.vocab import ItemVocab

if TYPE_CHECKING:
    from recmem.config import Config
    from recmem.datasets import Dataset

log = logging.getLogger(__name__)

SPLIT_FORMAT = 1
PARTS = {"train": 0, "valid": 1, "test": 2}


@dataclass
class TargetSet:
    """The evaluation targets of one part, after exclusions.

    rows: event rows (into ``split.seqs``) of the targets; query_rows = rows - 1, the user's
    previous event: the prediction uses the user's events up to and including it.
    seen_start: first row of the target's user; when ``exclude_seen`` the items at rows
    seen_start .. query_row (inclusive) are removed from the ranking (the target itself never).
    """

    part: int
    rows: np.ndarray
    query_rows: np.ndarray
    users: np.ndarray
    items: np.ndarray
    positions: np.ndarray
    seen_start: np.ndarray
    exclude_seen: bool
    excluded_first_event: int
    excluded_cold_item: int

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    def subset(self, mask: np.ndarray) -> TargetSet:
        return TargetSet(
            self.part,
            self.rows[mask],
            self.query_rows[mask],
            self.users[mask],
            self.items[mask],
            self.positions[mask],
            self.seen_start[mask],
            self.exclude_seen,
            self.excluded_first_event,
            self.excluded_cold_item,
        )


@dataclass
class TimeSplit:
    """Events of all users in global time order, labelled TRAIN/VALID/TEST."""

    dataset: str
    seqs: EventSeqs
    vocab: ItemVocab
    n_events: int
    n_train: int
    boundary_valid_ts: int
    boundary_test_ts: int
    event_cat: np.ndarray
    """[n_events] int32 category key of each event's item (index into ``cat_keys``)."""
    item_cat: np.ndarray
    """[n_items] int32 category key of each TRAIN (vocabulary) item."""
    cat_keys: list[str]
    """Category key strings: an item's whole category set, '|'-joined; an item without a
    category is its own key ('#' + item id)."""
    has_repeats: bool
    item_titles: dict[str, str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    planted: dict[str, np.ndarray] = field(default_factory=dict)
    """Known structure of generated data (recmem.synthetic), per event row of ``seqs``."""

    @property
    def n_items(self) -> int:
        return self.vocab.n_items

    def train_prefix_lengths(self) -> np.ndarray:
        """[n_users] how many leading events of each user are TRAIN (the split is global by
        time, so each user's TRAIN events are a prefix of its sequence)."""
        user = self.seqs.user_of_event()
        return np.bincount(user[self.seqs.part == 0], minlength=self.seqs.n_users)

    def resolve_exclude_seen(self, mode: str) -> bool:
        if mode == "auto":
            return not self.has_repeats
        if mode in ("yes", "no"):
            return mode == "yes"
        raise ValueError(f"exclude_seen must be auto|yes|no, got {mode!r}")

    def targets(self, part: str | int, exclude_seen: str = "auto") -> TargetSet:
        """Targets of ``part`` ('valid'/'test' or 1/2) after SPEC exclusions (first events,
        items not in TRAIN), in row order (grouped by user, each user's in time order)."""
        code = PARTS[part] if isinstance(part, str) else int(part)
        seqs = self.seqs
        pos = seqs.position_in_user()
        in_part = seqs.part == code
        first = in_part & (pos == 1)
        cold = in_part & (pos > 1) & (seqs.items >= self.n_items)
        rows = np.flatnonzero(in_part & ~first & ~cold)
        users = seqs.user_of_event()[rows]
        return TargetSet(
            part=code,
            rows=rows,
            query_rows=rows - 1,
            users=users,
            items=seqs.items[rows],
            positions=pos[rows],
            seen_start=seqs.offsets[users],
            exclude_seen=self.resolve_exclude_seen(exclude_seen),
            excluded_first_event=int(first.sum()),
            excluded_cold_item=int(cold.sum()),
        )

    # --- persistence (numpy only) ------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write ``path`` (.npz) and ``path`` with suffix .json, each aside then renamed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        s = self.seqs
        arrays = {
            "offsets": s.offsets.astype(np.int64),
            "items": s.items.astype(np.int64),
            "actions": s.actions.astype(np.int8),
            "ts_ms": s.ts_ms.astype(np.int64),
            "part": s.part.astype(np.int8),
            "global_idx": s.global_idx.astype(np.int64),
            "event_cat": self.event_cat.astype(np.int32),
            "item_cat": self.item_cat.astype(np.int32),
            "user_ids": np.array(s.user_ids, dtype=np.str_),
            "vocab_items": np.array(self.vocab.item_ids, dtype=np.str_),
            "cat_keys": np.array(self.cat_keys, dtype=np.str_),
        }
        arrays.update({f"planted__{k}": v for k, v in self.planted.items()})
        meta = {
            "format": SPLIT_FORMAT,
            "dataset": self.dataset,
            "n_events": self.n_events,
            "n_train": self.n_train,
            "boundary_valid_ts": self.boundary_valid_ts,
            "boundary_test_ts": self.boundary_test_ts,
            "has_repeats": self.has_repeats,
            "n_oov_buckets": self.vocab.n_oov,
            "item_titles": self.item_titles,
            "meta": self.meta,
        }
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        meta_path = path.with_suffix(".json")
        tmp_meta = meta_path.with_name(meta_path.name + f".tmp{os.getpid()}")
        with open(tmp_meta, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_meta, meta_path)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> TimeSplit:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.get("format") != SPLIT_FORMAT:
            raise ValueError(f"{path}: split format {meta.get('format')} != {SPLIT_FORMAT}")
        with np.load(path, allow_pickle=False) as z:
            seqs = EventSeqs(
                user_ids=[str(u) for u in z["user_ids"]],
                offsets=z["offsets"],
                items=z["items"],
                actions=z["actions"].astype(np.int64),
                ts_ms=z["ts_ms"],
                part=z["part"].astype(np.int64),
                global_idx=z["global_idx"],
            )
            vocab = ItemVocab([str(i) for i in z["vocab_items"]], int(meta["n_oov_buckets"]))
            return cls(
                dataset=meta["dataset"],
                seqs=seqs,
                vocab=vocab,
                n_events=int(meta["n_events"]),
                n_train=int(meta["n_train"]),
                boundary_valid_ts=int(meta["boundary_valid_ts"]),
                boundary_test_ts=int(meta["boundary_test_ts"]),
                event_cat=z["event_cat"],
                item_cat=z["item_cat"],
                cat_keys=[str(k) for k in z["cat_keys"]],
                has_repeats=bool(meta["has_repeats"]),
                item_titles=meta.get("item_titles"),
                meta=meta.get("meta", {}),
                planted={
                    k.removeprefix("planted__"): z[k] for k in z.files if k.startswith("planted__")
                },
            )


def split_bounds(n: int, valid_frac: float, test_frac: float) -> tuple[int, int]:
    """Global indices of the first VALID and first TEST event."""
    if not 0.0 < valid_frac < test_frac < 1.0:
        raise ValueError(f"need 0 < valid_frac < test_frac < 1, got {valid_frac}, {test_frac}")
    return math.floor(valid_frac * n), math.floor(test_frac * n)


def strict_time_split(
    dataset: Dataset, vocab_oov_buckets: int, valid_frac: float = 0.8, test_frac: float = 0.9
) -> TimeSplit:
    """SPEC section 7 split of ``dataset`` (whose events are already sorted by ts, user,
    item; they are re-sorted here anyway, stably, by recmem.datasets.sort_events, so the
    rule, integer ids as integers included, holds for any input)."""
    import polars as pl

    from recmem.datasets import sort_events

    ev = sort_events(dataset.events.with_row_index("_row"))
    source_row = ev["_row"].to_numpy().astype(np.int64)
    n = ev.height
    if n < 3:
        raise ValueError(f"dataset {dataset.name!r} has {n} events; a time split needs >= 3")
    b_valid, b_test = split_bounds(n, valid_frac, test_frac)
    if b_valid < 1 or b_test <= b_valid:
        raise ValueError(f"dataset {dataset.name!r}: {n} events leave an empty TRAIN or VALID part")
    part_global = np.zeros(n, dtype=np.int64)
    part_global[b_valid:b_test] = 1
    part_global[b_test:] = 2
    ts = ev["ts_ms"].to_numpy().astype(np.int64)

    train_items = sorted(ev["item_id"].head(b_valid).unique().to_list())
    vocab = ItemVocab(train_items, vocab_oov_buckets)

    # Dense codes for users (sorted ids), items (vocab order, OOV hashed), category keys.
    user_ids = sorted(ev["user_id"].unique().to_list())
    user_code = _codes(ev["user_id"], user_ids)
    uniq_items = ev["item_id"].unique().to_list()
    item_code = _codes(ev["item_id"], uniq_items, vocab.encode(uniq_items))
    cat_per_event = ev.select(
        pl.when(pl.col("category").is_null())
        .then(pl.lit("#") + pl.col("item_id"))
        .otherwise(pl.col("category"))
        .alias("key")
    )["key"]
    cat_keys = sorted(cat_per_event.unique().to_list())
    cat_code = _codes(cat_per_event, cat_keys).astype(np.int32)
    action_index = {a: i for i, a in enumerate(ACTIONS)}
    uniq_actions = ev["action"].unique().to_list()
    action_code = _codes(
        ev["action"],
        uniq_actions,
        np.array([action_index.get(a, action_index["other"]) for a in uniq_actions]),
    )

    order = np.argsort(user_code, kind="stable")  # per user, global order kept
    counts = np.bincount(user_code, minlength=len(user_ids))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seqs = EventSeqs(
        user_ids=user_ids,
        offsets=offsets,
        items=item_code[order],
        actions=action_code[order],
        ts_ms=ts[order],
        part=part_global[order],
        global_idx=order.astype(np.int64),
    )
    event_cat = cat_code[order]
    item_cat = np.full(vocab.n_items, -1, dtype=np.int32)
    known = seqs.items < vocab.n_items
    item_cat[seqs.items[known]] = event_cat[known]
    return TimeSplit(
        dataset=dataset.name,
        seqs=seqs,
        vocab=vocab,
        n_events=n,
        n_train=b_valid,
        boundary_valid_ts=int(ts[b_valid]),
        boundary_test_ts=int(ts[b_test]),
        event_cat=event_cat,
        item_cat=item_cat,
        cat_keys=cat_keys,
        has_repeats=dataset.has_repeats,
        item_titles=dataset.item_titles,
        meta={"valid_frac": valid_frac, "test_frac": test_frac},
        planted={
            k: np.asarray(v)[source_row][order]
            for k, v in dataset.planted.items()
            if np.ndim(v) == 1 and len(v) == n
        },
    )


def _codes(column: Any, keys: list[Any], values: np.ndarray | None = None) -> np.ndarray:
    """Map each entry of a polars Series to values[index of the entry in keys]
    (values default to 0..len(keys)-1)."""
    import polars as pl

    if values is None:
        values = np.arange(len(keys), dtype=np.int64)
    table = pl.DataFrame({"k": pl.Series(keys, dtype=column.dtype), "v": values})
    mapped = pl.DataFrame({"k": column}).join(table, on="k", how="left", maintain_order="left")
    return mapped["v"].to_numpy().astype(np.int64)


def split_cache_path(cfg: Config, dataset: str | None = None) -> Path:
    """Where the split for (dataset, fractions, OOV buckets) is cached. File datasets add
    their files' sizes and mtimes to the key; synthetic adds its size parameters."""
    spec = dataset or cfg.data.dataset
    from recmem.datasets import EVENT_ORDER

    key: dict[str, Any] = {
        "dataset": spec,
        "valid": cfg.data.valid_frac,
        "test": cfg.data.test_frac,
        "oov": cfg.model.n_oov_buckets,
        "format": SPLIT_FORMAT,
        "event_order": EVENT_ORDER,
    }
    if spec == "synthetic":
        key["synthetic"] = [
            cfg.data.synthetic_users,
            cfg.data.synthetic_events,
            cfg.data.synthetic_seed,
        ]
    if ":" in spec:
        p = Path(spec.partition(":")[2]).expanduser()
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        key["files"] = [
            [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()
        ]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = spec.replace(":", "_").replace("/", "_")[-40:]
    return Path(cfg.data.cache_dir).expanduser() / "splits" / f"{name}-{digest}.npz"


def load_or_build_split(cfg: Config, dataset: str | None = None) -> TimeSplit:
    """The cached split for the configured dataset, building (and caching) it if absent."""
    path = split_cache_path(cfg, dataset)
    if path.is_file() and path.with_suffix(".json").is_file():
        log.info("loading cached split %s", path)
        return TimeSplit.load(path)
    from recmem.datasets import load_dataset

    data = load_dataset(dataset or cfg.data.dataset, cfg.data)
    split = strict_time_split(
        data, cfg.model.n_oov_buckets, cfg.data.valid_frac, cfg.data.test_frac
    )
    split.save(path)
    log.info("split cached at %s", path)
    return split
