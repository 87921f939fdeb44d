"""Memory-step throughput on CPU: events/s and GB/s of state traffic, per path.

    .venv/bin/python bench/bench_memory.py [--users 8192] [--event-budget 8192]

H=4, K=V=64, the momentum rule, {1, 16, 64} new events per user; paths: the reference, the
recurrent path (one step per event), the chunked form for training and the aligned chunked
form for inference (what ``auto`` runs on large CPU batches without gradients). The target batch is
8192 users; on a small shared CPU a path that would take minutes runs on a subsample of
users (about ``--event-budget`` events per measurement, ``--reference-budget`` for the
one-event-at-a-time reference) and the JSON records the users actually run. GB/s counts the
bytes of S and M read and written once per call (the state traffic, as on the GPU).
Writes bench/results/memory_cpu.json.

    .venv/bin/python bench/bench_memory.py --readout [--threads 1]

instead times the rank replay's one-chunk read-out (``memory_readout_chunk``, outputs only)
against the recurrent scan at rank-sized calls (1-32 users x 9-40 events, positions past
the schedule and across it), median of repeated calls, and writes
bench/results/memory_readout_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.memory.chunk import memory_scan_chunk  # noqa: E402
from models.memory.chunk_aligned import memory_scan_chunk_aligned  # noqa: E402
from models.memory.naive import memory_scan_reference  # noqa: E402
from models.memory.readout import memory_readout_chunk  # noqa: E402
from models.memory.recurrent import memory_scan_recurrent  # noqa: E402

H, K, V = 4, 64, 64
SCHED = dict(n_blocks=16, horizon=256)


def inputs(users: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(users, T, H, K, generator=g),
        k=torch.randn(users, T, H, K, generator=g),
        v=torch.randn(users, T, H, V, generator=g),
        theta=torch.rand(users, T, H, generator=g),
        eta=torch.rand(users, T, H, generator=g) * 0.9,
        alpha=torch.rand(users, T, H, generator=g) * 0.1,
        S0=torch.randn(users, H, K, V, generator=g) * 0.1,
        M0=torch.zeros(users, H, K, V),
        pos0=torch.randint(0, 512, (users,), generator=g),
        lengths=torch.full((users,), T, dtype=torch.int64),
    )


def measure(name: str, users: int, T: int) -> dict[str, Any]:
    inp = inputs(users, T, seed=T)
    with torch.no_grad():
        t0 = time.perf_counter()
        if name == "reference":
            memory_scan_reference(**inp, **SCHED)
        elif name == "recurrent":
            memory_scan_recurrent(**inp, **SCHED)
        elif name == "chunk_aligned":
            memory_scan_chunk_aligned(**inp, **SCHED, chunk_size=16)
        else:
            memory_scan_chunk(**inp, **SCHED, chunk_size=min(16, T))
        dt = time.perf_counter() - t0
    state_bytes = users * H * K * V * 4 * 2 * 2  # S and M, read + write
    return {"path": name, "events_per_user": T, "users_run": users, "seconds": dt,
            "events_per_s": users * T / dt, "state_GBps": state_bytes / dt / 1e9}  # fmt: skip


def readout_rows(repeats: int = 20) -> list[dict[str, Any]]:
    """Median ms per call: recurrent scan vs one-chunk read-out, per (users, events)."""
    rows = []
    for users, T in ((1, 9), (1, 24), (8, 9), (8, 24), (8, 40), (32, 24), (32, 40)):
        inp = inputs(users, T, seed=users * T)
        row: dict[str, Any] = {"users": users, "events_per_user": T}
        for name, fn in (("recurrent", memory_scan_recurrent), ("readout", memory_readout_chunk)):
            times = []
            with torch.no_grad():
                for _ in range(repeats + 2):
                    t0 = time.perf_counter()
                    fn(**inp, **SCHED)
                    times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = 1e3 * sorted(times[2:])[len(times[2:]) // 2]
        row["speedup"] = row["recurrent_ms"] / row["readout_ms"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=8192)
    ap.add_argument("--event-budget", type=int, default=8192)
    ap.add_argument("--reference-budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_cpu.json"))
    ap.add_argument("--readout", action="store_true", help="time the rank read-out instead")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.readout:
        torch.set_flush_denormal(True)
        rows = readout_rows()
        out = Path(args.out).with_name("memory_readout_cpu.json")
        info = {
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
            "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                         capture_output=True, text=True).stdout.strip(),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "torch_threads": torch.get_num_threads()},
            "sizes": {"H": H, "K": K, "V": V, **SCHED, "momentum": True},
            "figures": rows,
        }  # fmt: skip
        out.write_text(json.dumps(info, indent=1) + "\n")
        for r in rows:
            print(f"{r['users']:3d} x {r['events_per_user']:3d}: recurrent "
                  f"{r['recurrent_ms']:.2f} ms, read-out {r['readout_ms']:.2f} ms "
                  f"({r['speedup']:.2f}x)")  # fmt: skip
        return
    plan = []
    for T in (1, 16, 64):
        for name, budget in (
            ("reference", args.reference_budget),
            ("recurrent", args.event_budget),
            ("chunk", args.event_budget),
            ("chunk_aligned", args.event_budget),
        ):
            plan.append((name, T, max(1, min(args.users, budget // T))))
    rows = [measure(n, u, T) for n, T, u in tqdm(plan, desc="memory paths")]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
        "git_commit": commit,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "sizes": {"target_users": args.users, "H": H, "K": K, "V": V, **SCHED, "momentum": True},
        "note": "users_run < target_users: a subsample (the CPU is shared and small); "
        "events/s and GB/s are for the users actually run.",
        "figures": rows,
    }  # fmt: skip
    out = Path(args.out)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    print(f"{'path':13s} {'T':>3s} {'users':>6s} {'events/s':>10s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['path']:13s} {r['events_per_user']:3d} {r['users_run']:6d} "
              f"{r['events_per_s']:10.3e} {r['state_GBps']:7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
