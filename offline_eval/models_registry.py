"""Registers the trained models with ``recmem eval`` (offline_eval.runner):

- ``sasrec``: our SASRec (max length 200, full-catalog cross-entropy);
- ``memory-static``: the memory recommender with E = 1 (static capacity);
- ``memory-proteus``: the memory recommender with the configured E and N;
- ``memory-proteus-notebank``: the same training, evaluated with NoteBank replay
  (offline_eval.notebank_eval).

Each factory trains on the split's TRAIN prefixes with early stopping on VALID NDCG@10 and
returns (scorer, train_seconds, config); the config records the settings and the training
history so the report can show what was run.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from models.recommender import MemoryRecommender
from models.sasrec import SASRec
from models.train import TrainResult
from offline_eval.evaluate import Scorer
from offline_eval.notebank_eval import NotebankScorer
from offline_eval.runner import register_model
from offline_eval.split import TimeSplit
from offline_eval.training import train_on_split
from recmem.config import Config


def _describe(kind: str, cfg: Config, result: TrainResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": kind,
        "train": dataclasses.asdict(cfg.train),
        "model": dataclasses.asdict(cfg.model),
        "best_epoch": result.best_epoch,
        "best_valid": result.best_valid,
        "stopped": result.stopped,
        "history": result.history,
    }
    if kind == "memory":
        out["memory"] = dataclasses.asdict(cfg.memory)
    return out


def make_sasrec(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    model, result = train_on_split(split, cfg, "sasrec")
    info = _describe("sasrec", cfg, result)
    if isinstance(model, SASRec):
        info["sasrec"] = dataclasses.asdict(model.cfg)
    return model, result.train_seconds, info


def make_memory_static(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    cfg = copy.deepcopy(cfg)
    cfg.memory.n_blocks = 1
    model, result = train_on_split(split, cfg, "memory")
    return model, result.train_seconds, _describe("memory", cfg, result)


_last_memory: tuple[tuple[int, str], MemoryRecommender | SASRec, TrainResult] | None = None
"""The latest memory-proteus training (split id, training settings): memory-proteus and
memory-proteus-notebank of one ``recmem eval`` share it, so replay is compared on the same
weights (and trained once)."""


def _train_memory_proteus(
    split: TimeSplit, cfg: Config
) -> tuple[MemoryRecommender | SASRec, TrainResult, bool]:
    global _last_memory
    sections = {s: dataclasses.asdict(getattr(cfg, s)) for s in ("memory", "model", "train")}
    key = (id(split), repr(sorted(sections.items())))
    if _last_memory is not None and _last_memory[0] == key:
        return _last_memory[1], _last_memory[2], True
    model, result = train_on_split(split, cfg, "memory")
    _last_memory = (key, model, result)
    return model, result, False


def make_memory_proteus(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    model, result, shared = _train_memory_proteus(split, cfg)
    info = _describe("memory", cfg, result)
    info["reused_training"] = shared
    return model, result.train_seconds, info


def make_memory_proteus_notebank(
    split: TimeSplit, cfg: Config
) -> tuple[Scorer, float, dict[str, Any]]:
    model, result, shared = _train_memory_proteus(split, cfg)
    assert isinstance(model, MemoryRecommender)
    scorer = NotebankScorer(model, cfg, split.vocab)
    info = _describe("memory", cfg, result)
    info["reused_training"] = shared
    info["notebank"] = scorer.describe()
    return scorer, result.train_seconds, info


register_model("sasrec", make_sasrec)
register_model("memory-static", make_memory_static)
register_model("memory-proteus", make_memory_proteus)
register_model("memory-proteus-notebank", make_memory_proteus_notebank)
