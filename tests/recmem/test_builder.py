"""The builder's consumer group: ``{model_version}`` in ``kafka.group_id`` gives each served
model version a group of its own (the rollout path of docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from models.recommender import MemoryRecommender
from recmem.config import Config
from recmem.engine.builder import build_engine
from recmem.modelstore import save_model
from recmem.vocab import ItemVocab
from tests.recmem.test_engine import small_config


def config_with_model(tmp_path: Path, seed: int) -> Config:
    cfg = small_config()
    cfg.server.model_dir = str(tmp_path / f"model{seed}")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.state.spill_dir = str(tmp_path / f"spill{seed}")
    cfg.kafka.group_id = "recmem-{model_version}"
    torch.manual_seed(seed)
    vocab = ItemVocab([f"i{j}" for j in range(30)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    save_model(cfg.server.model_dir, model, vocab, cfg)
    return cfg


def test_group_id_names_the_served_model_version(tmp_path: Path) -> None:
    groups = []
    for seed in (0, 1):
        built = build_engine(config_with_model(tmp_path, seed), device="cpu")
        try:
            assert built.group_id == f"recmem-{built.model_version}"
            assert "{" not in built.group_id and built.model_version.startswith("memory-")
            groups.append(built.group_id)
        finally:
            built.close()
    # other weights, another version: the two models never share a consumer group
    assert groups[0] != groups[1]


def test_route_device_puts_the_batched_route_on_the_rank_device(tmp_path: Path) -> None:
    """archive.route_device: cpu (default) = the numpy route (no torch device on the bank);
    rank = the torch route on the engine's device."""
    for setting, want in (("cpu", None), ("rank", torch.device("cpu"))):
        cfg = config_with_model(tmp_path, 0)
        cfg.archive.route_device = setting
        built = build_engine(cfg, device="cpu")
        try:
            bank = built.engine.bank
            assert bank is not None and bank.route_device == want
        finally:
            built.close()
