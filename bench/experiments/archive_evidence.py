"""What the NoteBank archive makes reachable on a real split, for a grid of archive settings.

    .venv/bin/python bench/experiments/archive_evidence.py --model-dir DIR [--part test] [--users N] [--grid JSON]

For every target of the split's part: is the target's category key among the events of
the R routed notes / the R most recent notes / R random notes / any note (the ceiling)?
Overall and per stratum (RECENT, LONG-TERM, NEW). Uses the trained model's own (k~, q~);
no replay, so this narrows the settings but does not decide them (docs/archive.md).
Writes DIR_OUT/archive_evidence_<dataset>.json (DIR_OUT = $OUT, else bench/experiments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # the packages, and bench/benchinfo.py

from benchinfo import git_commit  # noqa: E402

from offline_eval.split import load_or_build_split  # noqa: E402
from offline_eval.strata import assign_strata  # noqa: E402
from recmem.archive.tuning import archive_grid, evidence_recall_grid  # noqa: E402
from recmem.modelstore import load_model  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--part", default="test", choices=["valid", "test"])
    ap.add_argument("--users", type=int, default=0, help="first N users with targets (0: all)")
    ap.add_argument(
        "--grid",
        default='{"chunk_events": [16, 32], "max_span": [4, 8], "replay_notes": [2, 4]}',
        help="JSON object: archive field -> list of values",
    )
    ap.add_argument("--query-events", type=int, default=1, help="query positions per route")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "experiments")))
    args = ap.parse_args()
    model, _, cfg, extra = load_model(args.model_dir)
    split = load_or_build_split(cfg)
    targets = split.targets(args.part)
    rows = targets.rows
    if args.users:
        keep = np.isin(targets.users, np.unique(targets.users)[: args.users])
        rows = rows[keep]
    masks = assign_strata(split.seqs, split.event_cat, rows, with_repeat=split.has_repeats)
    grid = archive_grid(cfg.archive, **json.loads(args.grid))
    t0 = time.perf_counter()
    reports = evidence_recall_grid(
        model, split.seqs, rows, grid, event_keys=split.event_cat, query_events=args.query_events
    )
    seconds = time.perf_counter() - t0
    results = []
    for c, rep in zip(grid, reports):
        # strata masks are over ``rows``; the report keeps rows in (user, time) order
        pos = {int(r): i for i, r in enumerate(rows)}
        order = np.array([pos[int(r)] for r in rep.rows], dtype=np.int64)
        entry = {"archive": asdict(c), "all": rep.summary()}
        for name, m in masks.items():
            if m.any():
                entry[name] = rep.summary(m[order])
        results.append(entry)
        logging.info("%s -> %s", asdict(c), entry["all"])
    out = {
        "bench": "archive_evidence",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {"host": socket.gethostname(), "platform": platform.platform()},
        "dataset": split.dataset,
        "part": args.part,
        "query_events": args.query_events,
        "model_version": extra.get("model_version"),
        "targets": int(len(rows)),
        "seconds": seconds,
        "results": results,
    }
    path = Path(args.out) / f"archive_evidence_{split.dataset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
