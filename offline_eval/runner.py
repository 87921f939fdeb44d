"""``recmem eval``: build (or load) the split, fit each requested model on TRAIN (once per
seed with ``seeds``), evaluate it on the TEST targets, and write ``summary.json`` (issue 3
schema plus seeds and intervals), ``ranks/*.npz`` (per-target ranks, offline_eval.ranks),
``by_position.json``, ``planted.json`` (synthetic data: metrics on targets whose answer is
known) and ``report.md`` with PNG plots.

Models come from offline_eval.models_registry. A model that is requested but cannot run is
reported as not available with a reason, never dropped.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offline_eval.evaluate import evaluate
from offline_eval.jobs import run_parallel, training_groups
from offline_eval.metrics import METRIC_KEYS
from offline_eval.models_registry import (
    DEFAULT_MODELS,
    available_models,
    is_seeded,
    model_factory,
)
from offline_eval.ranks import RANKS_DIR, ranks_filename, save_ranks
from offline_eval.results import (
    Unit,
    aggregate_seeds,
    available,
    combine_runs,
    paired_intervals,
    position_table,
)
from offline_eval.split import TimeSplit, load_or_build_split
from offline_eval.strata import STRATA

if TYPE_CHECKING:
    from recmem.config import Config

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODELS", "parse_models", "prepare_split", "report_from_runs", "run_eval"]


def split_model_spec(spec: str) -> tuple[str, list[str]]:
    """``name`` or ``name[section.field=value;...]`` -> (name, overrides): the overrides
    apply to that model's copy of the configuration (e.g. an ablation over
    ``memory-proteus[memory.n_blocks=4]`` and ``memory-proteus[memory.n_blocks=16]``)."""
    spec = spec.strip()
    if "[" not in spec:
        return spec, []
    if not spec.endswith("]"):
        raise ValueError(f"model spec {spec!r}: expected name[section.field=value;...]")
    name, _, rest = spec[:-1].partition("[")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    for o in overrides:
        if "=" not in o or "." not in o.partition("=")[0]:
            raise ValueError(f"model spec {spec!r}: override {o!r} is not section.field=value")
    return name.strip(), overrides


def parse_models(spec: str, *, check_known: bool = True) -> list[str]:
    """Split a comma-separated model list (commas inside [...] belong to the overrides)."""
    names, depth, cur = [], 0, ""
    for ch in spec:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(cur.strip())
            cur = ""
        else:
            cur += ch
    names = [n for n in [*names, cur.strip()] if n]
    if not check_known:
        return names
    known = available_models()
    unknown = [m for m in names if split_model_spec(m)[0] not in known]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(known)}")
    if not names:
        raise ValueError("no models given")
    return names


def model_config(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with a model spec's overrides applied (and validated)."""
    from recmem.config import ConfigError, set_value, validate

    out = copy.deepcopy(cfg)
    for o in overrides:
        key, _, value = o.partition("=")
        try:
            set_value(out, key.strip(), value.strip(), origin="model spec")
        except ConfigError as e:
            raise ValueError(str(e)) from e
    try:
        validate(out)
    except ConfigError as e:
        raise ValueError(str(e)) from e
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _empty_entry(reason: str) -> dict[str, Any]:
    empty = {**{k: None for k in METRIC_KEYS}, "n": 0}
    entry: dict[str, Any] = {"overall": dict(empty)}
    entry.update({s: dict(empty) for s in STRATA})
    entry.update(
        train_seconds=None, eval_seconds=None, config={"available": False, "reason": reason}
    )
    return entry


def split_summary(split: TimeSplit, test: dict[str, Any]) -> dict[str, Any]:
    return {
        "n_events": split.n_events,
        "n_train": split.n_train,
        "n_valid_targets": split.targets("valid").n,
        "n_test_targets": test["n_targets"],
        "excluded_cold_item": test["excluded_cold_item"],
        "excluded_first_event": test["excluded_first_event"],
        "boundary_valid_ts": split.boundary_valid_ts,
        "boundary_test_ts": split.boundary_test_ts,
    }


def prepare_split(cfg: Config, dataset: str, path: Path) -> TimeSplit:
    """Build (or take from the cache) the split of ``dataset`` and save a copy at ``path``
    (e.g. inside the repository, to evaluate on a machine without polars via ``--split``)."""
    split = load_or_build_split(cfg, dataset)
    split.save(path)
    return split


def seeded_config(cfg: Config, seed: int | None) -> Config:
    """A copy of ``cfg`` with ``train.seed = seed`` (``cfg`` itself for None)."""
    if seed is None:
        return cfg
    out = copy.deepcopy(cfg)
    out.train.seed = seed
    return out


