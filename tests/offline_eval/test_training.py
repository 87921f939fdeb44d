"""``recmem train`` end to end on a small CSV: split, training with early stopping on VALID,
checkpoint and metrics.json; a prepared split file; the demo preset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from offline_eval.training import SPLIT_PREFIX, apply_demo_preset, prepare_split, run_train
from recmem.cli import main
from recmem.config import Config
from recmem.modelstore import load_model
from tests.models.test_train import tiny_config


def write_csv(path: Path, n_users: int = 30, n_items: int = 25, per_user: int = 20) -> None:
    rng = np.random.default_rng(0)
    lines = ["user_id,item_id,timestamp,category"]
    for u in range(n_users):
        start, stride = rng.integers(0, n_items), 1 + u % 3
        t0 = 1_600_000_000 + int(rng.integers(0, 10_000))
        for j in range(per_user):
            item = (start + stride * j) % n_items
            lines.append(f"u{u},i{item},{t0 + 3600 * j + u},G{item % 4}")
    path.write_text("\n".join(lines) + "\n")


def tiny_cfg(tmp_path: Path, dataset: str) -> Config:
    cfg = tiny_config(epochs=3)
    cfg.model.dropout = Config().model.dropout  # these tests train with the default dropout
    cfg.model.n_oov_buckets = 4
    cfg.data.dataset = dataset
    cfg.data.cache_dir = str(tmp_path / "cache")
    return cfg


def test_run_train_writes_checkpoint_and_metrics(tmp_path: Path) -> None:
    csv = tmp_path / "events.csv"
    write_csv(csv)
    cfg = tiny_cfg(tmp_path, f"csv:{csv}")
    cfg.server.auth_token, cfg.kafka.sasl_password = "token-t0p", "passw0rd-x"
    out = tmp_path / "model"
    metrics = run_train(cfg, out)
    text = (out / "metrics.json").read_text()
    assert "token-t0p" not in text and "passw0rd-x" not in text  # secrets are masked
    saved = json.loads(text)
    assert saved["best_valid"] == pytest.approx(metrics["best_valid"])
    assert set(saved["best_valid"]) >= {"hr@10", "ndcg@10", "mrr@10", "hr@50", "n"}
    assert saved["best_valid"]["n"] > 0
    assert 1 <= saved["best_epoch"] <= 3 and len(saved["history"]) >= 1
    assert all("valid" in h and "train_loss" in h for h in saved["history"])
    assert saved["split"]["n_train"] == int(0.8 * 600)
    assert saved["config"]["memory"]["key_dim"] == 8 and saved["device"] == "cpu"
    model, vocab, cfg2, extra = load_model(out)
    assert cfg2.server.auth_token == cfg2.kafka.sasl_password == "***"
    assert vocab.n_items == saved["split"]["n_items"]
    assert extra["split"]["boundary_valid_ts"] == saved["split"]["boundary_valid_ts"]
    # The checkpoint holds the best epoch's weights: re-evaluating gives best_valid.
    from offline_eval.evaluate import evaluate

    split = prepare_split(cfg)
    again = evaluate(model, split, "valid", cfg.eval, progress=False)["overall"]
    assert again["ndcg@10"] == pytest.approx(saved["best_valid"]["ndcg@10"], abs=1e-6)


def test_train_from_a_prepared_split_and_cli(tmp_path: Path) -> None:
    csv = tmp_path / "events.csv"
    write_csv(csv, n_users=12, per_user=10)
    cfg = tiny_cfg(tmp_path, f"csv:{csv}")
    split_path = tmp_path / "prepared.npz"
    prepare_split(cfg).save(split_path)
    cfg.data.dataset = SPLIT_PREFIX + str(split_path)
    cfg.train.epochs = 1
    m1 = run_train(cfg, tmp_path / "a", kind="sasrec")
    assert m1["model"] == "sasrec" and m1["dataset"] == "events"
    sets = [
        f"--set=data.cache_dir={tmp_path / 'cache'}",
        "--set=memory.key_dim=8",
        "--set=memory.value_dim=8",
        "--set=memory.n_heads=2",
        "--set=memory.n_blocks=2",
        "--set=model.embed_dim=16",
        "--set=model.n_oov_buckets=4",
        "--set=train.epochs=1",
        "--set=train.device=cpu",
    ]
    rc = main(["train", "--split", str(split_path), "--out", str(tmp_path / "b"), *sets])
    assert rc == 0
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["model"] == "memory"
    with pytest.raises(FileNotFoundError):
        cfg.data.dataset = SPLIT_PREFIX + str(tmp_path / "missing.npz")
        prepare_split(cfg)


def test_demo_preset_keeps_user_choices() -> None:
    cfg = Config()
    cfg.memory.key_dim = 8
    apply_demo_preset(cfg)
    assert cfg.memory.key_dim == 8
    assert cfg.memory.value_dim == 16 and cfg.train.max_seconds > 0
    assert cfg.data.dataset == "ml-100k"


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parents[2].joinpath("configs").glob("*.toml"))
)
def test_example_configs_load(path: Path) -> None:
    from recmem.config import load_config

    cfg = load_config(path, environ={})
    assert cfg.train.epochs >= 1 and cfg.memory.n_blocks >= 1


def test_eval_of_a_trained_checkpoint(tmp_path: Path) -> None:
    """eval.checkpoint: memory-proteus(-notebank) evaluate a `recmem train` output instead of
    training, on the split it was trained on only."""
    from offline_eval.evaluate import evaluate
    from offline_eval.runner import run_eval

    csv = tmp_path / "events.csv"
    write_csv(csv)
    cfg = tiny_cfg(tmp_path, f"csv:{csv}")
    run_train(cfg, tmp_path / "model")
    ecfg = tiny_cfg(tmp_path, f"csv:{csv}")
    ecfg.memory.key_dim = ecfg.memory.value_dim = 4  # the checkpoint's sections win
    ecfg.eval.checkpoint = str(tmp_path / "model")
    summary = run_eval(ecfg, f"csv:{csv}", ["memory-proteus"], tmp_path / "e")
    entry = summary["models"]["memory-proteus"]
    assert entry["train_seconds"] == 0.0 and entry["config"]["stopped"] == "checkpoint"
    assert entry["config"]["memory"]["key_dim"] == 8
    model = load_model(tmp_path / "model")[0]
    direct = evaluate(model, prepare_split(cfg), "test", cfg.eval, progress=False)["overall"]
    assert entry["overall"]["ndcg@10"] == pytest.approx(direct["ndcg@10"], abs=1e-6)
    # a different split (other data) is refused with a message
    other = tmp_path / "other.csv"
    write_csv(other, n_items=30)
    with pytest.raises(ValueError, match="vocabulary|boundaries"):
        run_eval(ecfg, f"csv:{other}", ["memory-proteus"], tmp_path / "f")
    # a checkpoint that is not there fails before the split is built or anything trains
    ecfg.eval.checkpoint = str(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="eval.checkpoint"):
        run_eval(ecfg, f"csv:{other}", ["memory-proteus"], tmp_path / "g")
    assert not (tmp_path / "g").exists()
