"""Per-target ranks files: ``ranks/<file>.npz`` next to ``summary.json``, one per model and seed.

Each file is a compressed ``.npz`` (numbers and fixed-width strings only: it loads with
``allow_pickle=False``), one entry per TEST target, in the evaluator's target order (grouped by
user, each user's targets in time order):

- ``rows`` int64: the target's event row in the split's ``EventSeqs``;
- ``global_idx`` int64: the target's index in the global (timestamp, user, item) order;
- ``users`` int32: the user's index (users sorted by id, as in the split);
- ``positions`` int32: the target's 1-based lifetime position in its user's history (the
  by_position.json buckets: 1-10, ..., 501+);
- ``ranks`` int32: the 0-based rank among the ranked items (0 = top; the number of items
  scored strictly above the target);
- ``loss`` float32: -log softmax(scores)[target] over the ranked items;
- ``is_recent``, ``is_long_term``, ``is_new``, ``is_repeat`` bool: the strata;
- scalars ``label`` (the model spec, e.g. ``memory-proteus[memory.n_blocks=4]``), ``seed``
  (its ``train.seed``; -1 for a model that takes none, such as ``pop``), ``dataset``,
  ``format`` (1), and ``config`` (the model's recorded configuration as JSON, the same as
  its summary.json entry's ``config``; files written before 2026-12-02 have none).

File names keep only ``[A-Za-z0-9._-]`` of the label (plus a short hash of the label when
something was replaced, so two labels never share a file) and end in ``.seed<k>.npz`` for a
seeded model, e.g. ``ranks/sasrec.seed0.npz``, ``ranks/pop.npz``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from offline_eval.strata import STRATA

RANKS_DIR = "ranks"
RANKS_FORMAT = 1
NO_SEED = -1

_ARRAYS = {
    "rows": np.int64,
    "global_idx": np.int64,
    "users": np.int32,
    "positions": np.int32,
    "ranks": np.int32,
    "loss": np.float32,
    **{f"is_{s}": np.bool_ for s in STRATA},
}


def ranks_filename(label: str, seed: int | None) -> str:
    """The file name (inside RANKS_DIR) of ``label``'s ranks for ``seed``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_.") or "model"
    if safe != label:
        safe += "-" + hashlib.sha1(label.encode()).hexdigest()[:8]
    return f"{safe}.seed{seed}.npz" if seed is not None else f"{safe}.npz"


def save_ranks(
    path: Path,
    *,
    label: str,
    seed: int | None,
    dataset: str,
    per_target: dict[str, np.ndarray],
    global_idx: np.ndarray,
    config: dict[str, Any] | None = None,
) -> None:
    """Write ``evaluate(..., return_per_target=True)["per_target"]`` (plus the targets'
    global indices and the model's recorded ``config``) to ``path`` atomically."""
    arrays = {"global_idx": global_idx, **per_target}
    if "loss" not in arrays:
        arrays["loss"] = np.full(per_target["ranks"].shape[0], np.nan)
    data: dict[str, Any] = {k: np.asarray(arrays[k]).astype(t) for k, t in _ARRAYS.items()}
    data.update(
        label=np.array(label),
        seed=np.array(NO_SEED if seed is None else seed, dtype=np.int64),
        dataset=np.array(dataset),
        format=np.array(RANKS_FORMAT, dtype=np.int64),
    )
    if config is not None:
        data["config"] = np.array(json.dumps(config))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **data)
    os.replace(tmp, path)


def load_ranks(path: Path) -> dict[str, Any]:
    """The arrays of a ranks file, with ``label`` and ``dataset`` as str, ``seed`` as int
    or None and ``config`` as a dict (None in files that recorded none)."""
    with np.load(path, allow_pickle=False) as z:
        if int(z["format"]) != RANKS_FORMAT:
            raise ValueError(f"{path}: ranks format {int(z['format'])}, expected {RANKS_FORMAT}")
        out: dict[str, Any] = {k: z[k] for k in _ARRAYS}
        seed = int(z["seed"])
        out.update(
            label=str(z["label"]), dataset=str(z["dataset"]), seed=None if seed == NO_SEED else seed
        )
        out["config"] = json.loads(str(z["config"])) if "config" in z.files else None
    return out