def plan_units(
    cfg: Config, specs: dict[str, tuple[str, list[str]]], seeds: list[int] | None
) -> dict[int | None, list[str]]:
    """seed -> the specs to run with it, in request order. A seeded model runs once per seed
    of ``seeds`` (without ``seeds``: once, with its configured ``train.seed``); a model that
    takes no seed (``pop``) runs once, under the key None."""
    known = available_models()
    plan: dict[int | None, list[str]] = {}
    for spec, (name, overrides) in specs.items():
        if known[name]:
            continue
        if not is_seeded(name):
            plan.setdefault(None, []).append(spec)
            continue
        if seeds is not None and any(
            o.partition("=")[0].strip() == "train.seed" for o in overrides
        ):
            raise ValueError(f"{spec}: sets train.seed, which --seeds sets for every model")
        for seed in seeds if seeds is not None else [model_config(cfg, overrides).train.seed]:
            plan.setdefault(seed, []).append(spec)
    return plan


def _evaluate_unit(spec: str, seed: int | None, cfg: Config, split: TimeSplit, out: Path) -> Unit:
    """Fit one model spec on TRAIN (``cfg`` carries the seed) and evaluate it on TEST in this
    process; its ranks go to ``out/ranks``."""
    name, overrides = split_model_spec(spec)
    log.info("model %s%s: fitting on TRAIN", spec, "" if seed is None else f" (seed {seed})")
    t0 = time.perf_counter()
    scorer, train_seconds, model_cfg = model_factory(name)(split, model_config(cfg, overrides))
    if train_seconds is None:
        train_seconds = time.perf_counter() - t0
    res = evaluate(scorer, split, "test", cfg.eval, return_per_target=True)
    unit: Unit = {"overall": res["overall"]}
    unit.update({s: res[s] for s in STRATA})
    unit.update(
        train_seconds=float(train_seconds),
        eval_seconds=float(res["eval_seconds"]),
        config=model_cfg,
    )
    if overrides:
        unit["config"] = {**unit["config"], "overrides": overrides}
    per_target = res["per_target"]
    rel = f"{RANKS_DIR}/{ranks_filename(spec, seed)}"
    save_ranks(
        out / rel,
        label=spec,
        seed=seed,
        dataset=split.dataset,
        per_target=per_target,
        global_idx=split.seqs.global_idx[per_target["rows"]],
        config=unit["config"],
    )
    unit.update(seed=seed, ranks=rel, by_position=position_table(per_target))
    if "planted" in res:
        unit["planted"] = res["planted"]
    log.info(
        "model %s: TEST ndcg@10 %.4f hr@10 %.4f (n=%d)",
        spec,
        res["overall"]["ndcg@10"] or 0.0,
        res["overall"]["hr@10"] or 0.0,
        res["overall"]["n"],
    )
    return unit


