"""CPU per Rank call of one front-end process (``server.frontends``), threads against aio
(``server.frontend_mode``), in front of an engine that answers at once.

    .venv/bin/python bench/bench_frontend_cpu.py [--modes threads,aio[,bare-threads,bare-aio]]
        [--concurrency 64] [--seconds 5] [--rounds 3] [--engine-ms 0] [--json PATH]

What the front end itself costs, without any model work: a stand-in engine process serves
the private unix socket with the real ``GrpcServer`` (health SERVING, so the front ends
mirror it) and a servicer whose ``RankBatch`` answers every request at once with a fixed
10-item response (``--engine-ms``: after sleeping that long per RankBatch, a stand-in
engine step, so batches grow as they do in front of a real engine). One front-end process per mode (``FrontEnds`` with ``server.frontends =
1``: the real process, started as ``recmem serve`` starts it) sits in front of it. A client
process (grpc.aio, closed loop, ``--concurrency`` callers on one channel, 100 candidates,
k = 10) loads one front end at a time for ``--seconds``, the modes alternating over
``--rounds``. Per cell: req/s, p50/p99, and the CPU time (user + system, /proc) of the
front-end process, the engine stand-in and the client over the measured window, divided
by the calls answered in it: the front end's per-call CPU is the figure that says how
many calls a core can answer. On a 2-core machine the three processes share the cores,
so req/s is bounded by their sum; the per-call CPU is not.

The modes ``bare-threads`` and ``bare-aio`` are the floor: a process with a bare
``grpc.server`` (64 threads) or ``grpc.aio.server`` whose Rank answers the same fixed
response at once (no interceptors, health, batching, engine channel or metrics): what
Python gRPC itself costs per call, so the rest of a front end's per-call CPU is its own.

Writes PATH (default bench/results/frontend_cpu.json): machine, date, commit, command,
cells and per-mode means.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from benchinfo import cpu_seconds, git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("threads", "aio")
BARE = ("bare-threads", "bare-aio")


def engine_stand_in(addresses: list[str], engine_ms: float, conn: Any) -> None:
    """Child process: the real private ``GrpcServer`` on each of ``addresses``, whose
    RankBatch answers each request with a fixed response, after sleeping ``engine_ms``
    (0: at once). On "counts" it sends [RankBatch calls, requests] per address."""
    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
    from recmem.config import Config
    from recmem.server.app import GrpcServer

    response = rank_pb2.RankResponse(
        items=[rank_pb2.ScoredItem(item_id=f"item{i}", score=1.0 - i / 10) for i in range(10)],
        model_version="stand-in",
        position=100,
    )

    class Instant(rank_pb2_grpc.RecMemServicer):
        def __init__(self) -> None:
            self.counts = [0, 0]

        def RankBatch(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
            n = len(request.requests)
            if engine_ms > 0:
                time.sleep(engine_ms / 1000.0)
            self.counts[0] += 1
            self.counts[1] += n
            result = rank_pb2.RankBatchResult(code=0, response=response)
            return rank_pb2.RankBatchResponse(results=[result] * n)

    cfg = Config()
    servicers = [Instant() for _ in addresses]
    servers = [GrpcServer(cfg, s, private=a).start() for s, a in zip(servicers, addresses)]
    conn.send(os.getpid())
    while conn.recv() == "counts":
        conn.send([list(s.counts) for s in servicers])
    for srv in servers:
        srv.stop(0.5)


def bare_server(mode: str, conn: Any) -> None:
    """Child process: a bare sync or aio gRPC server whose Rank answers a fixed 10-item
    response at once; sends its (pid, port), serves until told to stop."""
    import asyncio
    from concurrent import futures

    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc

    response = rank_pb2.RankResponse(
        items=[rank_pb2.ScoredItem(item_id=f"item{i}", score=1.0 - i / 10) for i in range(10)],
        model_version="stand-in",
        position=100,
    )
    if mode == "bare-threads":

        class Sync(rank_pb2_grpc.RecMemServicer):
            def Rank(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
                return response

        server = grpc.server(futures.ThreadPoolExecutor(64))
        rank_pb2_grpc.add_RecMemServicer_to_server(Sync(), server)  # type: ignore[no-untyped-call]
        conn.send((os.getpid(), server.add_insecure_port("127.0.0.1:0")))
        server.start()
        conn.recv()
        server.stop(0)
        return

    async def main() -> None:
        class Aio(rank_pb2_grpc.RecMemServicer):
            async def Rank(self, request: Any, context: Any) -> Any:  # type: ignore[override]  # noqa: N802
                return response

        server = grpc.aio.server()
        rank_pb2_grpc.add_RecMemServicer_to_server(Aio(), server)  # type: ignore[no-untyped-call]
        conn.send((os.getpid(), server.add_insecure_port("127.0.0.1:0")))
        await server.start()
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    asyncio.run(main())


def client(port: int, concurrency: int, seconds: float, conn: Any) -> None:
    """Child process: warm up, tell the parent ``go``, load for ``seconds``, tell it
    ``done`` with the latencies of the calls that finished inside the window."""
    import asyncio

    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc

    request = rank_pb2.RankRequest(
        user_id="u1", k=10, candidate_item_ids=[f"item{i}" for i in range(100)]
    )

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]
            window = [0.0, float("inf")]
            lat: list[float] = []

            async def caller() -> None:
                while True:
                    t = time.perf_counter()
                    if t >= window[1]:
                        return
                    await stub.Rank(request, timeout=30)
                    done = time.perf_counter()
                    if window[0] <= done <= window[1]:
                        lat.append(done - t)

            callers = [asyncio.ensure_future(caller()) for _ in range(concurrency)]
            await asyncio.sleep(1.0)  # warm-up
            window[0] = time.perf_counter()
            window[1] = window[0] + seconds
            conn.send("go")
            await asyncio.sleep(seconds)
            conn.send("done")
            await asyncio.gather(*callers)
            return lat

    conn.send(asyncio.run(run()))


def main() -> None:
    from recmem.config import Config
    from recmem.server.frontends import FrontEnds

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--engine-ms", type=float, default=0.0,
                    help="the stand-in engine's time per RankBatch (0: answers at once)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "frontend_cpu.json"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    load_start = os.getloadavg()[0]
    fronts: dict[str, FrontEnds] = {}
    for mode in modes:
        if mode in BARE:
            continue
        cfg = Config()
        cfg.server.port = 0
        cfg.server.frontends = 1
        cfg.server.frontend_mode = mode
        fronts[mode] = FrontEnds(cfg)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    engine = ctx.Process(
        target=engine_stand_in,
        args=([f.engine_address for f in fronts.values()], args.engine_ms, child),
    )
    engine.start()
    engine_pid = parent.recv()
    cells: list[dict[str, Any]] = []
    bare: dict[str, tuple[Any, Any, int, int]] = {}  # mode: process, pipe, pid, port
    try:
        for f in fronts.values():
            f.start()
        for mode in modes:
            if mode in BARE:
                bparent, bchild = ctx.Pipe()
                bproc = ctx.Process(target=bare_server, args=(mode, bchild))
                bproc.start()
                bare[mode] = (bproc, bparent, *bparent.recv())
        time.sleep(1.0)  # health mirrored
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                if mode in BARE:
                    pid, port = bare[mode][2], bare[mode][3]
                else:
                    pid, port = fronts[mode].pids[0], fronts[mode].port
                slot = list(fronts).index(mode) if mode in fronts else None
                cparent, cchild = ctx.Pipe()
                proc = ctx.Process(
                    target=client, args=(port, args.concurrency, args.seconds, cchild)
                )
                proc.start()
                assert cparent.recv() == "go"
                before = [cpu_seconds(p) for p in (pid, engine_pid, proc.pid)]
                parent.send("counts")
                batches_before = parent.recv()
                assert cparent.recv() == "done"
                after = [cpu_seconds(p) for p in (pid, engine_pid, proc.pid)]
                parent.send("counts")
                batches_after = parent.recv()
                lat = np.array(cparent.recv()) * 1e3
                proc.join(30)
                n = len(lat)
                used = [a - b for a, b in zip(after, before)]
                cell = {
                    "round": r,
                    "mode": mode,
                    "concurrency": args.concurrency,
                    "calls": n,
                    "throughput_rps": n / args.seconds,
                    "p50_ms": float(np.percentile(lat, 50)),
                    "p99_ms": float(np.percentile(lat, 99)),
                    "frontend_cpu_s": used[0],
                    "frontend_cpu_us_per_call": used[0] / max(n, 1) * 1e6,
                    "frontend_cpu_share": used[0] / args.seconds,
                    "engine_stand_in_cpu_us_per_call": used[1] / max(n, 1) * 1e6,
                    "client_cpu_us_per_call": used[2] / max(n, 1) * 1e6,
                    "load_avg_1m": os.getloadavg()[0],
                }
                if slot is not None:
                    b = [x - y for x, y in zip(batches_after[slot], batches_before[slot])]
                    cell["rank_batch_calls"] = b[0]
                    cell["mean_rank_batch"] = b[1] / max(b[0], 1)
                cells.append(cell)
                print(
                    f"round {r} {mode:7s}: {cell['throughput_rps']:7.0f} req/s, p50"
                    f" {cell['p50_ms']:.2f} ms p99 {cell['p99_ms']:.2f} ms; front end"
                    f" {cell['frontend_cpu_us_per_call']:.0f} us/call"
                    f" ({cell['frontend_cpu_share']:.2f} cores), engine stand-in"
                    f" {cell['engine_stand_in_cpu_us_per_call']:.0f}, client"
                    f" {cell['client_cpu_us_per_call']:.0f} us/call; RankBatch of"
                    f" {cell.get('mean_rank_batch', 0):.1f}",
                    flush=True,
                )
    finally:
        for bproc, bparent, _, _ in bare.values():
            bparent.send("stop")
            bproc.join(30)
        for f in fronts.values():
            f.stop(1.0)
        parent.send("stop")
        engine.join(30)
    keys = ("throughput_rps", "p50_ms", "p99_ms", "frontend_cpu_us_per_call",
            "frontend_cpu_share", "engine_stand_in_cpu_us_per_call", "client_cpu_us_per_call")  # fmt: skip
    means = {
        mode: {k: float(np.mean([c[k] for c in cells if c["mode"] == mode])) for k in keys}
        for mode in modes
    }
    result = {
        "bench": "frontend_cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/bench_frontend_cpu.py", *sys.argv[1:]]),
        "machine": {
            "host": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": load_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
        "setup": {
            "concurrency": args.concurrency,
            "seconds_per_cell": args.seconds,
            "rounds": args.rounds,
            "client": "one process, grpc.aio, closed loop, one channel; 100 candidates, k = 10",
            "engine": "a stand-in GrpcServer on the private unix socket: RankBatch answered "
            "with a fixed 10-item response per request after engine_ms_per_batch",
            "engine_ms_per_batch": args.engine_ms,
            "frontend": "one front-end process (FrontEnds, server.frontends = 1) per mode, "
            "server defaults otherwise; bare-threads / bare-aio: a bare grpc.server (64 "
            "threads) / grpc.aio.server answering a fixed response, the Python gRPC floor "
            "(engine_stand_in figures are idle there)",
        },
        "means": means,
        "cells": cells,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    for mode, m in means.items():
        print(
            f"{mode:7s}: {m['throughput_rps']:.0f} req/s, front end"
            f" {m['frontend_cpu_us_per_call']:.0f} us/call, p99 {m['p99_ms']:.2f} ms"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
