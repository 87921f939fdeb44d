"""The engine alone on ML-100K (no Kafka): per-phase thread CPU seconds of ``Engine.plan /
begin / compute / commit / commit_notes`` for settings alternated in one process, so that a
busy shared machine (whose load swings end-to-end wall times by 40 %) still compares them.

    .venv/bin/python bench/experiments/ingest_inprocess.py --rounds 3 \\
        --variant packed=state.packed_advance=on --variant buckets=state.packed_advance=off \\
        --out bench/experiments/ingest_inprocess_cpu.json

Each round builds a fresh engine per variant (default config, fresh weights seeded by
``train.seed``, the dataset's items as vocabulary, NoteBank on) and applies the whole
dataset in time order in batches of ``--batch`` events, on the main thread, one intra-op
thread, denormals flushed (as ``recmem ingest`` runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from benchinfo import git_commit  # noqa: E402

from models.memory.ops import flush_denormals  # noqa: E402
from models.recommender import MemoryRecommender  # noqa: E402
from proto.actions import ACTIONS  # noqa: E402
from recmem.config import load_config  # noqa: E402
from recmem.datasets import load_dataset  # noqa: E402
from recmem.engine.builder import build_engine  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402
from streams.validate import ValidEvent  # noqa: E402

PHASES = ("plan", "begin", "compute", "commit", "notes")


def run(overrides: list[str], dataset: str, batch: int) -> dict[str, float]:
    cfg = load_config(None, overrides, environ={})
    cfg.state.spill_dir = tempfile.mkdtemp(prefix="ingest-inprocess-")
    frame = load_dataset(dataset, cfg.data).events
    items = sorted(frame["item_id"].unique().to_list())
    cols = [frame[c].to_list() for c in ("user_id", "item_id", "ts_ms", "action", "value")]
    events = [
        ValidEvent(u, i, t, ACTIONS.index(a) if isinstance(a, str) else int(a), v, None,
                   zlib.crc32(u.encode()) % 4, n)
        for n, (u, i, t, a, v) in enumerate(zip(*cols))
    ]  # fmt: skip
    torch.manual_seed(cfg.train.seed)
    vocab = ItemVocab(items, cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    built = build_engine(cfg, model=model, vocab=vocab, start=False, device="cpu")
    eng = built.engine
    cpu = dict.fromkeys(PHASES, 0.0)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for start in range(0, len(events), batch):
        t = time.thread_time()
        plan = eng.plan(events[start : start + batch])
        cpu["plan"] += time.thread_time() - t
        for rows in plan.pieces:
            t = time.thread_time()
            piece = eng.begin(plan, rows)
            cpu["begin"] += time.thread_time() - t
            for name, step in (("compute", eng.compute), ("commit", eng.commit),
                               ("notes", eng.commit_notes)):  # fmt: skip
                t = time.thread_time()
                step(piece)
                cpu[name] += time.thread_time() - t
        eng.totals.batches += 1
    out = {f"cpu_{k}_s": round(v, 3) for k, v in cpu.items()}
    out["cpu_total_s"] = round(time.thread_time() - cpu0, 3)
    out["wall_s"] = round(time.perf_counter() - wall0, 3)
    out["events"] = eng.totals.events
    built.close()
    return out


def main() -> None:
    flush_denormals()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="ml-100k")
    ap.add_argument("--batch", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", required=True, help="NAME=section.field=v")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = [v.split("=", 1) for v in args.variant]
    rounds = []
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        rounds.append({name: run([setting], args.dataset, args.batch) for name, setting in order})
        print(json.dumps(rounds[-1]), flush=True)
    result = {
        "benchmark": "ingest_inprocess",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
        "command": " ".join(
            [".venv/bin/python", "bench/experiments/ingest_inprocess.py", *sys.argv[1:]]
        ),  # fmt: skip
        "variants": dict(variants),
        "rounds": rounds,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
