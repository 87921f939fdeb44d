from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from offline_eval import models_registry, runner
from offline_eval.baselines import make_pop
from offline_eval.metrics import metrics_from_ranks
from offline_eval.ranks import load_ranks, ranks_filename
from offline_eval.split import TimeSplit, load_or_build_split, split_cache_path
from offline_eval.strata import position_bucket_labels, position_buckets
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
    assert set(summary) == {"dataset", "split", "models", "run", "intervals"}
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
        "config", "seeds", "ranks",
    }  # fmt: skip
    assert pop["seeds"] == [None] and pop["ranks"] == ["ranks/pop.npz"]
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
    # no baseline to compare pop with but itself: no model rows, and the report says how
    assert summary["intervals"]["baseline"] == "pop" and summary["intervals"]["models"] == {}
    assert "paired bootstrap 95% interval" in report


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
    # every spec has its own ranks file, named after the spec, holding the spec as its label
    for m in models:
        (rel,) = summary["models"][m]["ranks"]
        assert rel == f"ranks/{ranks_filename(m, 0)}"
        assert load_ranks(tmp_path / "o" / rel)["label"] == m


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


def write_long_history_csv(path: Path) -> str:
    """A small catalog (40 items, Zipf popularity, with repeats) and users of 200 to 900
    events, so TEST has targets both before and past position 501; returns the dataset spec."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 41)
    weights /= weights.sum()
    lines = ["user_id,item_id,timestamp,category"]
    for u, length in enumerate((200, 400, 700, 900)):
        ts = np.sort(rng.integers(0, 10**6, size=length)) + 10**9
        for t, i in zip(ts, rng.choice(40, size=length, p=weights), strict=True):
            lines.append(f"u{u},i{i},{t},c{i % 7}")
    path.write_text("\n".join(lines) + "\n")
    return f"csv:{path}"


class ItemScores:
    """A scorer whose score depends on the item only (user vector 1)."""

    def __init__(self, scores: np.ndarray) -> None:
        self._items = torch.from_numpy(scores.astype(np.float64)).unsqueeze(1)

    def user_vectors(
        self, seqs: object, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        return torch.ones(len(query_rows), 1, dtype=torch.float64)

    def item_matrix(self) -> torch.Tensor:
        return self._items


@pytest.fixture
def probe_models() -> Iterator[list[int]]:
    """Registers, for one test: "pop-twin" (pop's scores, reported as a memory model, takes no
    seed), "noisy-pop" (pop's scores plus noise drawn with train.seed, a memory model; the
    seeds it was fitted with are yielded) and "reverse-pop" (a baseline ranking the least
    popular items first)."""
    fitted: list[int] = []

    def twin(s: TimeSplit, c: Config) -> tuple[object, float, dict[str, object]]:
        return make_pop(s, c)[0], 0.0, {"kind": "memory"}

    def noisy(s: TimeSplit, c: Config) -> tuple[object, float, dict[str, object]]:
        fitted.append(c.train.seed)
        pop = make_pop(s, c)[0].item_matrix()[:, 0].numpy()
        noise = np.random.default_rng(c.train.seed).normal(0.0, 1.0, size=pop.shape[0])
        return ItemScores(pop + noise), 0.0, {"kind": "memory", "train": {"seed": c.train.seed}}

    def reverse(s: TimeSplit, c: Config) -> tuple[object, float, dict[str, object]]:
        return ItemScores(-make_pop(s, c)[0].item_matrix()[:, 0].numpy()), 0.0, {"kind": "rev"}

    models_registry.register_model("pop-twin", twin, seeded=False)
    models_registry.register_model("noisy-pop", noisy)
    models_registry.register_model("reverse-pop", reverse, seeded=False)
    try:
        yield fitted
    finally:
        for name in ("pop-twin", "noisy-pop", "reverse-pop"):
            models_registry._MODELS.pop(name)


def test_ranks_file_matches_the_summary(tmp_path: Path) -> None:
    dataset = write_long_history_csv(tmp_path / "events.csv")
    cfg = load_config(None, [f"data.cache_dir={tmp_path / 'cache'}"])
    summary = runner.run_eval(cfg, dataset, ["pop"], tmp_path / "o")
    pop = summary["models"]["pop"]
    z = load_ranks(tmp_path / "o" / pop["ranks"][0])
    assert (z["label"], z["seed"], z["dataset"]) == ("pop", None, summary["dataset"])
    split = load_or_build_split(cfg, dataset)
    targets = split.targets("test", cfg.eval.exclude_seen)
    assert np.array_equal(z["rows"], targets.rows)
    assert np.array_equal(z["global_idx"], split.seqs.global_idx[targets.rows])
    assert np.array_equal(z["users"], targets.users)
    # positions are 1-based lifetime positions: the row's offset inside its user, plus 1
    assert np.array_equal(z["positions"], targets.rows - split.seqs.offsets[targets.users] + 1)
    assert z["ranks"].dtype == np.int32 and z["ranks"].min() == 0  # 0-based: the top is 0
    assert metrics_from_ranks(z["ranks"]) == pop["overall"]
    for stratum in ("recent", "long_term", "new", "repeat"):
        assert metrics_from_ranks(z["ranks"][z[f"is_{stratum}"]]) == pop[stratum]
    by_pos = json.loads((tmp_path / "o" / "by_position.json").read_text())["pop"]
    counts = np.bincount(position_buckets(z["positions"]), minlength=5)
    assert [by_pos[b]["n"] for b in position_bucket_labels()] == counts.tolist()
    assert counts[-1] > 0 and counts[:-1].sum() > 0  # targets on both sides of 501


def test_seeds_spread_and_paired_intervals(tmp_path: Path, probe_models: list[int]) -> None:
    dataset = write_long_history_csv(tmp_path / "events.csv")
    cfg = load_config(None, [f"data.cache_dir={tmp_path / 'cache'}"])
    models = ["pop", "reverse-pop", "pop-twin", "noisy-pop"]
    summary = runner.run_eval(cfg, dataset, models, tmp_path / "o", seeds=[0, 1, 2])
    assert probe_models == [0, 1, 2]  # the seeded model once per seed, the others once
    assert summary["run"]["seeds"] == [0, 1, 2]
    noisy = summary["models"]["noisy-pop"]
    assert noisy["seeds"] == [0, 1, 2] and len(noisy["ranks"]) == 3
    per_seed = [noisy["per_seed"][s]["overall"]["ndcg@10"] for s in ("0", "1", "2")]
    assert len(set(per_seed)) > 1  # the seeds were applied
    assert noisy["overall"]["ndcg@10"] == pytest.approx(np.mean(per_seed))
    assert noisy["spread"]["overall"]["min"] == min(per_seed)
    assert noisy["spread"]["overall"]["max"] == max(per_seed)
    assert noisy["spread"]["overall"]["std"] == pytest.approx(np.std(per_seed, ddof=1))
    for s in ("0", "1", "2"):
        z = load_ranks(tmp_path / "o" / noisy["per_seed"][s]["ranks"])
        assert z["seed"] == int(s) and z["label"] == "noisy-pop"
        assert metrics_from_ranks(z["ranks"]) == noisy["per_seed"][s]["overall"]
    assert (
        summary["models"]["pop"]["seeds"] == [None] and "per_seed" not in summary["models"]["pop"]
    )

    iv = summary["intervals"]
    assert iv["baseline"] == "pop" and iv["resamples"] >= 1000  # the best non-memory model
    assert set(iv["models"]) == {"reverse-pop", "pop-twin", "noisy-pop"}
    for group in ("overall", "long_term", "501+"):
        twin = iv["models"]["pop-twin"][group]
        assert (twin["diff"], twin["lo"], twin["hi"]) == (0.0, 0.0, 0.0)
    pop = summary["models"]["pop"]
    rev = iv["models"]["reverse-pop"]["overall"]
    assert rev["hi"] < 0.0 and rev["n"] == pop["overall"]["n"]
    # the per-target NDCG@10 averaged over seeds has the seeds' mean NDCG@10 as its mean
    diff = iv["models"]["noisy-pop"]["overall"]
    assert diff["diff"] == pytest.approx(noisy["overall"]["ndcg@10"] - pop["overall"]["ndcg@10"])
    assert diff["lo"] <= diff["diff"] <= diff["hi"]
    assert iv["models"]["noisy-pop"]["long_term"]["n"] == pop["long_term"]["n"]
    by_pos = json.loads((tmp_path / "o" / "by_position.json").read_text())
    assert iv["models"]["noisy-pop"]["501+"]["n"] == by_pos["pop"]["501+"]["n"] > 0
    assert by_pos["noisy-pop"]["501+"]["ndcg@10"] == pytest.approx(
        np.mean([noisy["per_seed"][s]["by_position"]["501+"]["ndcg@10"] for s in ("0", "1", "2")])
    )
    report = (tmp_path / "o" / "report.md").read_text()
    assert "## Seeds" in report and "| noisy-pop | 0, 1, 2 |" in report
    assert "Baseline: **pop**" in report and "| pop-twin | +0.0000 [+0.0000, +0.0000] |" in report
    with pytest.raises(ValueError, match="train.seed"):
        runner.run_eval(cfg, dataset, ["noisy-pop[train.seed=4]"], tmp_path / "x", seeds=[0, 1])
    # intervals against a chosen model (eval.interval_reference): here a memory model
    cfg.eval.interval_reference = "pop-twin"
    again = runner.report_from_runs(cfg, [tmp_path / "o"], tmp_path / "ref")
    iv = again["intervals"]
    assert iv["baseline"] == "pop-twin" and iv["chosen"] and "pop-twin" not in iv["models"]
    assert iv["models"]["pop"]["overall"]["diff"] == 0.0
    assert "Baseline: **pop-twin**, the reference model" in (tmp_path / "ref/report.md").read_text()
    cfg.eval.interval_reference = "nothing-like-it"
    assert (
        "not evaluated"
        in runner.report_from_runs(cfg, [tmp_path / "o"], tmp_path / "r2")["intervals"]["note"]
    )


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
