"""NoteBank archive costs at the default archive settings on synthetic keys and queries.

    .venv/bin/python bench/bench_archive.py [--users N] [--events N] [--out DIR]

(a) ingest: events/s through ``observe_batch`` in micro-batches of 16 events per user
    (random unit k~, q~; L=2, H=4, K=64 as the memory defaults);
(b) route latency p50/p99 for 1 and 8 query positions, for users holding few notes and
    users at the cap (256 notes);
(c) checkpoint form: bytes per user and state_for_users / load_users time.
Writes DIR/archive_<host>.json (DIR = $OUT, else bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from benchinfo import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recmem.archive import NoteBank  # noqa: E402
from recmem.config import ArchiveConfig, MemoryConfig  # noqa: E402


def unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.normal(size=shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.array(samples) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=512)
    ap.add_argument("--events", type=int, default=170, help="events per user")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()
    cfg, mem = ArchiveConfig(), MemoryConfig()
    L, H, K = mem.n_layers, mem.n_heads, mem.key_dim
    rng = np.random.default_rng(0)
    bank = NoteBank(cfg, K, L * H, seed=0)
    users = [f"user-{u}" for u in range(args.users)]
    step, B = 16, 64
    ingest_s, notes = 0.0, 0
    for start in range(0, args.events, step):
        T = min(step, args.events - start)
        for b0 in range(0, len(users), B):
            ids = users[b0 : b0 + B]
            n = len(ids)
            items = rng.integers(0, 3000, size=(n, T))
            pos = np.broadcast_to(np.arange(start + 1, start + T + 1), (n, T))
            ts = 1_700_000_000_000 + pos * 60_000
            k, q = unit(rng, (n, T, L, H, K)), unit(rng, (n, T, L, H, K))
            item_ids = [[str(i) for i in row] for row in items]
            t0 = time.perf_counter()
            notes += bank.observe_batch(
                ids, items, item_ids, np.zeros((n, T)), ts, pos, np.full(n, T), k, q
            )
            ingest_s += time.perf_counter() - t0
    n_events = args.users * args.events
    result: dict = {
        "bench": "archive",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "config": {"archive": vars(cfg), "L": L, "H": H, "K": K},
        "ingest": {
            "users": args.users,
            "events": n_events,
            "notes": notes,
            "events_per_s": n_events / ingest_s,
            "seconds": ingest_s,
        },
    }
    # Route: a user with the notes written above and a user filled to the cap.
    full = NoteBank(cfg, K, L * H, seed=0)
    n_full = cfg.notes_per_user // cfg.spans_per_chunk * cfg.chunk_events
    pos = np.arange(1, n_full + 1)
    full.observe(
        "full", pos, [str(i) for i in pos], np.zeros(n_full), pos * 60_000, pos,
        unit(rng, (n_full, L * H, K)), unit(rng, (n_full, L * H, K)),
    )  # fmt: skip
    route: dict = {}
    for label, b, uid in (("few", bank, users[0]), ("cap", full, "full")):
        for n_q in (1, 8):
            times = []
            for _ in range(300):
                qq = unit(rng, (n_q, L, H, K))
                t0 = time.perf_counter()
                b.route(uid, qq, r=cfg.replay_notes)
                times.append(time.perf_counter() - t0)
            route[f"{label}_notes{b.note_count(uid)}_queries{n_q}"] = percentiles(times)
    result["route"] = route
    t0 = time.perf_counter()
    state = bank.state_for_users(users)
    save_s = time.perf_counter() - t0
    restored = NoteBank(cfg, K, L * H, seed=0)
    t0 = time.perf_counter()
    restored.load_users(state)
    result["checkpoint"] = {
        "bytes_per_user": sum(v.nbytes for v in state.values()) / len(users),
        "state_for_users_s": save_s,
        "load_users_s": time.perf_counter() - t0,
        "pending_per_user": float(np.mean([bank.pending_count(u) for u in users])),
        "notes_per_user": float(np.mean([bank.note_count(u) for u in users])),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"archive_{socket.gethostname().split('.')[0]}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    print(json.dumps({k: result[k] for k in ("ingest", "route", "checkpoint")}, indent=1))


if __name__ == "__main__":
    main()
