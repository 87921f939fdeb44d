"""From per-(model, seed) results to a run's summary: means and spread over seeds, the paired
intervals against the best baseline, and the merge of earlier runs (``--from-runs``).

A *unit* is one model spec evaluated with one seed: its summary metrics (``overall`` and the
strata), ``train_seconds``, ``eval_seconds``, ``config``, ``seed`` (None for a model that
takes none), ``ranks`` (its ranks file, relative to the run directory; offline_eval.ranks),
``by_position`` and, on generated data, ``planted``. A model's summary entry is its only unit,
or, over several seeds, the mean of its units with ``per_seed`` and ``spread`` beside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from offline_eval.metrics import metrics_from_ranks
from offline_eval.ranks import RANKS_DIR, load_ranks, ranks_filename
from offline_eval.stats import (
    BOOTSTRAP_CONFIDENCE,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    ndcg10_per_target,
    paired_bootstrap,
    spread,
)
from offline_eval.strata import POSITION_BUCKETS, STRATA, position_bucket_labels, position_buckets

Unit = dict[str, Any]

LONG_POSITION = POSITION_BUCKETS[-1][0]
"""Targets at this 1-based position or later form the "501+" group."""
GROUPS = ("overall", "long_term", position_bucket_labels()[-1])
"""Target groups of the seed spread and the intervals (TEST NDCG@10)."""

_UNIT_ONLY = ("seed", "ranks", "by_position", "planted")


def is_memory_model(entry: dict[str, Any]) -> bool:
    """A memory model (``config.kind == "memory"``); every other model is a baseline."""
    return entry.get("config", {}).get("kind") == "memory"


def available(entry: dict[str, Any]) -> bool:
    return entry.get("config", {}).get("available", True) is not False


def _group_ndcg(unit: Unit, group: str) -> float | None:
    if group in ("overall", *STRATA):
        return unit[group]["ndcg@10"]
    return ((unit.get("by_position") or {}).get(group) or {}).get("ndcg@10")


def _mean(values: list[Any]) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))


def _mean_tables(tables: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Key-wise mean of tables of {group: {"n": ..., metric: value}} (n from the first)."""
    out: dict[str, dict[str, Any]] = {}
    for group, first in tables[0].items():
        row = {k: _mean([t[group][k] for t in tables]) for k in first if k != "n"}
        out[group] = {"n": first["n"], **row} if "n" in first else row
    return out


