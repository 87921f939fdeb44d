"""End-to-end NoteBank replay evaluation of one trained model over many archive settings.

    OMP_NUM_THREADS=1 .venv/bin/python bench/notebank_tuning.py --model-dir DIR \\
        [--part valid] [--grid JSON] [--settings JSON] [--out FILE]

Loads the model once (``recmem train`` output), builds its split, scores the plain model
(no replay) and then ``offline_eval.notebank_eval.NotebankScorer`` (the service's rank
path) once per setting on the chosen part's targets (VALID to choose, TEST to report the
chosen one). A setting is a JSON object of archive fields (``chunk_events``, ``window``,
``spans_per_chunk``, ``max_span``, ``address_dim``, ``notes_per_user``, ``replay_notes``,
``min_votes``, ...) on top of the model's config, plus optionally ``query_events``
(server.replay_query_events) and ``final_pass`` (a diagnostic: "query_only" or
"notes_only", see offline_eval.notebank_eval.FINAL_PASSES). ``--grid`` is expanded to every combination; ``--settings``
is a list. For each setting: NDCG@10 / HR@10 overall and per stratum, the paired
difference of per-target NDCG@10 to the plain model with its standard error, and the
share of queries that got notes. Results are appended to ``--out`` after every setting
(a JSON file; an existing file is extended, settings already in it are skipped).
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
from benchinfo import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offline_eval.evaluate import evaluate  # noqa: E402
from offline_eval.notebank_eval import NotebankScorer  # noqa: E402
from offline_eval.split import load_or_build_split  # noqa: E402
from recmem.modelstore import load_model  # noqa: E402

STRATA = ("overall", "recent", "long_term", "new")


def per_target_ndcg(ranks: np.ndarray) -> np.ndarray:
    r = ranks.astype(np.float64)
    return np.where(r < 10, 1.0 / np.log2(r + 2.0), 0.0)


def summarise(res: dict[str, Any], plain_ndcg: np.ndarray | None) -> dict[str, Any]:
    per = res["per_target"]
    ndcg = per_target_ndcg(per["ranks"])
    out: dict[str, Any] = {}
    for s in STRATA:
        m = res[s]
        out[s] = {"ndcg@10": m["ndcg@10"], "hr@10": m["hr@10"], "n": m["n"]}
        if plain_ndcg is not None:
            mask = np.ones(len(ndcg), bool) if s == "overall" else per[f"is_{s}"]
            d = ndcg[mask] - plain_ndcg[mask]
            out[s]["delta"] = float(d.mean()) if len(d) else 0.0
            out[s]["delta_se"] = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    p = doc["plain"]
    lines.append(
        "| no replay |" + " |" * 9
        + f" {p['overall']['ndcg@10']:.4f} | | {p['long_term']['ndcg@10']:.4f} | |"
        f" {p['recent']['ndcg@10']:.4f} | {p['new']['ndcg@10']:.4f} |"
    )  # fmt: skip
    for e in doc["results"]:
        a, st = e["archive"], e["stats"]
        cells = [str(a[k]) for k in keys]
        cells += [e.get("final_pass", "service"), f"{st['replayed'] / max(1, st['queries']):.2f}"]
        for s in ("overall", "long_term"):
            cells += [f"{e[s]['ndcg@10']:.4f}", f"{e[s]['delta']:+.4f} ({e[s]['delta_se']:.4f})"]
        cells += [f"{e['recent']['ndcg@10']:.4f}", f"{e['new']['ndcg@10']:.4f}"]
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
    done = [json.dumps(r["setting"], sort_keys=True) for r in doc["results"]]
    for setting in expand(args.grid, args.settings):
        if json.dumps(setting, sort_keys=True) in done:
            continue
        c = copy.deepcopy(cfg)
        fields = dict(setting)
        if "query_events" in fields:
            c.server.replay_query_events = int(fields.pop("query_events"))
        final_pass = str(fields.pop("final_pass", "service"))
        c.archive = dataclasses.replace(c.archive, **fields)
        scorer = NotebankScorer(model, c, vocab, final_pass=final_pass)  # type: ignore[arg-type]
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
        doc["results"].append(entry)
        save()
        o, lt = entry["overall"], entry["long_term"]
        logging.info(
            "%s: ndcg %.4f (%+.4f +- %.4f) LT %.4f (%+.4f) replayed %.2f, %.0f s",
            setting, o["ndcg@10"], o["delta"], o["delta_se"], lt["ndcg@10"], lt["delta"],
            scorer.stats["replayed"] / max(1, scorer.stats["queries"]), entry["seconds"],
        )  # fmt: skip
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
