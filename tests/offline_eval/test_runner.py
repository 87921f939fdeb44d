from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from offline_eval import models_registry, runner
from offline_eval.baselines import make_pop
from offline_eval.split import TimeSplit, load_or_build_split, split_cache_path
from recmem.cli import main
from recmem.config import Config, load_config

SET = ["--set", "data.synthetic_users=60", "--set", "data.synthetic_events=4000"]


def test_eval_cli_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    cache = ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    not_yet = models_registry.RegisteredModel(None, reason="not built yet")
    monkeypatch.setitem(models_registry._MODELS, "not-yet-model", not_yet)
    argv = ["eval", "--dataset", "synthetic", "--models", "pop,not-yet-model"]
    assert main([*argv, "--out", str(out), *SET, *cache]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"dataset", "split", "models", "run"}
    assert summary["run"]["jobs"] == 1 and summary["run"]["wall_seconds"] >= 0
    assert summary["dataset"] == "synthetic"
    sp = summary["split"]
    assert set(sp) == {
        "n_events", "n_train", "n_valid_targets", "n_test_targets", "excluded_cold_item",
        "excluded_first_event", "boundary_valid_ts", "boundary_test_ts",
    }  # fmt: skip
    assert sp["n_events"] == 4000 and sp["n_train"] == 3200
    assert sp["boundary_valid_ts"] <= sp["boundary_test_ts"]
    assert set(summary["models"]) == {"pop", "not-yet-model"}
    pop = summary["models"]["pop"]
    assert set(pop) == {
        "overall", "recent", "long_term", "new", "repeat", "train_seconds", "eval_seconds",
        "config",
    }  # fmt: skip
    assert set(pop["overall"]) == {"hr@10", "ndcg@10", "mrr@10", "hr@50", "n"}
    assert pop["overall"]["n"] == sp["n_test_targets"] > 0
    assert sum(pop[s]["n"] for s in ("recent", "long_term", "new")) == sp["n_test_targets"]
    assert 0.0 <= pop["overall"]["ndcg@10"] <= pop["overall"]["hr@10"] <= 1.0
    # TEST targets + exclusions = TEST events
    assert sp["n_test_targets"] + sp["excluded_cold_item"] + sp["excluded_first_event"] == 400
    nb = summary["models"]["not-yet-model"]
    assert nb["config"]["available"] is False and nb["config"]["reason"]
    assert nb["overall"]["n"] == 0
    report = (out / "report.md").read_text()
    assert "not-yet-model" in report and "not available" in report
    assert (out / "by_position.png").stat().st_size > 0
    assert (out / "strata_ndcg10.png").stat().st_size > 0
    by_pos = json.loads((out / "by_position.json").read_text())
    assert sum(b["n"] for b in by_pos["pop"].values()) == sp["n_test_targets"]


def test_unknown_model_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        runner.parse_models("pop,nosuchmodel")
    assert main(["eval", "--models", "nosuch", "--out", str(tmp_path)]) == 2


def test_register_model_and_split_cache(tmp_path: Path) -> None:
    cfg = load_config(None, [*(s for s in SET if s != "--set"), f"data.cache_dir={tmp_path}"])
    split = load_or_build_split(cfg, "synthetic")
    assert split_cache_path(cfg, "synthetic").is_file()
    again = TimeSplit.load(split_cache_path(cfg, "synthetic"))
    assert np.array_equal(again.seqs.items, split.seqs.items)

    calls: list[str] = []

    def factory(s: TimeSplit, c: object) -> tuple[object, float, dict[str, object]]:
        calls.append(s.dataset)
        return make_pop(s, c)[0], 1.5, {"kind": "pop-again"}

    models_registry.register_model("pop-again", factory)
    try:
        summary = runner.run_eval(
            cfg, "synthetic", ["pop-again"], tmp_path / "o", write_report=False
        )
    finally:
        models_registry._MODELS.pop("pop-again")
    assert calls == ["synthetic"]
    assert summary["models"]["pop-again"]["train_seconds"] == 1.5


