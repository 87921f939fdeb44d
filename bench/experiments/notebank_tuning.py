"""End-to-end NoteBank replay evaluation of one trained model over many archive settings.

    OMP_NUM_THREADS=1 .venv/bin/python bench/experiments/notebank_tuning.py --model-dir DIR \\
        [--part valid] [--grid JSON] [--settings JSON] [--out FILE]

Loads the model once (``recmem train`` output), builds its split, scores the plain model
(no replay) and then ``offline_eval.notebank_eval.NotebankScorer`` (the service's rank
path) once per setting on the chosen part's targets (VALID to choose, TEST to report the
chosen one). A setting is a JSON object of archive fields (``chunk_events``, ``window``,
``spans_per_chunk``, ``max_span``, ``address_dim``, ``notes_per_user``, ``replay_notes``,
``min_votes``, ...) on top of the model's config, plus optionally ``query_events``
(server.replay_query_events), ``blend`` (weight of the replayed read-out against the stored
one, 1 = the rank path) and ``final_pass`` ("service" = the rank path; "read_only" =
the notes then a read-only read of the latest event; diagnostics "query_only",
"notes_only", "read_only_query", "read_only_state_gap", "read_only_own_pos"; see
offline_eval.notebank_eval.FINAL_PASSES). ``--grid`` is expanded to every combination; ``--settings``
is a list. For each setting: NDCG@10 / HR@10 overall and per stratum, the paired
difference of per-target NDCG@10 to the plain model with its standard error, and the
share of queries that got notes. Results are appended to ``--out`` after every setting
(a JSON file; an existing file is extended, settings already in it are skipped).
``--reference SETTING`` scores one more setting first and gives every new result its paired
difference to it as well (``vs_reference``; e.g. read-only read-out against the re-run).
``--table FILE`` prints a results file as a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import logging
import os
import platform
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # the packages, and bench/benchinfo.py

from benchinfo import git_commit  # noqa: E402

from offline_eval.evaluate import evaluate  # noqa: E402
from offline_eval.notebank_eval import NotebankScorer  # noqa: E402
from offline_eval.split import load_or_build_split  # noqa: E402
from recmem.modelstore import load_model  # noqa: E402

STRATA = ("overall", "recent", "long_term", "new")


def per_target_ndcg(ranks: np.ndarray) -> np.ndarray:
    r = ranks.astype(np.float64)
    return np.where(r < 10, 1.0 / np.log2(r + 2.0), 0.0)


def paired(per: dict[str, np.ndarray], ndcg: np.ndarray, base: np.ndarray) -> dict[str, Any]:
    """Mean paired difference ndcg - base per stratum (masks of ``per``) and its SE."""
    out: dict[str, Any] = {}
    for s in STRATA:
        mask = np.ones(len(ndcg), bool) if s == "overall" else per[f"is_{s}"]
        d = ndcg[mask] - base[mask]
        out[s] = {
            "delta": float(d.mean()) if len(d) else 0.0,
            "delta_se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0,
        }
    return out


def summarise(res: dict[str, Any], plain_ndcg: np.ndarray | None) -> dict[str, Any]:
    per = res["per_target"]
    ndcg = per_target_ndcg(per["ranks"])
    out: dict[str, Any] = {}
    deltas = paired(per, ndcg, plain_ndcg) if plain_ndcg is not None else None
    for s in STRATA:
        m = res[s]
        out[s] = {"ndcg@10": m["ndcg@10"], "hr@10": m["hr@10"], "n": m["n"]}
        if deltas is not None:
            out[s].update(deltas[s])
    return out


def expand(grid: str | None, settings: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if grid:
        g = json.loads(grid)
        names = list(g)
        out += [dict(zip(names, v)) for v in itertools.product(*(g[n] for n in names))]
    if settings:
        out += list(json.loads(settings))
    return out


def table(doc: dict[str, Any]) -> str:
    """Markdown table of a results file: plain first, then each setting in run order."""
    keys = ("chunk_events", "window", "spans_per_chunk", "max_span", "address_dim",
            "notes_per_user", "replay_notes", "min_votes")  # fmt: skip
    head = ["C", "w", "W", "B", "d_rho", "cap", "R", "min votes", "pass", "replayed",
            "NDCG@10", "delta (SE)", "LONG-TERM", "delta (SE)", "RECENT", "NEW"]  # fmt: skip
    with_ref = any("vs_reference" in e for e in doc["results"])
    if with_ref:
        head += ["vs reference (SE)", "LONG-TERM vs reference (SE)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    p = doc["plain"]
    lines.append(
        "| no replay |" + " |" * 9
        + f" {p['overall']['ndcg@10']:.4f} | | {p['long_term']['ndcg@10']:.4f} | |"
        f" {p['recent']['ndcg@10']:.4f} | {p['new']['ndcg@10']:.4f} |" + " |" * (2 * with_ref)
    )  # fmt: skip
    for e in doc["results"]:
        a, st = e["archive"], e["stats"]
        cells = [str(a[k]) for k in keys]
        cells += [e.get("final_pass", "service"), f"{st['replayed'] / max(1, st['queries']):.2f}"]
        for s in ("overall", "long_term"):
            cells += [f"{e[s]['ndcg@10']:.4f}", f"{e[s]['delta']:+.4f} ({e[s]['delta_se']:.4f})"]
        cells += [f"{e['recent']['ndcg@10']:.4f}", f"{e['new']['ndcg@10']:.4f}"]
        if with_ref:
            v = e.get("vs_reference")
            for s in ("overall", "long_term"):
                cells.append(f"{v[s]['delta']:+.4f} ({v[s]['delta_se']:.4f})" if v else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(json.loads(Path(sys.argv[2]).read_text())))
        return
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--part", default="valid", choices=["valid", "test"])
    ap.add_argument("--grid", help="JSON object: field -> list of values (every combination)")
    ap.add_argument("--settings", help="JSON list of objects: field -> value")
    ap.add_argument("--out", required=True, help="JSON file (extended when it exists)")
    ap.add_argument(
        "--reference",
        help="JSON object: a setting scored first (not stored as a result); each new result "
        "also gets its paired NDCG@10 difference to it (vs_reference)",
    )
    args = ap.parse_args()
    model, vocab, cfg, extra = load_model(args.model_dir)
    split = load_or_build_split(cfg)
    path = Path(args.out)
    doc: dict[str, Any]
    if path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("part") != args.part or doc.get("model_version") != extra["model_version"]:
            raise SystemExit(f"{path} holds another part or model; use another --out")
    else:
        doc = {
            "bench": "notebank_tuning",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "machine": {
                "host": socket.gethostname(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            },
            "dataset": split.dataset,
            "part": args.part,
            "model_dir": str(args.model_dir),
            "model_version": extra["model_version"],
            "base_archive": dataclasses.asdict(cfg.archive),
            "base_query_events": cfg.server.replay_query_events,
            "results": [],
        }

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)

    kw = {"return_per_target": True, "with_loss": False, "progress": False}
    t0 = time.perf_counter()
    plain = evaluate(model, split, args.part, cfg.eval, **kw)  # type: ignore[arg-type]
    plain_ndcg = per_target_ndcg(plain["per_target"]["ranks"])
    doc["plain"] = summarise(plain, None)
    doc["plain"]["seconds"] = time.perf_counter() - t0
    logging.info("plain: %s", doc["plain"]["overall"])

    def run(setting: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
        """Score one setting: its results entry and per-target NDCG@10."""
        c = copy.deepcopy(cfg)
        fields = dict(setting)
        if "query_events" in fields:
            c.server.replay_query_events = int(fields.pop("query_events"))
        if fields.pop("final_pass", "service") != "service" or fields.pop("blend", 1.0) != 1.0:
            raise SystemExit(
                "final_pass and blend are gone: the scorer is the rank path "
                "(reports/ml-100k-notebank-tuning documents those experiments)"
            )
        final_pass = "service"
        c.archive = dataclasses.replace(c.archive, **fields)
        scorer = NotebankScorer(model, c, vocab)
        t0 = time.perf_counter()
        res = evaluate(scorer, split, args.part, cfg.eval, **kw)  # type: ignore[arg-type]
        entry = {
            "setting": setting,
            "archive": dataclasses.asdict(c.archive),
            "query_events": c.server.replay_query_events,
            "final_pass": final_pass,
            **summarise(res, plain_ndcg),
            "stats": dict(scorer.stats),
            "seconds": time.perf_counter() - t0,
        }
        return entry, per_target_ndcg(res["per_target"]["ranks"])

    ref_ndcg = None
    if args.reference:
        ref_setting = json.loads(args.reference)
        ref_entry, ref_ndcg = run(ref_setting)
        logging.info("reference %s: ndcg %.4f", ref_setting, ref_entry["overall"]["ndcg@10"])
    done = [json.dumps(r["setting"], sort_keys=True) for r in doc["results"]]
    for setting in expand(args.grid, args.settings):
        if json.dumps(setting, sort_keys=True) in done:
            continue
        entry, ndcg = run(setting)
        if ref_ndcg is not None:
            entry["vs_reference"] = {
                "setting": ref_setting,
                **paired(plain["per_target"], ndcg, ref_ndcg),
            }
        doc["results"].append(entry)
        save()
        o, lt = entry["overall"], entry["long_term"]
        logging.info(
            "%s: ndcg %.4f (%+.4f +- %.4f) LT %.4f (%+.4f) replayed %.2f, %.0f s",
            setting, o["ndcg@10"], o["delta"], o["delta_se"], lt["ndcg@10"], lt["delta"],
            entry["stats"]["replayed"] / max(1, entry["stats"]["queries"]), entry["seconds"],
        )  # fmt: skip
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
