"""Replay variants in ``recmem eval`` (offline_eval/models_registry.py, jobs.py): every
variant of one base setting starts from one base training (or one ``eval.checkpoint``), so
replay on and off, and each fusion and routing, are compared on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from offline_eval import runner
from offline_eval.jobs import training_groups
from offline_eval.ranks import load_ranks
from recmem.config import Config

GATE = "model.replay_fusion=gate;train.replay_steps=2"


def small_cfg(tmp_path: Path) -> Config:
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.synthetic_users = 30
    cfg.data.synthetic_events = 1500
    cfg.memory.n_layers = 1
    cfg.memory.n_heads = 2
    cfg.memory.key_dim = 8
    cfg.memory.n_blocks = 4
    cfg.memory.horizon = 32
    cfg.memory.value_dim = 8
    cfg.model.embed_dim = 16
    cfg.model.window = 4
    cfg.train.epochs = 1
    cfg.train.device = "cpu"
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.address_dim = 8
    cfg.archive.replay_notes = 2
    return cfg


def test_replay_variants_share_the_base_training(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path)
    models = [
        "memory-proteus",
        f"memory-proteus[{GATE}]",
        f"memory-proteus-notebank[{GATE}]",
        f"memory-proteus-notebank[{GATE};archive.routing=lexical]",
        "memory-proteus[memory.unlock=narrow]",
    ]
    specs = {m: runner.split_model_spec(m) for m in models}
    groups = training_groups(specs, lambda o: runner.model_config(cfg, o))
    assert groups == [models[:4], models[4:]]  # one base training for the replay variants
    out = tmp_path / "o"
    summary = runner.run_eval(cfg, "synthetic", models, out, write_report=False)
    entries = summary["models"]
    plain, gate = entries[models[0]], entries[models[1]]
    valid = {m: entries[m]["config"]["best_valid"]["ndcg@10"] for m in models[:4]}
    assert len(set(valid.values())) == 1  # the same base weights underneath
    # replay off on the replay-trained model is the base model: the same ranks
    ranks = {m: load_ranks(out / entries[m]["ranks"][0]) for m in models[:2]}
    assert np.array_equal(ranks[models[0]]["ranks"], ranks[models[1]]["ranks"])
    assert gate["overall"] == plain["overall"]
    # the gate trained once per routing it replays with
    assert gate["config"]["replay_training"]["steps"] == 2
    assert entries[models[2]]["config"]["reused_training"]  # same settings as models[1]
    lexical = entries[models[3]]
    assert not lexical["config"]["reused_training"]
    assert lexical["config"]["notebank"]["routing"] == "lexical"
    assert lexical["config"]["replay_training"]["steps"] == 2


def test_replay_variant_of_a_checkpoint(tmp_path: Path) -> None:
    from offline_eval.training import run_train

    cfg = small_cfg(tmp_path)
    cfg.data.dataset = "synthetic"
    run_train(cfg, tmp_path / "model")
    cfg.eval.checkpoint = str(tmp_path / "model")
    cfg.train.seed = 3  # as the GPU plan runs a seed's variants on that seed's base
    models = ["memory-proteus", f"memory-proteus-notebank[{GATE}]"]
    summary = runner.run_eval(cfg, "synthetic", models, tmp_path / "o", write_report=False)
    assert summary["models"][models[1]]["seeds"] == [3]  # merges with other seeds' runs
    nb = summary["models"][models[1]]["config"]
    assert nb["checkpoint"] == str(tmp_path / "model")
    assert nb["replay_training"]["steps"] == 2
    assert nb["model"]["replay_fusion"] == "gate"