def run_eval(
    cfg: Config,
    dataset: str,
    models: list[str],
    out: Path,
    *,
    split_path: Path | None = None,
    write_report: bool = True,
    jobs: int | None = None,
    seeds: list[int] | None = None,
) -> dict[str, Any]:
    """Evaluate ``models`` on the TEST targets of ``dataset``; write the outputs to ``out``.
    ``seeds``: train every seeded model once per seed (``train.seed``), the summary gives the
    mean and spread. ``jobs`` (default ``cfg.eval.jobs``) > 1 trains and evaluates in that many
    worker processes at once (offline_eval.jobs), seeds too. ``write_report=False`` (a
    worker's part) skips report.md and the intervals."""
    known = available_models()
    specs = {spec: split_model_spec(spec) for spec in models}
    for name, overrides in specs.values():
        if name not in known:
            raise ValueError(f"unknown model {name!r}; known: {sorted(known)}")
        model_config(cfg, overrides)  # fail before any work on a bad override
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"seeds must be distinct and at least one; got {seeds}")
    if cfg.eval.checkpoint:  # likewise a checkpoint that is not there
        from recmem.modelstore import MODEL_FILE

        if seeds is not None and len(seeds) > 1:
            raise ValueError("--seeds trains each model once per seed; eval.checkpoint trains none")
        if not (Path(cfg.eval.checkpoint) / MODEL_FILE).is_file():
            raise FileNotFoundError(f"eval.checkpoint: no trained model at {cfg.eval.checkpoint}")
    plan = plan_units(cfg, specs, seeds)
    split = TimeSplit.load(split_path) if split_path else load_or_build_split(cfg, dataset)
    out.mkdir(parents=True, exist_ok=True)
    test_targets = split.targets("test", cfg.eval.exclude_seen)
    split_info: dict[str, Any] = {
        "n_targets": test_targets.n,
        "excluded_cold_item": test_targets.excluded_cold_item,
        "excluded_first_event": test_targets.excluded_first_event,
    }
    groups: list[tuple[int | None, list[str]]] = []
    for seed, batch in plan.items():
        config_of = functools.partial(model_config, seeded_config(cfg, seed))
        groups += [(seed, g) for g in training_groups({s: specs[s] for s in batch}, config_of)]
    jobs = max(1, cfg.eval.jobs if jobs is None else jobs)
    t_run = time.perf_counter()
    units: dict[str, list[Unit]] = {spec: [] for spec in specs}
    if jobs > 1 and len(groups) > 1:
        if split_path is None:  # the workers read the same split from a file
            split_path = out / "jobs" / "split.npz"
            split_path.parent.mkdir(parents=True, exist_ok=True)
            split.save(split_path)
        done = run_parallel(cfg, dataset, groups, out, split_path, jobs)
        for seed, group in groups:
            for spec in group:
                units[spec].append(done[(spec, seed)])
    else:
        for seed, group in groups:
            for spec in group:
                try:
                    unit = _evaluate_unit(spec, seed, seeded_config(cfg, seed), split, out)
                except FloatingPointError as e:  # a diverged training fails its model only
                    log.error("model %s (seed %s): %s", spec, seed, e)
                    unit = {**_empty_entry(str(e)), "seed": seed}
                units[spec].append(unit)
    run: dict[str, Any] = {"jobs": jobs, "wall_seconds": time.perf_counter() - t_run}
    if seeds is not None:
        run["seeds"] = seeds
    summary = {"dataset": split.dataset, "split": split_summary(split, split_info), "run": run}
    unavailable = {
        spec: _empty_entry(known[name]) for spec, (name, _) in specs.items() if known[name]
    }
    for spec, entry in unavailable.items():
        log.info("model %s: not available (%s)", spec, entry["config"]["reason"])
    return _write_outputs(
        out, summary, units, unavailable, cfg, has_repeats=split.has_repeats, report=write_report
    )


def _write_outputs(
    out: Path,
    summary: dict[str, Any],
    units: dict[str, list[Unit]],
    unavailable: dict[str, dict[str, Any]],
    cfg: Config,
    *,
    has_repeats: bool,
    report: bool = True,
) -> dict[str, Any]:
    """summary.json (with each model's entry over its seeds and, with ``report``, the paired
    intervals), by_position.json, planted.json and report.md."""
    entries: dict[str, dict[str, Any]] = {}
    by_position: dict[str, dict[str, Any]] = {}
    planted: dict[str, dict[str, Any]] = {}
    for spec, spec_units in units.items():
        ran = [u for u in spec_units if available(u)]
        failed = [u for u in spec_units if not available(u)]
        if spec in unavailable or not ran:
            entries[spec] = unavailable.get(spec) or failed[0]
            continue
        entry, table, plant = aggregate_seeds(ran)
        if failed:
            entry["failed_seeds"] = {str(u["seed"]): u["config"]["reason"] for u in failed}
        entries[spec] = entry
        if table is not None:
            by_position[spec] = table
        if plant is not None:
            planted[spec] = plant
    summary = {
        "dataset": summary["dataset"],
        "split": summary["split"],
        "models": entries,
        **summary,
    }
    if report:
        summary["intervals"] = paired_intervals(
            out, entries, reference=cfg.eval.interval_reference or None
        )
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    _atomic_write(out / "by_position.json", json.dumps(by_position, indent=2) + "\n")
    if planted:
        _atomic_write(out / "planted.json", json.dumps(planted, indent=2) + "\n")
    if report:
        from offline_eval.report import write_report

        write_report(
            out,
            summary,
            by_position,
            eval_config=cfg.eval,
            has_repeats=has_repeats,
            planted=planted,
        )
    return summary


def report_from_runs(
    cfg: Config, runs: list[Path], out: Path, models: list[str] | None = None
) -> dict[str, Any]:
    """Write summary.json, by_position.json, ranks/ and report.md in ``out`` from earlier runs
    on the same split (offline_eval.results.combine_runs): a model found in several runs with
    different seeds gets their mean and spread; nothing is trained."""
    out.mkdir(parents=True, exist_ok=True)
    summary, units, unavailable = combine_runs(runs, out, models)
    repeats = any(
        u["repeat"]["n"] for spec_units in units.values() for u in spec_units if available(u)
    )
    return _write_outputs(out, summary, units, unavailable, cfg, has_repeats=bool(repeats))
