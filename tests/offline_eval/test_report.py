"""report.md and its plots for any mix of models and overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offline_eval.report import memory_grid, plot_ablation, render_report
from recmem.cli import main

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


def memory_entry(E: int, N: int, ndcg: float, overrides: list[str]) -> dict[str, Any]:
    metrics = {"hr@10": ndcg, "ndcg@10": ndcg, "mrr@10": ndcg, "hr@50": ndcg, "n": 5}
    groups = {g: dict(metrics) for g in ("overall", "recent", "long_term", "new")}
    return {
        **groups,
        "repeat": {**{k: None for k in metrics}, "n": 0},
        "train_seconds": 1.0,
        "eval_seconds": 1.0,
        "config": {
            "kind": "memory",
            "memory": {"n_blocks": E, "horizon": N},
            "best_epoch": 1,
            "overrides": overrides,
        },
    }


def test_ablation_plot_takes_models_with_equal_e_and_n(tmp_path: Path) -> None:
    # two models at (E, N) = (16, 256) that differ in other overrides: once a sort that
    # compared their entries (TypeError: '<' between dicts); now two lines
    models = {
        "memory-static": memory_entry(1, 256, 0.10, []),
        "memory-proteus": memory_entry(16, 256, 0.12, []),
        "memory-proteus[train.lr=3e-3]": memory_entry(16, 256, 0.11, ["train.lr=3e-3"]),
        "memory-proteus[memory.n_blocks=4]": memory_entry(4, 256, 0.115, ["memory.n_blocks=4"]),
        "memory-proteus[memory.n_blocks=4;train.lr=3e-3]": memory_entry(
            4, 256, 0.105, ["memory.n_blocks=4", "train.lr=3e-3"]
        ),
    }
    grid = memory_grid(models)
    assert [(E, N) for _, E, N, _ in grid] == [(1, 256), (4, 256), (4, 256), (16, 256), (16, 256)]
    assert plot_ablation(tmp_path / "a.png", grid)
    assert (tmp_path / "a.png").stat().st_size > 0
    summary = {"dataset": "d", "split": {"n_events": 1}, "models": models}
    assert "## Proteus ablation" in render_report(summary, {})


def test_report_for_a_mix_of_models_and_overrides(tmp_path: Path) -> None:
    models = (
        "sasrec,memory-static,memory-proteus,"
        "memory-proteus[train.patience=20;train.lr=3e-3],memory-proteus[memory.n_blocks=4]"
    )
    sets = [x for s in [*TINY, f"data.cache_dir={tmp_path / 'cache'}"] for x in ("--set", s)]
    out = tmp_path / "o"
    argv = ["eval", "--dataset", "synthetic", "--models", models, "--out", str(out), *sets]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == models.split(",")[:3] + [
        "memory-proteus[train.patience=20;train.lr=3e-3]",
        "memory-proteus[memory.n_blocks=4]",
    ]
    assert all(e["overall"]["n"] > 0 for e in summary["models"].values())
    report = (out / "report.md").read_text()
    assert "## Proteus ablation" in report and "## Ablation" in report
    assert (out / "ablation_ndcg10.png").stat().st_size > 0
    # sasrec is the only baseline; every memory model is compared with it
    assert summary["intervals"]["baseline"] == "sasrec"
    assert len(summary["intervals"]["models"]) == 4
    assert len(list((out / "ranks").iterdir())) == 5
