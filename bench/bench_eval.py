"""Throughput of the offline evaluator (full ranking, strata, exclusions) on a real split.

    python bench/bench_eval.py --split runs/splits/ml-1m.npz [--device cuda] [--models pop,sasrec,memory]

Times ``offline_eval.evaluate.evaluate`` on the TEST targets for Pop and for UNTRAINED
SASRec and memory models (weights do not change the work done, only the ranks, so the
metrics here mean nothing; the seconds do). Needs numpy + torch only (no polars) when given
a prepared split (``recmem eval --dataset D --prepare-split PATH``). Writes
OUT/bench_eval_<dataset>_<device>.json (OUT = --out, else $OUT, else bench/results).
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from benchinfo import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offline_eval.baselines import PopScorer  # noqa: E402
from offline_eval.evaluate import Scorer, evaluate  # noqa: E402
from offline_eval.split import TimeSplit  # noqa: E402
from recmem.config import Config  # noqa: E402


def build(name: str, split: TimeSplit, cfg: Config, device: str) -> Scorer:
    if name == "pop":
        return PopScorer(split)
    if name == "sasrec":
        from models.sasrec import SASRec, SASRecConfig

        return SASRec(
            split.n_items, split.vocab.n_oov, SASRecConfig(embed_dim=cfg.model.embed_dim)
        ).to(device)  # type: ignore[return-value]
    if name == "memory":
        from models.recommender import MemoryRecommender

        model = MemoryRecommender(split.n_items, split.vocab.n_oov, cfg.memory, cfg.model)
        return model.to(device)  # type: ignore[return-value]
    raise ValueError(f"unknown model {name!r} (pop | sasrec | memory)")


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", required=True, help="prepared split .npz")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="pop,sasrec,memory")
    ap.add_argument("--batch-users", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()
    cfg = Config()
    split = TimeSplit.load(args.split)
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        scorer = build(name.strip(), split, cfg, args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = evaluate(scorer, split, "test", cfg.eval, batch_users=args.batch_users)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        results[name] = {
            "seconds": seconds,
            "targets": res["n_targets"],
            "targets_per_s": res["n_targets"] / seconds,
            "ndcg@10_untrained": res["overall"]["ndcg@10"],
        }
        logging.info("%s: %.1f s, %.0f targets/s", name, seconds, res["n_targets"] / seconds)
    record = {
        "bench": "bench_eval",
        "dataset": split.dataset,
        "n_events": split.n_events,
        "n_items": split.n_items,
        "n_test_targets": next(iter(results.values()))["targets"] if results else 0,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "",
        "machine": f"{socket.gethostname()} {platform.machine()} {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "batch_users": args.batch_users,
        "note": "untrained SASRec/memory weights: seconds are meaningful, metrics are not",
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_eval_{split.dataset}_{args.device.split(':')[0]}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
