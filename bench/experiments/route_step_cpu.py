"""CPU cost of the rank step's archive route and of the whole rank step at replay R, for
this tree and ``--root NAME=DIR`` trees, alternating (the machine is noisy).

    .venv/bin/python bench/experiments/route_step_cpu.py [--root NAME=DIR ...]
        [--root-commit NAME=SHA ...] [--batch 64] [--replay 2] [--seconds 3] [--rounds 3]
        [--users 256] [--events 100] [--items 3706] [--json PATH]

Each round runs one worker process per tree (``PYTHONPATH=DIR``, the tree order reversed
every other round) that builds ``bench/bench_rank.py``'s stack (CPU, one torch thread,
the engine loop not started) and ranks fixed micro-batches of B requests (a random user,
100 distinct random candidates, k = 10, replay R, request time fixed) with the engine's
``Ranker`` directly. It records the ``Engine.route_many`` calls of one pass, then measures,
each for ``--seconds`` of back-to-back calls: ``route`` (the recorded ``Engine.route_many``
calls again: the NoteBank route and the notes turned into events) and ``rank``
(``Ranker.rank`` of the micro-batches), as process CPU microseconds per request.
``answers`` compares the trees' items (in order), notes replayed and scores of the first
pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
K = 10
N_CANDIDATES = 100
N_BATCHES = 8


def worker(args: argparse.Namespace) -> None:
    """Build the stack from the tree on ``sys.path``, measure, print one JSON line."""
    root = Path(args.worker_root).resolve()
    sys.path[:0] = [str(root), str(root / "bench")]
    import numpy as np
    from bench_rank import build_memory_stack

    from models.memory.ops import flush_denormals
    from recmem.ranking import RankQuery

    flush_denormals()
    ns = argparse.Namespace(
        users=args.users, events=args.events, items=args.items, device="cpu", threads=1,
        spill_dir=tempfile.mkdtemp(prefix="route-step-"), set=[],
    )  # fmt: skip
    built = build_memory_stack(ns)["built"]
    engine, ranker = built.engine, built.ranker
    rng = np.random.default_rng(7)
    batches = [
        [
            RankQuery(
                user_id=f"u{rng.integers(args.users)}",
                k=K,
                candidates=rng.choice(args.items, N_CANDIDATES, replace=False).astype(np.int64),
                replay_notes=args.replay,
                request_ts_ms=1_700_000_000_000,
            )
            for _ in range(args.batch)
        ]
        for _ in range(N_BATCHES)
    ]
    calls: list[list[Any]] = []
    route_many = engine.route_many

    def recording(requests: Any) -> Any:
        calls.append(list(requests))
        return route_many(requests)

    engine.route_many = recording
    answers = []
    for batch in batches:
        for res in ranker.rank(batch):
            answers.append([res.items.tolist(), res.scores.tolist(), res.notes_replayed])
    engine.route_many = route_many

    def per_request(run: Any, n_requests: int) -> float | None:
        if n_requests == 0:  # replay off: no route
            return None
        run()  # warm
        n, cpu0, stop_at = 0, time.process_time(), time.perf_counter() + args.seconds
        while time.perf_counter() < stop_at:
            run()
            n += n_requests
        return round((time.process_time() - cpu0) / n * 1e6, 1)

    out = {
        "route_calls": len(calls),
        "route_cpu_us_per_request": per_request(
            lambda: [route_many(c) for c in calls], sum(len(c) for c in calls)
        ),
        "rank_cpu_us_per_request": per_request(
            lambda: [ranker.rank(b) for b in batches], args.batch * len(batches)
        ),
        "answers": answers,
    }
    print(json.dumps(out), flush=True)
    built.close()


def _compare(answers: list[list[Any]]) -> dict[str, Any]:
    first = answers[0]
    differ, worst = 0, 0.0
    for other in answers[1:]:
        for (items_a, scores_a, notes_a), (items_b, scores_b, notes_b) in zip(
            first, other, strict=True
        ):
            if (items_a, notes_a) != (items_b, notes_b):
                differ += 1
                continue
            worst = max([worst, *(abs(a - b) for a, b in zip(scores_a, scores_b, strict=True))])
    return {"requests": len(first), "differing": differ, "max_score_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--root-commit", action="append", default=[], help="NAME=SHA")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--replay", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--items", type=int, default=3706)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from benchinfo import git_commit, machine_facts, write_result

    roots = {"new": str(HERE.parents[2]), **dict(r.split("=", 1) for r in args.root)}
    given = dict(c.split("=", 1) for c in args.root_commit)
    commits = {
        n: given.get(n)
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True
        ).stdout.strip()
        for n, d in roots.items()
    }
    names = list(roots)
    rows: list[dict[str, Any]] = []
    answers: dict[str, list[Any]] = {}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            root = roots[name]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (root, os.environ.get("PYTHONPATH", "")) if p
            )}  # fmt: skip
            cmd = [sys.executable, str(HERE), "--worker", "--worker-root", root,
                   "--batch", str(args.batch), "--replay", str(args.replay),
                   "--seconds", str(args.seconds), "--users", str(args.users),
                   "--events", str(args.events), "--items", str(args.items)]  # fmt: skip
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            res = json.loads(got.stdout.strip().splitlines()[-1])
            answers.setdefault(name, res.pop("answers"))
            row = {"tree": name, "round": rnd, **res}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    summary = {
        name: {
            f"{what}_cpu_us_per_request_{fn.__name__}": fn(
                r[f"{what}_cpu_us_per_request"] for r in rows if r["tree"] == name
            )
            for what in ("route", "rank")
            for fn in (min, max)
        }
        for name in names
    }
    result = {
        "benchmark": "route_step_cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "trees": {n: {"root": roots[n], "commit": commits[n]} for n in names},
        "answers": _compare([answers[n] for n in names]),
        "machine": machine_facts(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "batch": args.batch,
            "replay": args.replay,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "users": args.users,
            "events": args.events,
            "items": args.items,
            "candidates": N_CANDIDATES,
            "k": K,
            "batches": N_BATCHES,
        },  # fmt: skip
        "summary": summary,
        "cells": rows,
    }
    if args.json is not None:
        write_result(args.json, result)
    else:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
