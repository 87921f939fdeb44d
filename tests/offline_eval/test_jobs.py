"""``recmem eval --jobs``: models (and seeds) trained in spawned worker processes give the same
report as one process; ``--from-runs`` combines earlier runs without training, a model's runs
with different seeds as its seeds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from offline_eval import runner
from offline_eval.jobs import training_groups
from offline_eval.ranks import load_ranks, save_ranks
from offline_eval.results import combine_runs
from recmem.cli import main
from recmem.config import load_config
from tests.offline_eval.test_runner import probe_models, write_long_history_csv  # noqa: F401

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
    # the workers' ranks files were moved next to the merged summary
    for m in models:
        (rel,) = par["models"][m]["ranks"]
        z = load_ranks(tmp_path / "par" / rel)
        assert z["label"] == m and z["ranks"].shape[0] == par["models"][m]["overall"]["n"]


def test_seeds_run_in_parallel_workers(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, f"data.cache_dir={tmp_path / 'cache'}"])
    models = ["pop", "memory-proteus", "memory-proteus-notebank"]
    summary = runner.run_eval(cfg, "synthetic", models, tmp_path / "o", jobs=3, seeds=[3, 4])
    # pop once; memory-proteus with its notebank twin once per seed: three jobs
    jobs = sorted(p.name for p in (tmp_path / "o" / "jobs").iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2"]
    for m in ("memory-proteus", "memory-proteus-notebank"):
        entry = summary["models"][m]
        assert entry["seeds"] == [3, 4] and set(entry["per_seed"]) == {"3", "4"}
        for seed in ("3", "4"):
            unit = entry["per_seed"][seed]
            assert unit["config"]["train"]["seed"] == int(seed)
            assert load_ranks(tmp_path / "o" / unit["ranks"])["seed"] == int(seed)
    notebank = summary["models"]["memory-proteus-notebank"]["per_seed"]
    assert all(notebank[s]["config"]["reused_training"] for s in ("3", "4"))
    assert summary["models"]["pop"]["seeds"] == [None]
    assert summary["intervals"]["baseline"] == "pop"
    assert set(summary["intervals"]["models"]) == set(models[1:])


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
    for entry in summary["models"].values():  # the ranks files came along
        assert (out / entry["ranks"][0]).is_file()
    with pytest.raises(ValueError, match="in none of the runs"):
        combine_runs([tmp_path / "a"], tmp_path / "x", ["nosuch"])
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
        combine_runs([tmp_path / "a", tmp_path / "d"], tmp_path / "x")
    assert main(["eval", "--from-runs", runs, "--seeds", "0,1", "--out", str(out)]) == 2


def seed_runs(tmp_path: Path) -> list[str]:
    """pop and noisy-pop evaluated in tmp_path/s0 (seed 0) and tmp_path/s1 (seed 1); returns
    the `recmem eval` arguments before --models (dataset and cache)."""
    dataset = write_long_history_csv(tmp_path / "events.csv")
    base = ["eval", "--dataset", dataset, "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    models = ["--models", "pop,noisy-pop"]
    assert main([*base, *models, "--out", str(tmp_path / "s0")]) == 0
    assert main([*base, *models, "--set", "train.seed=1", "--out", str(tmp_path / "s1")]) == 0
    return base


@pytest.mark.usefixtures("probe_models")
def test_from_runs_merges_one_run_per_seed(tmp_path: Path) -> None:
    base = seed_runs(tmp_path)
    models = ["--models", "pop,noisy-pop"]
    assert main([*base, *models, "--seeds", "0,1", "--out", str(tmp_path / "both")]) == 0
    out = tmp_path / "merged"
    runs = f"{tmp_path / 's0'},{tmp_path / 's1'}"
    assert main(["eval", "--from-runs", runs, "--out", str(out)]) == 0
    merged = json.loads((out / "summary.json").read_text())
    both = json.loads((tmp_path / "both" / "summary.json").read_text())
    noisy = merged["models"]["noisy-pop"]
    assert noisy["seeds"] == [0, 1]
    assert sorted(p.name for p in (out / "ranks").iterdir()) == [
        "noisy-pop.seed0.npz", "noisy-pop.seed1.npz", "pop.npz",
    ]  # fmt: skip
    # two single-seed runs merged = one run with both seeds
    assert noisy["overall"] == both["models"]["noisy-pop"]["overall"]
    assert noisy["spread"] == both["models"]["noisy-pop"]["spread"]
    assert merged["intervals"]["models"] == both["intervals"]["models"]
    # a run made before ranks files existed still merges; its model just has no interval
    old = json.loads((tmp_path / "s1" / "summary.json").read_text())
    del old["models"]["noisy-pop"]["seeds"], old["models"]["noisy-pop"]["ranks"]
    old.pop("intervals")
    (tmp_path / "s1" / "summary.json").write_text(json.dumps(old))
    assert main(["eval", "--from-runs", runs, "--out", str(tmp_path / "m2")]) == 0
    m2 = json.loads((tmp_path / "m2" / "summary.json").read_text())
    assert m2["models"]["noisy-pop"]["seeds"] == [0, 1]  # from the recorded train.seed
    assert m2["intervals"]["no_ranks"] == ["noisy-pop"]
    assert "Without saved ranks" in (tmp_path / "m2" / "report.md").read_text()


@pytest.mark.usefixtures("probe_models")
def test_from_runs_recovers_a_stopped_run_from_its_ranks_files(tmp_path: Path) -> None:
    seed_runs(tmp_path)
    assert main(["eval", "--from-runs", f"{tmp_path / 's0'},{tmp_path / 's1'}",
                 "--out", str(tmp_path / "whole")]) == 0  # fmt: skip
    # s1 stopped before its summary, and its worker's ranks are one folder down
    for name in ("summary.json", "by_position.json", "report.md"):
        (tmp_path / "s1" / name).unlink()
    (tmp_path / "s1" / "jobs" / "0").mkdir(parents=True)
    (tmp_path / "s1" / "ranks").rename(tmp_path / "s1" / "jobs" / "0" / "ranks")
    out = tmp_path / "recovered"
    assert main(["eval", "--from-runs", f"{tmp_path / 's0'},{tmp_path / 's1'}",
                 "--out", str(out)]) == 0  # fmt: skip
    got = json.loads((out / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    noisy, ref = got["models"]["noisy-pop"], whole["models"]["noisy-pop"]
    assert noisy["seeds"] == [0, 1]
    for group in ("overall", "recent", "long_term", "new"):
        assert noisy[group] == pytest.approx(ref[group])
    for group, row in ref["spread"].items():
        assert noisy["spread"][group] == pytest.approx(row)
    assert json.dumps(got["intervals"]["models"]) == json.dumps(whole["intervals"]["models"])
    assert "recovered" in noisy["per_seed"]["1"]["config"]
    # the ranks file recorded the model's configuration: its kind is not guessed from the name
    assert noisy["per_seed"]["1"]["config"]["kind"] == "memory"
    assert noisy["per_seed"]["1"]["config"]["train"] == {"seed": 1}
    assert noisy["per_seed"]["1"]["train_seconds"] is None
    # a ranks file of another split (here: one target fewer) is refused, not paired
    ranks_file = next((tmp_path / "s1" / "jobs" / "0" / "ranks").glob("noisy-pop*.npz"))
    r = load_ranks(ranks_file)
    per_target = {k: v[:-1] for k, v in r.items() if isinstance(v, np.ndarray) and v.ndim == 1}
    per_target.pop("global_idx")
    save_ranks(ranks_file, label=r["label"], seed=r["seed"], dataset=r["dataset"],
               per_target=per_target, global_idx=r["global_idx"][:-1])  # fmt: skip
    with pytest.raises(ValueError, match="another split"):
        combine_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "y")
    # ranks files alone name no split: a complete run must be among the runs
    with pytest.raises(ValueError, match="only beside a complete run"):
        combine_runs([tmp_path / "s1"], tmp_path / "x")
    with pytest.raises(ValueError, match="neither summary.json nor ranks files"):
        combine_runs([tmp_path / "s0", tmp_path / "cache"], tmp_path / "x")


@pytest.mark.usefixtures("probe_models")
def test_from_runs_refuses_one_model_trained_two_ways(tmp_path: Path) -> None:
    """Seeds of one model name from runs that trained it differently (a default changed
    between the runs) are refused, not averaged; the seed and the time guard may differ."""
    base = seed_runs(tmp_path)

    def record(run: str, **train_or_model: object) -> None:
        path = tmp_path / run / "summary.json"
        s = json.loads(path.read_text())
        entry = s["models"]["noisy-pop"]
        configs = [u["config"] for u in entry.get("per_seed", {}).values()] or [entry["config"]]
        for key, value in train_or_model.items():
            section, field = key.split("__")
            for config in configs:
                config.setdefault(section, {})[field] = value
        path.write_text(json.dumps(s))

    record("s0", model__readout="identity", train__max_seconds=600.0)
    record("s1", model__readout="identity", train__max_seconds=980.0)
    summary, units, _ = combine_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "ok")
    assert [u["seed"] for u in units["noisy-pop"]] == [0, 1]
    record("s1", model__readout="linear")
    with pytest.raises(
        ValueError, match=r"noisy-pop: seed 0 .*seed 1 .*model\.readout: 'identity' vs 'linear'"
    ):
        combine_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "x")
    record("s1", model__readout="identity", train__loss_weight="target")  # an option s0 lacks
    with pytest.raises(ValueError, match=r"train\.loss_weight: '\(not recorded\)' vs 'target'"):
        combine_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "x")
    runs = f"{tmp_path / 's0'},{tmp_path / 's1'}"
    assert main(["eval", "--from-runs", runs, "--out", str(tmp_path / "cli")]) == 2
    assert not (tmp_path / "cli" / "summary.json").exists()
    # a later run that replaces every seed of the earlier one is one configuration
    assert (
        main([*base, "--models", "noisy-pop", "--seeds", "0,1", "--out", str(tmp_path / "s01")])
        == 0
    )
    record("s01", model__readout="linear")
    summary, units, _ = combine_runs([tmp_path / "s0", tmp_path / "s01"], tmp_path / "y")
    assert [u["config"]["model"]["readout"] for u in units["noisy-pop"]] == ["linear", "linear"]
