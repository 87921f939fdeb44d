"""The ``recmem train`` pipeline: dataset -> strict global time split (cached) -> train on
the TRAIN prefixes with early stopping on VALID NDCG@10 (full ranking) -> checkpoint and
``metrics.json``.

``data.dataset = split:PATH.npz`` trains on a split saved with ``TimeSplit.save`` (for
machines without polars, e.g. the GPU box: prepare the split elsewhere, copy the .npz and
its .json).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.recommender import MemoryRecommender
from models.sasrec import SASRec, SASRecConfig, train_sasrec
from models.train import TrainResult, pick_device, seed_everything, train_memory_model
from offline_eval.baselines import train_popularity
from offline_eval.evaluate import evaluate
from offline_eval.split import TimeSplit, load_or_build_split
from recmem.config import Config, set_value
from recmem.modelstore import save_model

log = logging.getLogger(__name__)

SPLIT_PREFIX = "split:"


DEMO_PRESET: dict[str, Any] = {
    "data.dataset": "ml-100k",
    "memory.n_heads": 4,
    "memory.key_dim": 16,
    "memory.value_dim": 16,
    "train.lr": 2e-3,
    "train.eval_every": 50,
    "train.patience": 3,
    "train.max_seconds": 180.0,
}
"""``recmem demo``: a model small enough to train on ML-100K in a few minutes on 2 CPU
cores (one 32-user x 200-event step costs about 1 CPU-second at K = V = 16, 2.8 at 32).
Applied to fields still at their defaults, so ``--set`` and config files win."""


def apply_demo_preset(cfg: Config) -> None:
    """Apply DEMO_PRESET to the fields of ``cfg`` that still hold their default value."""
    defaults = Config()
    for dotted, value in DEMO_PRESET.items():
        sec, name = dotted.split(".")
        if getattr(getattr(cfg, sec), name) == getattr(getattr(defaults, sec), name):
            set_value(cfg, dotted, value, origin="demo preset")


def prepare_split(cfg: Config) -> TimeSplit:
    """The configured dataset's split: a saved split (``split:PATH``) or the cached one."""
    spec = cfg.data.dataset
    if spec.startswith(SPLIT_PREFIX):
        path = Path(spec[len(SPLIT_PREFIX) :]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"split file not found: {path}")
        return TimeSplit.load(path)
    return load_or_build_split(cfg)


def split_summary(split: TimeSplit) -> dict[str, Any]:
    """Counts and boundaries recorded with a trained model."""
    lengths = split.train_prefix_lengths()
    return {
        "dataset": split.dataset,
        "n_events": int(split.n_events),
        "n_train": int(split.n_train),
        "n_users": int(split.seqs.n_users),
        "n_train_users": int((lengths > 0).sum()),
        "n_items": int(split.n_items),
        "boundary_valid_ts": int(split.boundary_valid_ts),
        "boundary_test_ts": int(split.boundary_test_ts),
    }


def valid_callback(model: Any, split: TimeSplit, cfg: Config) -> Callable[[], dict[str, float]]:
    """VALID metrics (overall, full ranking) of ``model``'s current weights."""

    def validate() -> dict[str, float]:
        res = evaluate(model, split, "valid", cfg.eval, progress=False)
        metrics = {k: float(v) for k, v in res["overall"].items()}
        if res.get("loss") is not None:
            metrics["loss"] = float(res["loss"])
        return metrics

    return validate


def build_memory_model(split: TimeSplit, cfg: Config) -> MemoryRecommender:
    seed_everything(cfg.train.seed)
    return MemoryRecommender(split.n_items, split.vocab.n_oov, cfg.memory, cfg.model)


def build_sasrec(split: TimeSplit, cfg: Config) -> SASRec:
    seed_everything(cfg.train.seed)
    return SASRec(split.n_items, split.vocab.n_oov, SASRecConfig(embed_dim=cfg.model.embed_dim))


def train_on_split(
    split: TimeSplit, cfg: Config, kind: str = "memory", validate: bool = True
) -> tuple[MemoryRecommender | SASRec, TrainResult]:
    """Build and train a ``memory`` or ``sasrec`` model on the split's TRAIN prefixes; the
    returned model holds the weights of the best VALID epoch."""
    device = pick_device(cfg.train.device)
    lengths = split.train_prefix_lengths()
    model: MemoryRecommender | SASRec
    if kind == "memory":
        model = build_memory_model(split, cfg).to(device)
        cb = valid_callback(model, split, cfg) if validate else None
        result = train_memory_model(model, split.seqs, cfg.train, lengths, cb, device)
        if cfg.train.replay_steps > 0:
            from offline_eval.replay_training import train_replay  # needs the archive (faiss)

            replay = train_replay(model, split.seqs, lengths, cfg, split.item_cat, device)
            result.replay = replay.as_dict()
            result.train_seconds += replay.seconds
    elif kind == "sasrec":
        model = build_sasrec(split, cfg).to(device)
        cb = valid_callback(model, split, cfg) if validate else None
        result = train_sasrec(model, split.seqs, cfg.train, lengths, cb, device)
    else:
        raise ValueError(f"unknown model kind {kind!r} (memory | sasrec)")
    return model, result


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=float)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_train(cfg: Config, out_dir: str | os.PathLike[str], kind: str = "memory") -> dict[str, Any]:
    """Train on ``cfg.data.dataset`` and write ``out_dir/model.safetensors`` and ``metrics.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    split = prepare_split(cfg)
    summary = split_summary(split)
    device = pick_device(cfg.train.device)
    log.info(
        "training %s on %s: %d TRAIN events, %d items, device %s",
        kind,
        split.dataset,
        summary["n_train"],
        summary["n_items"],
        device,
    )
    model, result = train_on_split(split, cfg, kind)
    # TRAIN popularity rides along for the rank service's cold-start answers.
    popularity = train_popularity(split).astype(np.int64).tolist()
    extra = {
        "split": summary,
        "kind": kind,
        "popularity": popularity,
        # for lexical and candidate-aware NoteBank routing (archive.routing)
        "item_categories": split.item_cat.astype(np.int64).tolist(),
    }
    path = save_model(out, model, split.vocab, cfg, extra)
    metrics: dict[str, Any] = {
        "dataset": split.dataset,
        "model": kind,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "split": summary,
        "history": result.history,
        "best_epoch": result.best_epoch,
        "best_step": result.best_step,
        "steps": result.steps,
        "best_valid": result.best_valid,
        "stopped": result.stopped,
        "train_seconds": result.train_seconds,
        "valid_seconds": result.valid_seconds,
        "train_targets_per_s": result.targets_per_second(),
        "replay_training": result.replay,
        "total_seconds": time.perf_counter() - t0,
        "checkpoint": str(path),
        "config": cfg.to_dict(redact_secrets=True),
    }
    _write_json(out / "metrics.json", metrics)
    return metrics
