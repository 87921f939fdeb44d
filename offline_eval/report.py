"""``report.md`` and its PNG plots from a ``summary.json`` and the per-position tables."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offline_eval.metrics import METRIC_KEYS
from offline_eval.results import GROUPS, available, is_memory_model
from offline_eval.strata import STRATA, position_bucket_labels

if TYPE_CHECKING:
    from recmem.config import EvalConfig

log = logging.getLogger(__name__)

STRATUM_TITLES = {"recent": "RECENT", "long_term": "LONG-TERM", "new": "NEW", "repeat": "REPEAT"}


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


def plot_strata(path: Path, models: dict[str, Any], metric: str = "ndcg@10") -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m, e in models.items() if available(e)]
    groups = ["overall", *[s for s in STRATA if any(models[m][s]["n"] for m in names)]]
    if not names:
        return False
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [models[name][g][metric] or 0.0 for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([STRATUM_TITLES.get(g, g) for g in groups])
    ax.set_ylabel(f"TEST {metric}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def plot_by_position(path: Path, by_position: dict[str, dict[str, dict[str, Any]]]) -> bool:
    """Two panels, test loss and NDCG@10 by event-position bucket, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not by_position:
        return False
    labels = position_bucket_labels()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, table in by_position.items():
        xs = [i for i, b in enumerate(labels) if table.get(b, {}).get("n")]
        for ax, key in zip(axes, ("loss", "ndcg@10"), strict=True):
            ys = [table[labels[i]].get(key) for i in xs]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=name)
    for ax, key in zip(axes, ("test loss (-log p target)", "TEST NDCG@10"), strict=True):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_xlabel("target's event position in the user's history")
        ax.set_ylabel(key)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def memory_grid(models: dict[str, Any]) -> list[tuple[str, int, int, dict[str, Any]]]:
    """(name, E, N, entry) of the available memory models, sorted by (N, E, name), when they
    span at least three (E, N) settings (an ablation); else empty."""
    rows = []
    for name, e in models.items():
        mem = e.get("config", {}).get("memory")
        if (
            available(e)
            and isinstance(mem, dict)
            and "n_blocks" in mem
            and "notebank" not in e["config"]
        ):
            rows.append((name, int(mem["n_blocks"]), int(mem["horizon"]), e))
    if len({(E, N) for _, E, N, _ in rows}) < 3:
        return []
    return sorted(rows, key=lambda r: (r[2], r[1], r[0]))


def _other_overrides(entry: dict[str, Any]) -> str:
    """The entry's overrides other than E and N (one ablation line per distinct value)."""
    grid_keys = ("memory.n_blocks", "memory.horizon")
    others = [
        o
        for o in entry.get("config", {}).get("overrides", [])
        if o.partition("=")[0].strip() not in grid_keys
    ]
    return "; ".join(others)


