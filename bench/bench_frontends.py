"""Rank through front-end processes (``server.frontends``) against the one-process server, on
the same engine in the same run.

    .venv/bin/python bench/bench_frontends.py [--frontends 0,2] [--concurrency 8,32]
        [--replay 0,2] [--systems memory[,sasrec]] [--seconds 3] [--rounds 2] [--users N]
        [--events N] [--items N] [--client-procs N] [--set section.field=value ...]
        [--json PATH]

A server process builds the memory engine of ``bench/bench_rank.py`` (default model shape,
freshly initialised, 256 users with Zipf histories ingested through ``Engine.apply``),
starts its loop, and serves it at once in each way asked: ``server.frontends = 0`` (the
``RankServer`` on a port of its own) and N >= 1 (the engine's server on a private unix
socket behind N front-end processes sharing a port, as ``recmem serve`` runs them). The
client (``bench_rank.run_cell``: closed-loop threads on one channel per client process)
runs each cell (concurrency x R, 100 candidates, k = 10) against every setting in turn,
``--rounds`` times with the order alternating, so slow drifts of a shared machine fall on
both. Per cell: p50/p99/mean, throughput, the engine loop's mean micro-batch, and where
the cores went over the timed window (CPU seconds per wall second): the client processes,
the front-end processes, the engine's process and its loop thread. A role near its core
count (the loop thread: 1) is the one that bounds the cell.

``--systems memory,sasrec`` also serves the SASRec baseline of ``bench/bench_rank.py``
(``SASRecRanker``: each request re-encodes its user's last 200 events, behind an engine
loop of its own with the same micro-batching and the same servicer) in every front-end
setting, the same way: each cell runs against every (system, setting) pair in turn, the
order alternating. The summary then holds, per cell and setting, the SASRec/memory
throughput ratio (issue 14's goal: memory >= 5x SASRec served the same way, so the ratio
<= 0.2). SASRec has no notes: its cells with R > 0 are the same requests, the replay
options ignored by its ranker.

Writes PATH (default bench/results/frontends_cpu.json, or _gpu): machine, date, commit,
command, load averages, cells. On a 2-core CPU the engine's rank step, the front ends and
the client share two cores, so this shows the cost and the batching, not the gain a
many-core GPU host would see (where the per-call Python gRPC work of one process is the
limit, issue 14).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from bench_rank import SASREC_WINDOW, SASRecRanker, build_memory_stack, cpu_name, run_cell
from benchinfo import cpu_seconds, git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEMS = ("memory", "sasrec")
# CPU seconds per wall second of each role during a cell: the client processes, the
# front-end processes, the engine's process (its loop, its gRPC server, the idle loop of
# the other system) and its loop thread alone. A role near its core count bounds the cell.
# Then the engine loop's shares of the cell: ranking, and collecting batches (waiting out
# the micro-batch window).
ROLE_FIGURES = (
    "client_cores_busy",
    "frontends_cores_busy",
    "engine_process_cores_busy",
    "engine_loop_cores_busy",
    "engine_busy_share",
    "engine_collect_share",
)


def serve(args: argparse.Namespace, conn: Any) -> None:
    """Child process: build and ingest, serve the engine once per front-end setting,
    answer the loop's counts on request."""
    import dataclasses

    import torch

    from models.sasrec import SASRec, SASRecConfig
    from recmem.engine import EngineLoop
    from recmem.server.app import RankServer
    from recmem.server.frontends import FrontEnds

    made = build_memory_stack(args)
    cfg, built, vocab = made["cfg"], made["built"], made["vocab"]
    loops = {"memory": (built.loop.start(), built.model_version)}
    if "sasrec" in args.systems:
        sasrec = SASRec(args.items, cfg.model.n_oov_buckets, SASRecConfig())
        sasrec = sasrec.to(made["device"]).eval()
        history = {u: h[0][-SASREC_WINDOW:] for u, h in made["hist"].items()}
        s = cfg.server
        sas_loop = EngineLoop(
            SASRecRanker(sasrec, history),
            window_ms=s.batch_window_ms,
            max_batch=s.max_batch,
            adaptive=s.adaptive_window,
            name="sasrec-loop",
        )
        loops["sasrec"] = (sas_loop.start(), "bench-sasrec")
    servers: list[Any] = []
    fronts: dict[tuple[str, int], FrontEnds] = {}
    ports: dict[str, dict[int, int]] = {}
    for system in args.systems:
        loop, version = loops[system]
        ports[system] = {}
        for n in args.frontends:
            if n == 0:
                srv = RankServer(cfg, loop, vocab, version).start()
            else:
                c = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, frontends=n))
                front = FrontEnds(c)
                srv = RankServer(c, loop, vocab, version,
                                 private=front.engine_address, port=front.port).start()  # fmt: skip
                fronts[system, n] = front.start()
            servers.append(srv)
            ports[system][n] = srv.port
    conn.send(
        {
            "ports": ports,
            "pid": os.getpid(),
            "device": made["device"],
            "device_name": torch.cuda.get_device_name()
            if made["device"].startswith("cuda")
            else cpu_name(),
            "torch_threads": torch.get_num_threads(),
            "ingest": made["ingest"],
        }
    )
    while (msg := conn.recv()) != "stop":
        system, n = msg
        c = loops[system][0].counts
        name = "engine-loop" if system == "memory" else "sasrec-loop"
        loop_tid = next((t.native_id for t in threading.enumerate() if t.name == name), None)
        conn.send(
            {
                "batches": c.batches,
                "requests": c.requests,
                "busy_s": c.busy_seconds,
                "collect_s": c.collect_seconds,
                # where the cores go: this process (engine loop, its gRPC server, the other
                # system's idle loop), its loop thread, and the cell's front-end processes
                "engine_process_cpu_s": cpu_seconds("self"),
                "engine_loop_cpu_s": cpu_seconds(f"self/task/{loop_tid}") if loop_tid else 0.0,
                "frontends_cpu_s": cpu_seconds(*fronts[system, n].pids) if n else 0.0,
            }
        )
    for front in fronts.values():
        front.stop(1.0)
    for srv in servers:
        srv.stop(grace=1.0)
    if "sasrec" in loops:
        loops["sasrec"][0].stop()
    built.close()


