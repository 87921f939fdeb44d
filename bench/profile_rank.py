"""Where a micro-batch's rank time goes, in process (no gRPC): the Ranker alone.

    .venv/bin/python bench/profile_rank.py [--device auto|cpu|cuda] [--batches 1,8,32]
        [--replay 0,2] [--calls N] [--profile] [--set section.field=value ...] [--out DIR]

Builds the same engine as bench/bench_rank.py (``build_engine``: default configuration,
freshly initialised model, synthetic Zipf histories ingested through ``Engine.apply``; the
loop not started, this thread drives the Ranker), then for each batch
size B and R calls ``Ranker.rank`` on B requests of distinct random users (100 candidates,
k = 10) ``--calls`` times and records per call the wall time (the device synchronised after
each call) and the Ranker's own per-step split. With ``--profile`` it also records a
torch.profiler table (CPU and, on CUDA, kernel times) of 10 calls per cell.

Writes DIR/profile_rank_<cpu|gpu>.json (DIR = $OUT, else bench/results) with the profiler
tables alongside as .txt; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from bench_rank import _ints, build_memory_stack, cpu_name
from benchinfo import git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from models.memory.ops import flush_denormals
    from recmem.ranking import RankQuery

    flush_denormals()
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--events", type=int, default=300)
    ap.add_argument("--items", type=int, default=3706)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", type=_ints, default=(1, 8, 32))
    ap.add_argument("--replay", type=_ints, default=(0, 2))
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile-rank-") as spill:
        args.spill_dir = spill
        built = build_memory_stack(args)
        ranker = built["built"].ranker
        dev = built["device"]
        cuda = dev.startswith("cuda")

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        rng = np.random.default_rng(0)
        cells: list[dict[str, Any]] = []
        tables: list[str] = []
        for B in args.batches:
            for R in args.replay:

                def batch(B: int = B, R: int = R) -> list[RankQuery]:
                    users = rng.choice(args.users, min(B, args.users), replace=False)
                    return [
                        RankQuery(
                            f"u{u}",
                            10,
                            rng.choice(args.items, 100, replace=False).astype(np.int64),
                            replay_notes=R,
                        )
                        for u in users
                    ]

                for _ in range(3):
                    ranker.rank(batch())
                sync()
                before = dict(ranker.seconds)
                times = []
                for _ in range(args.calls):
                    qs = batch()
                    t = time.perf_counter()
                    ranker.rank(qs)
                    sync()
                    times.append(time.perf_counter() - t)
                ms = np.array(times) * 1e3
                cell = {
                    "batch": B,
                    "replay_notes": R,
                    "calls": args.calls,
                    "mean_ms": float(ms.mean()),
                    "p50_ms": float(np.percentile(ms, 50)),
                    "p99_ms": float(np.percentile(ms, 99)),
                    "ms_by_step": {
                        k: 1e3 * (v - before[k]) / args.calls for k, v in ranker.seconds.items()
                    },
                }
                cells.append(cell)
                print(
                    f"B={B:3d} R={R}: mean {cell['mean_ms']:6.2f} ms p50 {cell['p50_ms']:6.2f}"
                    f" p99 {cell['p99_ms']:6.2f}  "
                    + " ".join(f"{k} {v:.2f}" for k, v in cell["ms_by_step"].items()),
                    flush=True,
                )
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                    with profile(activities=acts) as prof:
                        for _ in range(10):
                            ranker.rank(batch())
                        sync()
                    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                    tab = prof.key_averages().table(sort_by=key, row_limit=30)
                    cpu_tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                    tables.append(f"## B={B} R={R} (10 calls), by {key}\n{tab}\n")
                    if cuda:
                        tables.append(f"## B={B} R={R} (10 calls), by CPU time\n{cpu_tab}\n")
        built["built"].close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile_rank_{'gpu' if cuda else 'cpu'}{args.tag}"
    result = {
        "bench": "profile_rank",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/profile_rank.py", *sys.argv[1:]]),
        "machine": {
            "device": dev,
            "device_name": torch.cuda.get_device_name() if cuda else cpu_name(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "setup": {"users": args.users, "events": args.events, "items": args.items,
                  "overrides": args.set, "ingest": built["ingest"]},
        "cells": cells,
    }  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if tables:
        (out / f"{name}.txt").write_text("\n".join(tables))
    print(f"wrote {out / name}.json")


if __name__ == "__main__":
    main()