def plot_ablation(path: Path, grid: list[tuple[str, int, int, dict[str, Any]]]) -> bool:
    """TEST NDCG@10 (overall, solid; LONG-TERM, dashed) against E, one colour per N and per
    set of other overrides (e.g. a learning rate), so any mix of models plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not grid:
        return False
    lines: dict[tuple[int, str], list[tuple[int, dict[str, Any]]]] = {}
    for _, E, N, e in grid:
        lines.setdefault((N, _other_overrides(e)), []).append((E, e))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (N, others), pts in sorted(lines.items()):
        pts.sort(key=lambda p: p[0])
        xs = [E for E, _ in pts]
        label = f"N={N}" + (f" {others}" if others else "")
        line = ax.plot(xs, [e["overall"]["ndcg@10"] for _, e in pts], marker="o", label=label)
        ax.plot(
            xs,
            [e["long_term"]["ndcg@10"] for _, e in pts],
            marker="s",
            linestyle="--",
            color=line[0].get_color(),
            label=f"{label} LONG-TERM",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("E (Proteus blocks; E = 1 is the static memory)")
    ax.set_ylabel("TEST NDCG@10")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def _save(fig: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


GROUP_TITLES = {"overall": "overall", "long_term": "LONG-TERM", GROUPS[2]: f"position {GROUPS[2]}"}


def _seed_lines(models: dict[str, Any]) -> list[str]:
    """Mean, std and range over seeds of TEST NDCG@10 (models run with several seeds)."""
    seeded = {m: e for m, e in models.items() if available(e) and e.get("spread")}
    if not seeded:
        return []
    lines = ["", "## Seeds: TEST NDCG@10 mean ± std (min-max)", ""]
    rows = []
    for name, e in seeded.items():
        cells = []
        for g in GROUPS:
            sp = e["spread"][g]
            cells.append(
                "–"
                if sp["mean"] is None
                else f"{sp['mean']:.4f} ± {sp['std']:.4f} ({sp['min']:.4f}-{sp['max']:.4f})"
            )
        rows.append([name, ", ".join(str(x) for x in e["seeds"]), *cells])
    lines += _table(["model", "seeds", *[GROUP_TITLES[g] for g in GROUPS]], rows)
    lines += [
        "",
        "std is the sample standard deviation over seeds; the other tables show the means; "
        "summary.json keeps each seed's numbers (`per_seed`).",
    ]
    return lines


def _interval(r: dict[str, Any]) -> str:
    if r["diff"] is None:
        return "– (n = 0)"
    return f"{r['diff']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]"


def _interval_lines(iv: dict[str, Any], models: dict[str, Any]) -> list[str]:
    """Each model's NDCG@10 minus the best baseline's, with its paired bootstrap interval."""
    pct = round(100 * iv["confidence"])
    whose = "the reference model's" if iv.get("chosen") else "the best baseline's"
    lines = ["", f"## NDCG@10 minus {whose}, paired bootstrap {pct}% interval (TEST)"]
    lines += [""]
    if iv.get("note"):
        return lines + [f"No intervals: {iv['note']}."]
    base = iv["baseline"]
    baselines = [m for m, e in models.items() if available(e) and not is_memory_model(e)]
    seeds = models[base].get("seeds", [])
    why = (
        "the reference model chosen for this report (eval.interval_reference)"
        if iv.get("chosen")
        else "the best TEST NDCG@10 among the models that are not memory models "
        f"({', '.join(baselines)})"
    )
    lines += [
        f"Baseline: **{base}**, {why}. For each model, each target's NDCG@10 minus the baseline's on "
        f"the same target (a model with several seeds enters with each target's NDCG@10 averaged "
        f"over its seeds{'; so does the baseline' if len(seeds) > 1 else ''}); the targets are "
        f"resampled with replacement {iv['resamples']} times (seed {iv['seed']}), the same "
        f"resampled targets for both models, and the interval runs from the "
        f"{(100 - pct) / 2:g}th to the {100 - (100 - pct) / 2:g}th percentile of the resampled "
        f"mean differences. Above 0: better than the baseline on these targets. Targets are "
        f"resampled one by one, not by user, so the interval leaves out the correlation "
        f"between one user's targets.",
        "",
    ]
    first = next(iter(iv["models"].values()), None)
    header = ["model"] + [
        f"{GROUP_TITLES[g]} (n = {first[g]['n']})" if first else GROUP_TITLES[g] for g in GROUPS
    ]
    rows = [[name, *[_interval(r[g]) for g in GROUPS]] for name, r in iv["models"].items()]
    lines += _table(header, rows)
    if iv.get("no_ranks"):
        lines += ["", "Without saved ranks (no interval): " + ", ".join(iv["no_ranks"]) + "."]
    return lines


def render_report(
    summary: dict[str, Any],
    by_position: dict[str, dict[str, dict[str, Any]]],
    *,
    eval_config: EvalConfig | None = None,
    has_repeats: bool = False,
    plots: tuple[tuple[str, str], ...] = (),
    planted: dict[str, dict[str, Any]] | None = None,
) -> str:
    sp = summary["split"]
    models = summary["models"]
    lines = [f"# Offline evaluation: {summary['dataset']}", ""]
    lines += [
        "Strict global time split (SPEC section 7): events sorted by (timestamp, user, item),",
        "TRAIN before index floor(0.8 n), VALID up to floor(0.9 n), TEST after; every TEST",
        "target is ranked among all TRAIN items (full ranking) from all of the user's earlier",
        "events.",
        "",
    ]
    lines += _table(["split", "value"], [[k, v] for k, v in sp.items()])
    if eval_config is not None:
        lines += [
            "",
            f"Strata: RECENT = the target's whole category set is among the user's last "
            f"{eval_config.recent_window} events; LONG-TERM = seen only earlier; NEW = never "
            f"seen. REPEAT (datasets with repeats{'' if has_repeats else '; none here'}) = "
            f"the item itself last seen more than {eval_config.repeat_gap} events earlier. "
            f"exclude_seen = {eval_config.exclude_seen}.",
        ]
    lines += ["", "## Overall (TEST)", ""]
    rows = []
    for name, e in models.items():
        o = e["overall"]
        status = "" if available(e) else f"not available: {e['config'].get('reason', '')}"
        if len(e.get("seeds", [])) > 1:
            status = "mean of seeds " + ", ".join(str(x) for x in e["seeds"])
        if e.get("failed_seeds"):
            status += "; failed: seed " + ", ".join(e["failed_seeds"])
        rows.append(
            [name, *[o[k] for k in METRIC_KEYS], o["n"], e["train_seconds"], e["eval_seconds"]]
            + [status]
        )
    lines += _table(["model", *METRIC_KEYS, "n", "train s", "eval s", "note"], rows)
    lines += _seed_lines(models)
    if summary.get("intervals"):
        lines += _interval_lines(summary["intervals"], models)
    for metric in ("ndcg@10", "hr@10"):
        lines += ["", f"## {metric} by stratum (TEST)", ""]
        header = ["model"] + [f"{STRATUM_TITLES[s]} (n)" for s in STRATA]
        rows = []
        for name, e in models.items():
            if available(e):
                rows.append([name] + [f"{_fmt(e[s][metric])} ({e[s]['n']})" for s in STRATA])
        lines += _table(header, rows)
    ablation = [
        (name, e) for name, e in models.items() if available(e) and e["config"].get("overrides")
    ]
    if ablation:
        lines += ["", "## Ablation (models run with configuration overrides; TEST NDCG@10)", ""]
        rows = [
            [
                name.partition("[")[0],
                "; ".join(e["config"]["overrides"]),
                *[e[g]["ndcg@10"] for g in ("overall", *STRATA)],
            ]
            for name, e in ablation
        ]
        header = ["model", "overrides", "overall", *[STRATUM_TITLES[s] for s in STRATA]]
        lines += _table(header, rows)
    grid = memory_grid(models)
    if grid:
        lines += ["", "## Proteus ablation: E blocks x N horizon (TEST NDCG@10)", ""]
        header = ["model", "E", "N", "overall", *[STRATUM_TITLES[s] for s in STRATA]]
        header += ["best epoch", "train s"]
        rows = [
            [name, E, N, *[e[g]["ndcg@10"] for g in ("overall", *STRATA)]]
            + [e["config"].get("best_epoch"), e["train_seconds"]]
            for name, E, N, e in grid
        ]
        lines += _table(header, rows)
    if by_position:
        labels = position_bucket_labels()
        lines += ["", "## By the target's event position (TEST)", ""]
        rows = []
        for name, table in by_position.items():
            for key in ("ndcg@10", "loss"):
                rows.append([name, key, *[table.get(b, {}).get(key) for b in labels]])
        lines += _table(["model", "metric", *labels], rows)
        counts = next(iter(by_position.values()))
        lines += ["", "Targets per bucket: " + ", ".join(f"{b}: {counts[b]['n']}" for b in labels)]
    if planted:
        groups = list(next(iter(planted.values())))
        lines += ["", "## Planted structure (generated data): NDCG@10 / HR@10 (n)", ""]
        rows = []
        for name, table in planted.items():
            rows.append(
                [name]
                + [
                    f"{_fmt(table[g]['ndcg@10'])} / {_fmt(table[g]['hr@10'])} ({table[g]['n']})"
                    for g in groups
                ]
            )
        lines += _table(["model", *groups], rows)
    for title, fname in plots:
        lines += ["", f"![{title}]({fname})"]
    configs = {n: e["config"] for n, e in models.items()}
    lines += ["", "## Model configurations", "", "```json"]
    lines += [json.dumps(configs, indent=2), "```", ""]
    return "\n".join(lines)


def write_report(
    out: Path,
    summary: dict[str, Any],
    by_position: dict[str, dict[str, dict[str, Any]]],
    *,
    eval_config: EvalConfig | None = None,
    has_repeats: bool = False,
    planted: dict[str, dict[str, Any]] | None = None,
) -> Path:
    plots: list[tuple[str, str]] = []
    if plot_strata(out / "strata_ndcg10.png", summary["models"]):
        plots.append(("NDCG@10 by stratum", "strata_ndcg10.png"))
    if plot_by_position(out / "by_position.png", by_position):
        plots.append(("Loss and NDCG@10 by event position", "by_position.png"))
    if plot_ablation(out / "ablation_ndcg10.png", memory_grid(summary["models"])):
        plots.append(("NDCG@10 against E and N", "ablation_ndcg10.png"))
    text = render_report(
        summary,
        by_position,
        eval_config=eval_config,
        has_repeats=has_repeats,
        plots=tuple(plots),
        planted=planted,
    )
    path = out / "report.md"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    log.info("report written to %s", path)
    return path
