"""The engine process's cost per request of RankBatch calls: ``RecMemServicer.RankBatch``
called in process (no gRPC, no front end) on the engine ``bench/bench_rank.py``'s
``build_memory_stack`` builds, its loop started, for one or more source trees alternating.

    .venv/bin/python bench/experiments/rankbatch_engine.py [--root NAME=DIR ...]
        [--path rankbatch,packed] [--batch 32,64] [--replay 0,2] [--seconds 3] [--rounds 2]
        [--users 256] [--events 100] [--items 3706] [--tree-set NAME:S.F=V ...] [--json PATH]

This tree (as ``new``) and each ``--root NAME=DIR`` get a worker process with
``PYTHONPATH=DIR`` that builds the stack from DIR's code (CPU, one torch thread, as
bench_rank's server) and the servicer as ``recmem serve`` builds it (limits from the
configuration, ``RankMetrics``, no router). The driver then asks the workers in turn, one
cell at a time (a cell: RankBatch calls of B requests at replay R, back to back from one
thread for ``--seconds``), ``--rounds`` times, the order of the trees alternating between
rounds; the idle workers wait on a pipe. Requests are bench_rank's ``cand100`` shape (100
distinct random candidates, k = 10, a random user; replay on with R notes when R > 0, the
replay cache off) from a fixed seed, so every tree answers the same calls.

Figures per cell: microseconds of process CPU time (every thread of the worker: the
servicer's caller and the engine loop) and of wall time per request, requests per second,
and the loop's micro-batches per call. Before the cells each worker answers one fixed set
of batches (request times set, so that the read-out's clock is the same); ``answers`` in
the JSON counts the requests whose status, notes replayed or items differ between the trees
and the largest score difference of the others (micro-batches composed otherwise may
round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


class _Context:
    """The part of ``grpc.ServicerContext`` the servicer reads: no deadline, no metadata."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def set_trailing_metadata(self, md: Any) -> None:
        pass

    def abort(self, code: Any, message: str) -> None:
        raise RuntimeError(f"aborted: {code} {message}")


def _requests(rank_pb2: Any, rng: Any, n: int, users: int, items: int, replay: int,
              ts_ms: int = 0) -> list[Any]:  # fmt: skip
    return [
        rank_pb2.RankRequest(
            user_id=f"u{rng.integers(users)}",
            k=K,
            candidate_item_ids=[f"item{i}" for i in rng.choice(items, N_CANDIDATES, replace=False)],
            replay=rank_pb2.ReplayOptions(enabled=replay > 0, notes=replay),
            request_ts_ms=ts_ms,
        )
        for _ in range(n)
    ]


def worker(args: argparse.Namespace) -> None:
    """Build the stack from ``args.root``'s code, then answer one JSON command per line."""
    root = Path(args.root).resolve()
    sys.path[:0] = [str(root), str(root / "bench")]
    import numpy as np
    from bench_rank import build_memory_stack

    from models.memory.ops import flush_denormals
    from proto.recmem.v1 import rank_pb2
    from recmem.server.app import limits_from_config
    from recmem.server.metrics import RankMetrics
    from recmem.server.packed import pack_queries, unpack_results
    from recmem.server.servicer import RecMemServicer
    from recmem.server.validation import to_queries

    flush_denormals()
    ns = argparse.Namespace(
        users=args.users, events=args.events, items=args.items, device=args.device,
        threads=1 if args.device == "cpu" else 0,
        spill_dir=tempfile.mkdtemp(prefix="rankbatch-engine-"), set=list(args.set or []),
    )  # fmt: skip
    t0 = time.perf_counter()
    made = build_memory_stack(ns)
    cfg, built, vocab = made["cfg"], made["built"], made["vocab"]
    loop = built.loop.start()
    servicer = RecMemServicer(
        loop, vocab, limits_from_config(cfg), built.model_version,
        timeout_s=cfg.server.request_timeout_s, metrics=RankMetrics(),
    )  # fmt: skip
    ctx = _Context()
    # the same answers from every tree: fixed request times, one fixed set of batches
    rng = np.random.default_rng(7)
    answers = []
    for replay in (0, 2):
        for b in (1, 5, 32):
            reqs = _requests(rank_pb2, rng, b, args.users, args.items, replay, 1_700_000_000_000)
            got = servicer.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), ctx)
            answers += [
                [
                    r.code,
                    r.response.notes_replayed,
                    [(i.item_id, i.score) for i in r.response.items],
                ]
                for r in got.results
            ]
    print(json.dumps({"ready": True, "build_s": round(time.perf_counter() - t0, 1),
                      "ingest": made["ingest"], "answers": answers}),
          flush=True)  # fmt: skip
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("stop"):
            break
        b, replay = cmd["batch"], cmd["replay"]
        rng = np.random.default_rng(1000 * b + replay)
        calls = [
            rank_pb2.RankBatchRequest(
                requests=_requests(rank_pb2, rng, b, args.users, args.items, replay)
            )
            for _ in range(8)
        ]
        if cmd.get("path") == "packed":  # what a front end sends: validated, packed
            limits = limits_from_config(cfg)
            calls = [pack_queries(to_queries(list(c.requests), vocab, limits)) for c in calls]

            def answer(call: Any, b: int = b) -> Any:
                data = servicer.rank_packed(call, ctx)
                results = unpack_results(data, b, vocab.item_ids, built.model_version)
                return rank_pb2.RankBatchResponse(results=results)
        else:

            def answer(call: Any) -> Any:
                return servicer.RankBatch(call, ctx)

        for c in calls[:2]:  # warm up the shape
            answer(c)
        counts = loop.counts
        batches0, n, j = counts.batches, 0, 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        stop_at = wall0 + cmd["seconds"]
        while time.perf_counter() < stop_at:
            got = answer(calls[j % len(calls)])
            if any(r.code for r in got.results):
                raise RuntimeError(f"RankBatch failed: {got.results[0].message}")
            n += b
            j += 1
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        print(json.dumps({
            "path": cmd.get("path", "rankbatch"),
            "batch": b, "replay": replay, "calls": j, "requests": n,
            "cpu_us_per_request": round(cpu / n * 1e6, 1),
            "wall_us_per_request": round(wall / n * 1e6, 1),
            "requests_per_s": round(n / wall, 1),
            "micro_batches_per_call": round((counts.batches - batches0) / j, 2),
        }), flush=True)  # fmt: skip
    loop.stop()
    built.close()
    shutil.rmtree(ns.spill_dir, ignore_errors=True)