class WindowSampler:
    """Samples the server process's counts and CPU clocks at a cell's timed window's start
    and end, from a thread, while the clients run (``run_cell``'s ``window`` callback)."""

    def __init__(
        self, conn: Any, setting: tuple[str, int], profile: tuple[int, str] | None = None
    ) -> None:
        self.conn, self.setting = conn, setting
        self.profile = profile
        """(engine pid, output file): record the window with py-spy (every thread, the
        samples that hold the GIL, raw collapsed stacks)."""
        self.samples: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None

    def start(self, start_at: float, stop_at: float) -> None:
        def sample() -> None:
            spy = None
            for at in (start_at, stop_at):
                time.sleep(max(0.0, at - time.time()))
                if spy is None and self.profile is not None:
                    spy = _py_spy(*self.profile, seconds=max(1, int(stop_at - start_at)))
                self.conn.send(self.setting)
                self.samples.append(self.conn.recv())
            if spy is not None:
                spy.wait(30)

        self._thread = threading.Thread(target=sample, name="window-sampler", daemon=True)
        self._thread.start()

    def result(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The (start, end) samples; waits for the end one."""
        assert self._thread is not None, "run_cell did not call the window callback"
        self._thread.join()
        return self.samples[0], self.samples[1]


def _py_spy(pid: int, path: str, seconds: int) -> subprocess.Popen[bytes] | None:
    """py-spy recording ``pid`` for ``seconds`` into ``path`` (None without py-spy)."""
    exe = os.environ.get("PYSPY") or shutil.which("py-spy")
    if exe is None:
        print("no py-spy: --profile-engine records nothing", flush=True)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
           "--gil", "--threads", "--nonblocking", "--format", "raw", "-o", path]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in SYSTEMS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a list of {', '.join(SYSTEMS)}")
    return names


def _key(system: str, n: int) -> str:
    """A summary row's key for ``system`` behind ``n`` front ends (the memory service's keep
    their names from before ``--systems``)."""
    return f"frontends_{n}" if system == "memory" else f"{system}_frontends_{n}"


def main() -> None:
    wall = time.perf_counter()
    load_start = os.getloadavg()[0]
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--frontends", type=_ints, default=(0, 2), help="settings, e.g. 0,2")
    ap.add_argument("--concurrency", type=_ints, default=(8, 32))
    ap.add_argument("--replay", type=_ints, default=(0, 2), help="R values, 0 = off")
    ap.add_argument("--systems", type=_systems, default=("memory",),
                    help="memory, and sasrec: the baseline served the same way")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement time per cell")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the cells")
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--events", type=int, default=300, help="mean events per user")
    ap.add_argument("--items", type=int, default=3706)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU: 1)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="spread each cell's clients over this many processes (a many-core "
                         "host: independent clients, no shared GIL)")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="section.field=value")
    ap.add_argument("--json", default="", help="output file")
    ap.add_argument("--profile-engine", default="", metavar="DIR",
                    help="record the engine process with py-spy (--gil --threads, raw) during "
                    "each cell's timed window, into DIR/pyspy_<cell>.txt (py-spy from $PYSPY "
                    "or PATH)")  # fmt: skip
    args = ap.parse_args()
    args.replay_cache = 0  # every request replays (no events arrive while the cells run)
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-frontends-") as spill:
        args.spill_dir = spill
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(args, child), daemon=True)
        proc.start()
        try:
            info = parent.recv()
            print(
                f"server on {info['device']} (pid {info['pid']}): ports {info['ports']}", flush=True
            )
            for r in range(args.rounds):
                for c in args.concurrency:
                    for replay in args.replay:
                        order = [(sy, n) for n in args.frontends for sy in args.systems]
                        if (r + c + replay) % 2:
                            order.reverse()
                        for system, n in order:
                            parent.send((system, n))
                            before = parent.recv()
                            profile = None
                            if args.profile_engine:
                                name = f"pyspy_{system}_f{n}_c{c}_R{replay}_r{r}.txt"
                                profile = (info["pid"], str(Path(args.profile_engine) / name))
                            sampler = WindowSampler(parent, (system, n), profile)
                            cell = run_cell(info["ports"][system][n], c, "cand100", replay,
                                            args.seconds, args.users, args.items, seed=c,
                                            procs=args.client_procs,
                                            window=sampler.start)  # fmt: skip
                            timed = sampler.result()
                            parent.send((system, n))
                            after = parent.recv()
                            batches = after["batches"] - before["batches"]
                            cell.update(
                                system=system,
                                frontends=n,
                                concurrency=c,
                                replay_notes=replay,
                                round=r,
                                mean_engine_batch=(after["requests"] - before["requests"])
                                / max(batches, 1),
                                engine_busy_share=(after["busy_s"] - before["busy_s"])
                                / args.seconds,
                                # the loop's share of the window collecting batches (waiting
                                # out the micro-batch window for more requests)
                                engine_collect_share=(after["collect_s"] - before["collect_s"])
                                / args.seconds,
                                **{
                                    f"{role}_cores_busy": (
                                        timed[1][f"{role}_cpu_s"] - timed[0][f"{role}_cpu_s"]
                                    )
                                    / args.seconds
                                    for role in ("engine_process", "engine_loop", "frontends")
                                },
                                load_avg_1m=os.getloadavg()[0],
                            )
                            cells.append(cell)
                            print(
                                f"round {r} {system:6s} frontends={n} c={c:2d} R={replay}: p50"
                                f" {cell['p50_ms']:6.2f} ms p99 {cell['p99_ms']:6.2f} ms"
                                f" {cell['throughput_rps']:7.1f} req/s engine batch"
                                f" {cell['mean_engine_batch']:.1f} (busy"
                                f" {cell['engine_busy_share']:.0%}, collecting"
                                f" {cell['engine_collect_share']:.0%}) load {cell['load_avg_1m']:.1f}"
                                f" cores busy: client {cell['client_cores_busy']:.2f} front"
                                f" ends {cell['frontends_cores_busy']:.2f} engine process"
                                f" {cell['engine_process_cores_busy']:.2f} (loop"
                                f" {cell['engine_loop_cores_busy']:.2f})",
                                flush=True,
                            )
            parent.send("stop")
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    summary = []
    for c in args.concurrency:
        for replay in args.replay:
            row: dict[str, Any] = {"concurrency": c, "replay_notes": replay}
            for system in args.systems:
                for n in args.frontends:
                    got = [x for x in cells if (x["system"], x["frontends"], x["concurrency"],
                           x["replay_notes"]) == (system, n, c, replay)]  # fmt: skip
                    row[_key(system, n)] = {
                        "throughput_rps": float(np.mean([x["throughput_rps"] for x in got])),
                        "p50_ms": float(np.mean([x["p50_ms"] for x in got])),
                        "p99_ms": float(np.mean([x["p99_ms"] for x in got])),
                        "mean_engine_batch": float(np.mean([x["mean_engine_batch"] for x in got])),
                        **{k: float(np.mean([x[k] for x in got])) for k in ROLE_FIGURES},
                    }
            if "sasrec" in args.systems and "memory" in args.systems:
                for n in args.frontends:
                    row[f"sasrec_over_memory_throughput_frontends_{n}"] = row[_key("sasrec", n)][
                        "throughput_rps"
                    ] / max(row[_key("memory", n)]["throughput_rps"], 1e-9)
            summary.append(row)
    gpu = info["device"].startswith("cuda")
    result = {
        "bench": "frontends",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/bench_frontends.py", *sys.argv[1:]]),
        "note": (
            "frontends 0 = the one-process server; N = the engine's server on a private unix "
            "socket behind N front-end processes sharing one port (server.frontends). Both "
            "serve the same engine in the same run, cells alternating. summary keys "
            "frontends_N are the memory service, sasrec_frontends_N the SASRec baseline "
            "(bench_rank.SASRecRanker, last 200 events re-encoded per request) served the "
            "same way, sasrec_over_memory_throughput_frontends_N their ratio. "
            + (
                ""
                if gpu
                else f"This machine has {os.cpu_count()} cores shared by the engine, the front "
                "ends and the client (and other work): it cannot show the gain of front ends "
                "on a many-core GPU host, where one process's per-call gRPC work is the limit."
            )
        ),
        "machine": {
            "host": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": load_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "device": info["device"],
            "device_name": info["device_name"],
            "torch_threads": info["torch_threads"],
        },
        "setup": {
            "users": args.users,
            "mean_events_per_user": args.events,
            "items": args.items,
            "candidates": 100,
            "k": 10,
            "seconds_per_cell": args.seconds,
            "rounds": args.rounds,
            "client": "one process, a thread per concurrent caller, one channel",
            "overrides": args.set,
            "ingest": info["ingest"],
            "systems": list(args.systems),
            "sasrec_window": SASREC_WINDOW if "sasrec" in args.systems else None,
        },
        "summary": summary,
        "cells": cells,
        "wall_seconds": time.perf_counter() - wall,
    }
    path = Path(
        args.json or ROOT / "bench" / "results" / f"frontends_{'gpu' if gpu else 'cpu'}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print()
    keys = [(system, n) for system in args.systems for n in args.frontends]
    print("| c | R | " + " | ".join(f"{system} frontends {n}: req/s, p50, p99 ms, engine batch"
                                    for system, n in keys) + " |")  # fmt: skip
    for row in summary:
        parts = [
            f"{row[_key(*k)]['throughput_rps']:.0f}, {row[_key(*k)]['p50_ms']:.1f},"
            f" {row[_key(*k)]['p99_ms']:.1f}, {row[_key(*k)]['mean_engine_batch']:.1f}"
            for k in keys
        ]
        ratios = [
            f"SASRec/memory at frontends {n}: {row[f'sasrec_over_memory_throughput_frontends_{n}']:.3f}"
            for n in args.frontends
            if f"sasrec_over_memory_throughput_frontends_{n}" in row
        ]
        print(f"| {row['concurrency']} | {row['replay_notes']} | " + " | ".join(parts) + " |"
              + ("  " + "; ".join(ratios) if ratios else ""))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
