"""``recmem eval --jobs``: models trained in spawned worker processes give the same report
as one process; ``--from-runs`` combines earlier runs without training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offline_eval import runner
from offline_eval.jobs import combine_runs, training_groups
from recmem.cli import main
from recmem.config import load_config

TINY = [
    "data.synthetic_users=40",
    "data.synthetic_events=2000",
    "memory.n_layers=1",
    "memory.n_heads=2",
    "memory.key_dim=8",
    "memory.value_dim=8",
    "memory.n_blocks=2",
    "memory.horizon=16",
    "model.embed_dim=16",
    "train.epochs=1",
    "train.device=cpu",
]
MODELS = "pop,memory-proteus,memory-static,memory-proteus-notebank"


def test_training_groups_keep_shared_training_together() -> None:
    cfg = load_config(None, [])
    specs = {
        s: runner.split_model_spec(s)
        for s in runner.parse_models(
            "pop,memory-proteus,memory-static,memory-proteus-notebank,"
            "memory-proteus[memory.n_blocks=4],memory-proteus-notebank[memory.n_blocks=4]"
        )
    }
    groups = training_groups(specs, lambda o: runner.model_config(cfg, o))
    assert groups == [
        ["pop"],
        ["memory-proteus", "memory-proteus-notebank"],
        ["memory-static"],
        ["memory-proteus[memory.n_blocks=4]", "memory-proteus-notebank[memory.n_blocks=4]"],
    ]


def test_parallel_run_matches_serial_run(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, f"data.cache_dir={tmp_path / 'cache'}"])
    models = runner.parse_models(MODELS)
    serial = runner.run_eval(cfg, "synthetic", models, tmp_path / "serial", jobs=1)
    par = runner.run_eval(cfg, "synthetic", models, tmp_path / "par", jobs=3)
    assert par["run"]["jobs"] == 3 and list(par["models"]) == models
    assert par["split"] == serial["split"]
    for m in models:
        s, p = serial["models"][m], par["models"][m]
        assert p["overall"]["n"] == s["overall"]["n"] > 0, m
        assert p["train_seconds"] is not None, m
        # same seeds and data; only the worker's thread count differs
        assert p["overall"]["ndcg@10"] == pytest.approx(s["overall"]["ndcg@10"], abs=2e-3), m
    assert par["models"]["pop"]["overall"] == serial["models"]["pop"]["overall"]
    # memory-proteus-notebank rode on memory-proteus's training, in the same worker
    assert par["models"]["memory-proteus-notebank"]["config"]["reused_training"] is True
    jobs = sorted(p.name for p in (tmp_path / "par" / "jobs").iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2"]
    logs = [(tmp_path / "par" / "jobs" / j / "log.txt").read_text() for j in jobs]
    assert any("memory-proteus-notebank" in t and "fitting on TRAIN" in t for t in logs)
    by_pos = json.loads((tmp_path / "par" / "by_position.json").read_text())
    assert set(by_pos) == set(models)
    assert "memory-static" in (tmp_path / "par" / "report.md").read_text()


def test_failed_worker_is_reported_not_fatal(tmp_path: Path) -> None:
    # train.device names a GPU this machine does not have: the memory worker fails, the
    # others stand, and the failed entry says where its log is
    cfg = load_config(None, [*TINY, f"data.cache_dir={tmp_path / 'cache'}"])
    models = ["pop", "memory-static[train.device=nosuchdevice]"]
    summary = runner.run_eval(cfg, "synthetic", models, tmp_path / "o", jobs=2)
    assert summary["models"]["pop"]["overall"]["n"] > 0
    bad = summary["models"][models[1]]
    assert bad["overall"]["n"] == 0 and "log.txt" in bad["config"]["reason"]


def test_from_runs_combines_without_training(tmp_path: Path) -> None:
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    base = ["eval", "--dataset", "synthetic", "--set", TINY[0], "--set", TINY[1], "--set", cache]
    assert main([*base, "--models", "pop", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--models", "pop[eval.recent_window=5]", "--out", str(tmp_path / "b")]) == 0
    out = tmp_path / "c"
    runs = f"{tmp_path / 'a'},{tmp_path / 'b'}"
    picked = "pop[eval.recent_window=5],pop"
    assert main(["eval", "--from-runs", runs, "--models", picked, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["pop[eval.recent_window=5]", "pop"]
    assert summary["combined_from"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert (out / "report.md").is_file()
    with pytest.raises(ValueError, match="in none of the runs"):
        combine_runs([tmp_path / "a"], ["nosuch"])
    other = [
        "eval",
        "--dataset",
        "synthetic",
        "--set",
        TINY[0],
        "--set",
        "data.synthetic_events=3000",
    ]
    assert main([*other, "--set", cache, "--models", "pop", "--out", str(tmp_path / "d")]) == 0
    with pytest.raises(ValueError, match="split differs"):
        combine_runs([tmp_path / "a", tmp_path / "d"])