def _compare(answers: list[list[Any]]) -> dict[str, Any]:
    """How the trees' answers to the fixed batches differ: requests, requests whose status,
    notes replayed or items (in order) differ, and the largest score difference."""
    first = answers[0]
    differ, worst = 0, 0.0
    for other in answers[1:]:
        for (code_a, notes_a, items_a), (code_b, notes_b, items_b) in zip(
            first, other, strict=True
        ):
            if (code_a, notes_a, [i for i, _ in items_a]) != (
                code_b,
                notes_b,
                [i for i, _ in items_b],
            ):
                differ += 1
                continue
            for (_, s_a), (_, s_b) in zip(items_a, items_b, strict=True):
                worst = max(worst, abs(s_a - s_b))
    return {"requests": len(first), "differing": differ, "max_score_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--batch", default="32,64")
    ap.add_argument("--replay", default="0,2")
    ap.add_argument("--path", default="rankbatch",
                    help="rankbatch | packed (comma-separated): RankBatch calls, or the "
                    "packed calls a front end sends (requests validated and packed "
                    "beforehand, answers unpacked into RankBatchResults)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--events", type=int, default=100, help="mean events per user")
    ap.add_argument("--items", type=int, default=3706)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--root-commit", action="append", default=[],
                    help="NAME=SHA: a tree's commit (a git archive has no .git)")  # fmt: skip
    ap.add_argument("--tree-set", action="append", default=[],
                    help="NAME:SECTION.FIELD=VALUE: a configuration override of one tree "
                    "(repeatable; a tree may be given twice under two names)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-root", dest="root_dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.root = args.root_dir
        worker(args)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from benchinfo import git_commit, machine_facts, write_result

    roots = {"new": str(HERE.parents[2]), **dict(r.split("=", 1) for r in args.root)}
    procs: dict[str, subprocess.Popen[str]] = {}
    ready: dict[str, Any] = {}
    commits: dict[str, str] = {}
    for name, root in roots.items():  # built one after another: no contention
        # the tree first; what PYTHONPATH held (wheels carried to a GPU host) after it
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        cmd = [sys.executable, str(HERE), "--worker", "--worker-root", root,
               "--users", str(args.users), "--events", str(args.events),
               "--items", str(args.items), "--device", args.device]  # fmt: skip
        for t in args.tree_set:
            tree, _, kv = t.partition(":")
            if tree == name:
                cmd += ["--set", kv]
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        assert p.stdout is not None
        ready[name] = json.loads(p.stdout.readline())
        procs[name] = p
        commits[name] = dict(c.split("=", 1) for c in args.root_commit).get(name) or (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
            ).stdout.strip()
        )
        print(name, {k: v for k, v in ready[name].items() if k != "answers"}, file=sys.stderr)
    cells = [
        (path, int(b), int(r))
        for path in args.path.split(",")
        for b in args.batch.split(",")
        for r in args.replay.split(",")
    ]
    rows: list[dict[str, Any]] = []
    names = list(procs)
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for path, b, r in cells:
            for name in order:
                p = procs[name]
                assert p.stdin is not None and p.stdout is not None
                ask = {"path": path, "batch": b, "replay": r, "seconds": args.seconds}
                p.stdin.write(json.dumps(ask) + "\n")
                p.stdin.flush()
                row = {"tree": name, "round": rnd, **json.loads(p.stdout.readline())}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.write(json.dumps({"stop": True}) + "\n")
        p.stdin.flush()
        p.wait(60)
    summary: dict[str, dict[str, float]] = {}
    for path, b, r in cells:
        for name in names:
            mine = [
                x
                for x in rows
                if (x["tree"], x["path"], x["batch"], x["replay"]) == (name, path, b, r)
            ]
            summary[f"{name} {path} B={b} R={r}"] = {
                "cpu_us_per_request_min": min(x["cpu_us_per_request"] for x in mine),
                "cpu_us_per_request_max": max(x["cpu_us_per_request"] for x in mine),
                "wall_us_per_request_min": min(x["wall_us_per_request"] for x in mine),
                "wall_us_per_request_max": max(x["wall_us_per_request"] for x in mine),
            }
    result = {
        "benchmark": "rankbatch_engine",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "trees": {n: {"root": roots[n], "commit": commits[n], **ready[n]} for n in names},
        "answers": _compare([ready[n].pop("answers") for n in names]),
        "machine": machine_facts(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "path": args.path,
            "batch": args.batch,
            "replay": args.replay,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "users": args.users,
            "events": args.events,
            "items": args.items,
            "tree_set": args.tree_set,
            "candidates": N_CANDIDATES,
            "k": K,
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
