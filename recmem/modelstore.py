"""Trained-model checkpoints: what ``recmem train`` writes and the service loads.

One file, ``DIR/model.pt``: the weights, the item vocabulary, the configuration the model
was built from (memory and model sections, or SASRec's), caller extras (split boundaries,
dataset) and a model version string. Written aside, fsynced, then renamed, so a reader sees
the old file or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.recommender import MemoryRecommender
from models.sasrec import SASRec, SASRecConfig
from recmem.config import Config
from recmem.vocab import ItemVocab

MODEL_FILE = "model.pt"
FORMAT_VERSION = 1


def model_kind(model: nn.Module) -> str:
    if isinstance(model, MemoryRecommender):
        return "memory"
    if isinstance(model, SASRec):
        return "sasrec"
    raise ValueError(f"cannot save a model of type {type(model).__name__}")


def _weights_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def build_model(
    kind: str, n_items: int, n_oov: int, cfg: Config, sasrec: dict[str, Any]
) -> nn.Module:
    """A fresh (untrained) model of ``kind`` with the given shapes and configuration."""
    if kind == "memory":
        return MemoryRecommender(n_items, n_oov, cfg.memory, cfg.model)
    if kind == "sasrec":
        return SASRec(n_items, n_oov, SASRecConfig(**sasrec))
    raise ValueError(f"unknown model kind {kind!r} in checkpoint")


def save_model(
    directory: str | os.PathLike[str],
    model: nn.Module,
    vocab: ItemVocab,
    cfg: Config,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``directory/model.pt`` atomically; returns its path."""
    kind = model_kind(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    digest = _weights_digest(state)
    name = kind
    if kind == "memory":
        name = f"memory-E{cfg.memory.n_blocks}-N{cfg.memory.horizon}"
    payload = {
        "format_version": FORMAT_VERSION,
        "model_version": f"{name}-{digest}",
        "kind": kind,
        "n_items": vocab.n_items,
        "state_dict": state,
        "vocab": vocab.to_dict(),
        "config": cfg.to_dict(redact_secrets=True),
        "sasrec": dataclasses.asdict(model.cfg) if isinstance(model, SASRec) else {},
        "extra": dict(extra or {}),
    }
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(payload, buf)
    tmp = out / f".{MODEL_FILE}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MODEL_FILE)
    dir_fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return out / MODEL_FILE


def load_model(
    directory: str | os.PathLike[str], device: torch.device | str = "cpu"
) -> tuple[nn.Module, ItemVocab, Config, dict[str, Any]]:
    """(model in eval mode on ``device``, vocabulary, configuration, extras). The extras
    also carry ``model_version``."""
    path = Path(directory) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no trained model at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one clear message
        raise ValueError(f"{path}: not a readable recmem model checkpoint ({e})") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format")
    vocab = ItemVocab.from_dict(payload["vocab"])
    cfg = Config.from_dict(payload["config"])
    model = build_model(payload["kind"], vocab.n_items, vocab.n_oov, cfg, payload["sasrec"])
    model.load_state_dict(payload["state_dict"])
    model.to(device).eval()
    extra = dict(payload["extra"])
    extra["model_version"] = payload["model_version"]
    return model, vocab, cfg, extra


def adopt_model_config(cfg: Config, model_cfg: Config) -> None:
    """Take a loaded model's memory and model sections (its shapes and schedule) into the
    running configuration, keeping the running ``memory.backend``: the kernel is how this
    machine computes the rule, not part of the model (a model trained on CPU with
    ``recurrent`` should use ``auto`` -> Triton when served on a GPU). The model shares
    ``model_cfg.memory``, so it follows the change."""
    backend = cfg.memory.backend
    cfg.memory, cfg.model = model_cfg.memory, model_cfg.model
    cfg.memory.backend = backend