def aggregate_seeds(
    units: list[Unit],
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(summary entry, by-position table, planted table) of one model from its units (at
    least one): with one unit, that unit; with several, the means over them, plus
    ``per_seed`` (each unit, keyed by its seed) and ``spread`` (GROUPS' NDCG@10 over seeds)."""
    seeds = [u["seed"] for u in units]
    ranks = [u["ranks"] for u in units if u.get("ranks")]
    tables = [u["by_position"] for u in units if u.get("by_position")]
    planted_tables = [u["planted"] for u in units if u.get("planted")]
    if len(units) == 1:
        entry = {k: v for k, v in units[0].items() if k not in _UNIT_ONLY}
        entry.update(seeds=seeds, ranks=ranks)
        return entry, tables[0] if tables else None, planted_tables[0] if planted_tables else None
    entry = {g: _mean_tables([{g: u[g]} for u in units])[g] for g in ("overall", *STRATA)}
    entry.update(
        train_seconds=_mean([u["train_seconds"] for u in units]),
        eval_seconds=_mean([u["eval_seconds"] for u in units]),
        config=units[0]["config"],
        seeds=seeds,
        ranks=ranks if len(ranks) == len(units) else [],
        per_seed={str(u["seed"]): {k: v for k, v in u.items() if k != "seed"} for u in units},
        spread={g: spread([_group_ndcg(u, g) for u in units]) for g in GROUPS},
    )
    by_position = _mean_tables(tables) if len(tables) == len(units) else None
    planted = _mean_tables(planted_tables) if len(planted_tables) == len(units) else None
    return entry, by_position, planted


def units_of(
    entry: dict[str, Any], by_position: dict[str, Any] | None, planted: dict[str, Any] | None
) -> list[Unit]:
    """The units behind a summary entry (the inverse of :func:`aggregate_seeds`); an entry
    written before seeds and ranks files were recorded is one unit with its configured
    ``train.seed`` and no ranks."""
    if "per_seed" in entry:
        return [{**u, "seed": _seed(s)} for s, u in entry["per_seed"].items()]
    unit = {k: v for k, v in entry.items() if k not in ("seeds", "ranks")}
    if "seeds" in entry:
        unit["seed"] = entry["seeds"][0]
        unit["ranks"] = entry["ranks"][0] if entry["ranks"] else None
    else:
        unit["seed"] = entry.get("config", {}).get("train", {}).get("seed")
        unit["ranks"] = None
    unit["by_position"] = by_position
    if planted is not None:
        unit["planted"] = planted
    return [unit]


def _seed(key: str) -> int | None:
    return None if key == "None" else int(key)


def paired_intervals(
    root: Path,
    entries: dict[str, dict[str, Any]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = BOOTSTRAP_CONFIDENCE,
    seed: int = BOOTSTRAP_SEED,
    reference: str | None = None,
) -> dict[str, Any]:
    """Each model's TEST NDCG@10 minus the best baseline's, per target on the same targets,
    with a paired bootstrap interval (offline_eval.stats) in each of GROUPS. The baseline is
    the available non-memory model with the highest mean NDCG@10 overall, or the model
    ``reference`` when given (``eval.interval_reference``; ``"chosen": True``); a model with
    several seeds enters with each target's NDCG@10 averaged over its seeds (so does the
    baseline). Models without ranks files are left out and listed under ``no_ranks``."""
    out: dict[str, Any] = {
        "metric": "ndcg@10",
        "method": "paired percentile bootstrap over TEST targets",
        "resamples": resamples,
        "confidence": confidence,
        "seed": seed,
        "baseline": None,
        "models": {},
        "no_ranks": [],
    }
    ready = {m: e for m, e in entries.items() if available(e)}
    for m, e in ready.items():
        if not e.get("ranks") or len(e["ranks"]) != len(e.get("seeds", [])):
            out["no_ranks"].append(m)
    if reference:
        if reference not in ready:
            out["note"] = f"the reference model {reference!r} was not evaluated"
            return out
        best = reference
        out["chosen"] = True
    else:
        baselines = [m for m, e in ready.items() if not is_memory_model(e)]
        if not baselines:
            out["note"] = "no baseline (a model that is not a memory model) was evaluated"
            return out
        best = max(baselines, key=lambda m: ready[m]["overall"]["ndcg@10"] or 0.0)
    out["baseline"] = best
    if best in out["no_ranks"]:
        out["note"] = f"the best baseline, {best}, has no ranks files"
        return out
    base_rows, base, masks = _per_target_ndcg(root, best, ready[best]["ranks"])
    for model in ready:
        if model == best or model in out["no_ranks"]:
            continue
        rows, ndcg, _ = _per_target_ndcg(root, model, ready[model]["ranks"])
        if not np.array_equal(rows, base_rows):
            raise ValueError(f"{model} and {best} were ranked on different targets")
        out["models"][model] = {
            g: paired_bootstrap(
                ndcg[masks[g]],
                base[masks[g]],
                resamples=resamples,
                confidence=confidence,
                seed=seed,
            )
            for g in GROUPS
        }
    return out


def _per_target_ndcg(
    root: Path, model: str, paths: list[str]
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(target rows, each target's NDCG@10 averaged over the files, masks of GROUPS)."""
    files = [load_ranks(root / p) for p in paths]
    rows = files[0]["rows"]
    if any(not np.array_equal(f["rows"], rows) for f in files[1:]):
        raise ValueError(f"{model}: its ranks files cover different targets")
    ndcg = np.mean([ndcg10_per_target(f["ranks"]) for f in files], axis=0)
    masks = {
        "overall": np.ones(rows.shape[0], dtype=bool),
        "long_term": files[0]["is_long_term"],
        GROUPS[2]: files[0]["positions"] >= LONG_POSITION,
    }
    return rows, ndcg, masks


def position_table(per_target: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """NDCG@10 (and mean loss, when given) per event-position bucket of the targets."""
    bucket = position_buckets(per_target["positions"])
    table: dict[str, dict[str, Any]] = {}
    for b, label in enumerate(position_bucket_labels()):
        sel = bucket == b
        m = metrics_from_ranks(per_target["ranks"][sel])
        row: dict[str, Any] = {"n": m["n"], "ndcg@10": m["ndcg@10"], "hr@10": m["hr@10"]}
        if "loss" in per_target:
            row["loss"] = float(per_target["loss"][sel].mean()) if sel.any() else None
        table[label] = row
    return table


RUN_ONLY_SETTINGS = {"train": ("seed", "max_seconds", "device")}
"""Settings that may differ between the seeds of one model: the seed itself and what only
limits or places a run (its time guard, its device)."""


SETTINGS_SECTIONS = ("model", "memory", "train", "sasrec", "notebank")
"""The sections of a unit's recorded configuration that hold settings (the others hold the
run's results: best step, validation history, replay timings)."""


def _settings(unit: Unit) -> dict[str, Any]:
    """The recorded settings of a unit's training as {"section.field": value}: the scalar
    fields of SETTINGS_SECTIONS, without RUN_ONLY_SETTINGS."""
    config = unit.get("config") or {}
    out: dict[str, Any] = {}
    for section in SETTINGS_SECTIONS:
        fields = config.get(section)
        if not isinstance(fields, dict):
            continue
        skip = RUN_ONLY_SETTINGS.get(section, ())
        for field, value in fields.items():
            if field not in skip and not isinstance(value, (dict, list)):
                out[f"{section}.{field}"] = value
    return out


def _check_same_settings(name: str, by_seed: dict[Any, Unit], origin: dict[Any, Path]) -> None:
    """Refuse to combine one model's seeds from runs that trained it differently (a default
    that changed between the runs, under the same model name): the report would average
    two models under one name. A setting recorded by one run only (an option added after
    the other ran) counts as a difference: what the other run did is not known. Units
    rebuilt from ranks files that recorded no configuration are not compared."""
    first: tuple[Any, dict[str, Any]] | None = None
    for seed, unit in by_seed.items():
        settings = _settings(unit)
        if not settings:
            continue
        if first is None:
            first = (seed, settings)
            continue
        seed0, ref = first
        missing = "(not recorded)"
        differ = sorted(
            k
            for k in ref.keys() | settings.keys()
            if ref.get(k, missing) != settings.get(k, missing)
        )
        if differ:
            shown = ", ".join(
                f"{k}: {ref.get(k, missing)!r} vs {settings.get(k, missing)!r}" for k in differ[:4]
            )
            raise ValueError(
                f"{name}: seed {seed0} (from {origin.get((name, seed0))}) and seed {seed} "
                f"(from {origin.get((name, seed))}) were trained with different settings "
                f"({shown}{', ...' if len(differ) > 4 else ''}); combine runs of one "
                "configuration, or pick the seeds to keep by combining fewer runs"
            )


def combine_runs(
    run_dirs: list[Path], out: Path, models: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, list[Unit]], dict[str, dict[str, Any]]]:
    """Earlier runs on the same dataset and split, as (summary without models, units per
    model, entries of models that were not available). Units of one model from several runs
    are its seeds (e.g. one run per seed); a later run's unit replaces an earlier one with the
    same seed. Their ranks files are copied into ``out/ranks``. ``models`` picks and orders
    the models (default: all, in the order first seen).

    A run stopped before it wrote ``summary.json`` (a time limit, a lost machine) still
    gives the models it finished: each ranks file under its ``ranks/`` (or a worker's
    ``jobs/*/ranks/``) becomes a unit rebuilt from the file (:func:`unit_from_ranks`). At
    least one run must be complete: its summary names the split the others must match."""
    if not run_dirs:
        raise ValueError("no runs to combine")
    complete = [Path(d) for d in run_dirs if (Path(d) / "summary.json").is_file()]
    if not complete:
        raise ValueError(
            f"{run_dirs[0]}/summary.json not found: not an evaluation run directory (runs "
            "without summary.json are recovered from their ranks files only beside a complete run)"
        )
    base: dict[str, Any] = json.loads((complete[0] / "summary.json").read_text())
    units: dict[str, dict[Any, Unit]] = {}
    origin: dict[tuple[str, Any], Path] = {}  # (model, seed) -> the run its unit came from
    unavailable: dict[str, dict[str, Any]] = {}
    for d in map(Path, run_dirs):
        path = d / "summary.json"
        if not path.is_file():
            files = sorted(d.glob(f"{RANKS_DIR}/*.npz")) + sorted(
                d.glob(f"jobs/*/{RANKS_DIR}/*.npz")
            )
            if not files:
                raise ValueError(
                    f"{d}: neither summary.json nor ranks files: not an evaluation run"
                )
            for f in files:
                unit = unit_from_ranks(f, base["dataset"], base["split"].get("n_test_targets"))
                unit["ranks"] = _copy_ranks(
                    f.parent.parent, f"{RANKS_DIR}/{f.name}", out, unit["label"], unit["seed"]
                )
                label = unit.pop("label")
                units.setdefault(label, {})[unit["seed"]] = unit
                origin[label, unit["seed"]] = d
            continue
        s = json.loads(path.read_text())
        if (s["dataset"], s["split"]) != (base["dataset"], base["split"]):
            raise ValueError(
                f"{path}: dataset or split differs from {complete[0]}: "
                f"{s['dataset']} {s['split']} vs {base['dataset']} {base['split']}"
            )
        by_position = _load(d / "by_position.json")
        planted = _load(d / "planted.json")
        for name, entry in s["models"].items():
            if not available(entry):
                unavailable[name] = entry
                units.setdefault(name, {})
                continue
            for unit in units_of(entry, by_position.get(name), planted.get(name)):
                if unit["ranks"]:
                    unit["ranks"] = _copy_ranks(d, unit["ranks"], out, name, unit["seed"])
                units.setdefault(name, {})[unit["seed"]] = unit
                origin[name, unit["seed"]] = d
    if models is not None:
        missing = [m for m in models if m not in units]
        if missing:
            raise ValueError(f"model(s) {missing} are in none of the runs; found {sorted(units)}")
        units = {m: units[m] for m in models}
    for name, by_seed in units.items():
        _check_same_settings(name, by_seed, origin)
    summary = {k: v for k, v in base.items() if k not in ("models", "intervals")}
    summary["combined_from"] = [str(d) for d in run_dirs]
    picked_unavailable = {m: e for m, e in unavailable.items() if m in units and not units[m]}
    return summary, {m: list(u.values()) for m, u in units.items()}, picked_unavailable


def unit_from_ranks(path: Path, dataset: str, n_targets: int | None = None) -> Unit:
    """The unit (plus its ``label``) of one ranks file, for a run that never wrote its
    summary: the TEST metrics overall, per stratum and per position bucket are recomputed
    from the per-target ranks; the configuration is the one the file recorded (files written
    before configurations were recorded: only what the label says, its kind guessed from the
    name), and the training and evaluation times are unknown (None). Raises ValueError for a file
    of another dataset, or (``n_targets``: the complete runs' TEST target count) of another
    split of it."""
    r = load_ranks(path)
    if r["dataset"] != dataset:
        raise ValueError(f"{path}: ranks of dataset {r['dataset']!r}, the runs are {dataset!r}")
    if n_targets is not None and len(r["ranks"]) != n_targets:
        raise ValueError(
            f"{path}: ranks of {len(r['ranks'])} TEST targets, the runs' split has {n_targets}: "
            "another split of the dataset"
        )
    label = r["label"]
    name, _, rest = label.partition("[")
    unit: Unit = {"overall": metrics_from_ranks(r["ranks"])}
    unit.update({s: metrics_from_ranks(r["ranks"][r[f"is_{s}"]]) for s in STRATA})
    recorded = r["config"] or {
        # files written before the configuration was recorded: the label is all there is
        "kind": "memory" if name.startswith("memory") else name
    }
    config: dict[str, Any] = {
        **recorded,
        "recovered": f"from {path.name}: the run stopped before its summary",
    }
    overrides = [o.strip() for o in rest.rstrip("]").split(";") if o.strip()]
    if overrides and "overrides" not in config:  # a recorded configuration has them
        config["overrides"] = overrides
    per_target = {"positions": r["positions"], "ranks": r["ranks"]}
    if not np.isnan(r["loss"]).all():
        per_target["loss"] = r["loss"]
    unit.update(
        label=label,
        seed=r["seed"],
        train_seconds=None,
        eval_seconds=None,
        config=config,
        by_position=position_table(per_target),
    )
    return unit


def _copy_ranks(run: Path, rel: str, out: Path, label: str, seed: int | None) -> str:
    dest = Path(RANKS_DIR) / ranks_filename(label, seed)
    src, dst = run / rel, out / dest
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not (dst.exists() and src.resolve() == dst.resolve()):
        shutil.copyfile(src, dst)
    return dest.as_posix()


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
