"""Trained-model checkpoints: what ``recmem train`` writes and the service loads.

One file, ``DIR/model.safetensors``: the weights as safetensors tensors, and in its
metadata header one JSON document with the item vocabulary, the configuration the model was
built from (memory and model sections, or SASRec's), caller extras (split boundaries,
dataset, TRAIN popularity) and a model version string. Loading never unpickles anything, so
a model file someone hands over cannot run code. Written aside, fsynced, then renamed, so a
reader sees the old file or the new one, never half of one.

The pickled ``model.pt`` of earlier versions is refused with a clear error;
``python -m recmem.modelstore convert DIR`` rewrites one as safetensors, reading it with
``torch.load(weights_only=True)`` (tensors and plain containers only, nothing executed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from models.recommender import MemoryRecommender
from models.sasrec import SASRec, SASRecConfig
from recmem.config import Config
from recmem.vocab import ItemVocab

MODEL_FILE = "model.safetensors"
LEGACY_FILE = "model.pt"
"""The pickle format of earlier versions (refused; see ``convert_legacy``)."""
FORMAT_VERSION = 2
META_KEY = "recmem"


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
    """Write ``directory/model.safetensors`` atomically; returns its path. ``extra`` must be
    JSON: numbers, strings, lists and dicts."""
    kind = model_kind(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    digest = _weights_digest(state)
    name = kind
    if kind == "memory":
        name = f"memory-E{cfg.memory.n_blocks}-N{cfg.memory.horizon}"
    meta = {
        "format_version": FORMAT_VERSION,
        "model_version": f"{name}-{digest}",
        "kind": kind,
        "n_items": vocab.n_items,
        "vocab": vocab.to_dict(),
        "config": cfg.to_dict(redact_secrets=True),
        "sasrec": dataclasses.asdict(model.cfg) if isinstance(model, SASRec) else {},
        "extra": dict(extra or {}),
    }
    return _write(Path(directory), state, meta)


def _write(out: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    # tied weights share storage, which safetensors refuses: every tensor its own copy
    tensors = {k: v.contiguous().clone() for k, v in state.items()}
    data = save_tensors(tensors, metadata={META_KEY: json.dumps(meta, default=_plain)})
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{MODEL_FILE}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MODEL_FILE)
    dir_fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return out / MODEL_FILE


def _plain(value: Any) -> Any:
    """numpy scalars and arrays in extras as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"model extras must be JSON, got {type(value).__name__}")


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        data = path.read_bytes()
        tensors = load_tensors(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"][META_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a readable recmem model checkpoint ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format")
    return tensors, meta


def load_model(
    directory: str | os.PathLike[str], device: torch.device | str = "cpu"
) -> tuple[nn.Module, ItemVocab, Config, dict[str, Any]]:
    """(model in eval mode on ``device``, vocabulary, configuration, extras). The extras
    also carry ``model_version``."""
    path = Path(directory) / MODEL_FILE
    if not path.is_file():
        legacy = Path(directory) / LEGACY_FILE
        if legacy.is_file():
            raise ValueError(
                f"{legacy}: a model in the pickle format of earlier recmem versions, which is "
                "no longer loaded (unpickling a file can run code). Train it again, or convert "
                f"a file you trust: python -m recmem.modelstore convert {directory}"
            )
        raise FileNotFoundError(f"no trained model at {path}")
    state, meta = _read(path)
    vocab = ItemVocab.from_dict(meta["vocab"])
    conf = meta["config"]
    if meta.get("kind") == "memory" and "readout" not in conf.get("model", {}):
        # saved before model.readout existed: those models have the learned linear read-out
        conf = {**conf, "model": {**conf.get("model", {}), "readout": "linear"}}
    cfg = Config.from_dict(conf)
    model = build_model(meta["kind"], vocab.n_items, vocab.n_oov, cfg, meta["sasrec"])
    model.load_state_dict(state)
    model.to(device).eval()
    extra = dict(meta["extra"])
    extra["model_version"] = meta["model_version"]
    return model, vocab, cfg, extra


def convert_legacy(directory: str | os.PathLike[str]) -> Path:
    """Rewrite DIR/model.pt (the earlier pickle format) as DIR/model.safetensors. Reads it
    with ``torch.load(weights_only=True)``: tensors and plain containers only."""
    legacy = Path(directory) / LEGACY_FILE
    payload = torch.load(legacy, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format_version") != 1:
        raise ValueError(f"{legacy}: not a recmem model checkpoint of format 1")
    meta = {k: v for k, v in payload.items() if k != "state_dict"}
    meta["format_version"] = FORMAT_VERSION
    return _write(Path(directory), dict(payload["state_dict"]), meta)


def adopt_model_config(cfg: Config, model_cfg: Config) -> None:
    """Take a loaded model's memory and model sections (its shapes and schedule) into the
    running configuration, keeping the running ``memory.backend``: the kernel is how this
    machine computes the rule, not part of the model (a model trained on CPU with
    ``recurrent`` should use ``auto`` -> Triton when served on a GPU). The model shares
    ``model_cfg.memory``, so it follows the change."""
    backend = cfg.memory.backend
    cfg.memory, cfg.model = model_cfg.memory, model_cfg.model
    cfg.memory.backend = backend


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "convert":
        sys.exit("usage: python -m recmem.modelstore convert DIR")
    print(convert_legacy(sys.argv[2]))