def test_model_spec_overrides(tmp_path: Path) -> None:
    specs = runner.parse_models(
        "pop, pop[memory.n_blocks=4;memory.horizon=64],pop[eval.batch_users=7]"
    )
    assert specs == ["pop", "pop[memory.n_blocks=4;memory.horizon=64]", "pop[eval.batch_users=7]"]
    name, overrides = runner.split_model_spec(specs[1])
    assert name == "pop" and overrides == ["memory.n_blocks=4", "memory.horizon=64"]
    cfg = load_config(None, [])
    changed = runner.model_config(cfg, overrides)
    assert (changed.memory.n_blocks, changed.memory.horizon) == (4, 64)
    assert cfg.memory.n_blocks != 4 or cfg.memory.horizon != 64  # the original is untouched
    with pytest.raises(ValueError):
        runner.model_config(cfg, ["memory.n_blocks=0"])
    with pytest.raises(ValueError):
        runner.split_model_spec("pop[n_blocks=4]")
    with pytest.raises(ValueError, match="unknown model"):
        runner.parse_models("nosuch[memory.n_blocks=4]")

    seen: list[int] = []

    def factory(s: TimeSplit, c: Config) -> tuple[object, float, dict[str, object]]:
        seen.append(c.memory.n_blocks)
        return make_pop(s, c)[0], 0.0, {"kind": "probe"}

    models_registry.register_model("probe", factory)
    try:
        cfg = load_config(None, [*(s for s in SET if s != "--set"), f"data.cache_dir={tmp_path}"])
        models = runner.parse_models("probe[memory.n_blocks=2],probe[memory.n_blocks=8]")
        summary = runner.run_eval(cfg, "synthetic", models, tmp_path / "o")
    finally:
        models_registry._MODELS.pop("probe")
    report = (tmp_path / "o" / "report.md").read_text()
    assert "## Ablation" in report and "| probe | memory.n_blocks=8 |" in report
    assert seen == [2, 8]
    assert list(summary["models"]) == models
    assert summary["models"][models[0]]["config"]["overrides"] == ["memory.n_blocks=2"]


def test_planted_probe_on_synthetic(tmp_path: Path) -> None:
    cfg = load_config(None, [*(s for s in SET if s != "--set"), f"data.cache_dir={tmp_path}"])
    split = load_or_build_split(cfg, "synthetic")
    assert set(split.planted) >= {"is_recall", "long_term_session", "session_category"}
    loaded = TimeSplit.load(split_cache_path(cfg, "synthetic"))
    assert np.array_equal(loaded.planted["is_recall"], split.planted["is_recall"])
    # the planted session category of a non-recall event is its item's category
    plain = ~split.planted["is_recall"]
    keys = np.array(split.cat_keys)[split.event_cat[plain]]
    assert (keys == np.char.add("c", split.planted["session_category"][plain].astype(str))).all()
    summary = runner.run_eval(cfg, "synthetic", ["pop"], tmp_path / "o")
    probe = json.loads((tmp_path / "o" / "planted.json").read_text())["pop"]
    n = summary["split"]["n_test_targets"]
    assert probe["planted_recall"]["n"] + probe["planted_other"]["n"] == n
    assert probe["planted_recall"]["n"] > 0
    assert "Planted structure" in (tmp_path / "o" / "report.md").read_text()


def test_prepare_split_then_eval_from_it(tmp_path: Path) -> None:
    cache = ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    path = tmp_path / "prepared" / "syn.npz"
    base = ["eval", "--dataset", "synthetic", *SET, *cache]
    assert main([*base, "--prepare-split", str(path)]) == 0
    assert path.is_file() and path.with_suffix(".json").is_file()
    out = tmp_path / "out"
    assert main(["eval", "--split", str(path), "--models", "pop", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["split"]["n_events"] == 4000
    assert main(["eval", "--split", str(path), "--models", "pop"]) == 2  # --out missing


def test_a_missing_package_names_itself_and_spares_the_other_models(tmp_path: Path) -> None:
    # a fresh interpreter in which `import faiss` fails, as on a machine without it
    script = textwrap.dedent(
        f"""
        import importlib.abc, json, sys

        class NoFaiss(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "faiss":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NoFaiss())
        from offline_eval.runner import parse_models
        from offline_eval.models_registry import available_models
        from recmem.cli import main

        print(json.dumps(available_models()))
        parse_models("pop,sasrec,memory-proteus-notebank")  # known, though not runnable
        sys.exit(main(["eval", "--dataset", "synthetic", "--models",
                       "pop,memory-proteus-notebank", "--out", {str(tmp_path / "o")!r},
                       "--set", "data.synthetic_users=60", "--set", "data.synthetic_events=4000",
                       "--set", "data.cache_dir={tmp_path / "cache"}"]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    known = json.loads(done.stdout.splitlines()[0])
    reason = "memory-proteus-notebank needs faiss (pip install faiss-cpu)"
    assert known["memory-proteus-notebank"] == reason
    assert all(known[m] == "" for m in ("pop", "sasrec", "memory-static", "memory-proteus"))
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["models"]["pop"]["overall"]["n"] > 0
    assert summary["models"]["memory-proteus-notebank"]["config"]["reason"] == reason
    assert reason in (tmp_path / "o" / "report.md").read_text()


def test_missing_package_reason() -> None:
    err = ModuleNotFoundError("No module named 'grpc_health.v1'", name="grpc_health.v1")
    assert models_registry.missing_package_reason("m", err) == (
        "m needs grpc_health.v1 (pip install grpcio-health-checking)"
    )
    own = ModuleNotFoundError("No module named 'recmem.nosuch'", name="recmem.nosuch")
    assert "cannot be imported" in models_registry.missing_package_reason("m", own)
