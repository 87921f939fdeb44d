"""The Python gRPC front end alone: sync (thread pool) against ``grpc.aio`` server.

    .venv/bin/python bench/bench_grpc_frontend.py [--seconds 3] [--engine-ms 1] [--out FILE]

Both servers serve ``RecMem.Rank`` through the service's real engine loop (``EngineLoop``,
adaptive 4 ms window) with a stand-in rank step that sleeps ``--engine-ms`` per micro-batch and
answers empty responses: what the front end costs without any model work. A client process
runs closed-loop load (one channel, one thread per client) at concurrency 1 and 8 for each
server, twice, alternating. Writes FILE (default bench/results/grpc_frontend_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from benchinfo import git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def serve(kind: str, engine_ms: float, conn: Any) -> None:
    """Child process: one server of ``kind`` ("sync" | "aio") until told to stop."""
    from concurrent import futures

    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
    from recmem.engine import EngineLoop

    class StandIn:
        """A stand-in rank step of ``engine_ms`` behind the real engine loop."""

        n_items = 1

        def rank(self, items: list[Any]) -> list[Any]:
            time.sleep(engine_ms / 1000.0)
            return [rank_pb2.RankResponse(model_version="frontend") for _ in items]

    batcher = EngineLoop(StandIn(), window_ms=4.0, max_batch=64, adaptive=True).start()  # type: ignore[arg-type]
    if kind == "sync":

        class Sync(rank_pb2_grpc.RecMemServicer):
            def Rank(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
                return batcher.submit(request).result()

        server = grpc.server(futures.ThreadPoolExecutor(64))
        rank_pb2_grpc.add_RecMemServicer_to_server(Sync(), server)  # type: ignore[no-untyped-call]
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        conn.recv()
        server.stop(0)
        return

    async def main() -> None:
        class Aio(rank_pb2_grpc.RecMemServicer):
            async def Rank(self, request: Any, context: Any) -> Any:  # type: ignore[override]  # noqa: N802
                return await asyncio.wrap_future(batcher.submit(request))

        server = grpc.aio.server()
        rank_pb2_grpc.add_RecMemServicer_to_server(Aio(), server)  # type: ignore[no-untyped-call]
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    asyncio.run(main())


def load(port: int, concurrency: int, seconds: float) -> dict[str, float]:
    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc

    lat: list[float] = []
    request = rank_pb2.RankRequest(
        user_id="u1", k=10, candidate_item_ids=[f"item{i}" for i in range(100)]
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rank_pb2_grpc.RecMemStub(channel)
        for _ in range(5):
            stub.Rank(request, timeout=30)
        stop = time.perf_counter() + seconds

        def client() -> None:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                stub.Rank(request, timeout=30)
                lat.append(time.perf_counter() - t)

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ms = np.array(lat) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "throughput_rps": len(ms) / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--engine-ms", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpc_frontend_cpu.json"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for rnd in (1, 2):
        for kind in ("sync", "aio"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(kind, args.engine_ms, child), daemon=True)
            proc.start()
            port = parent.recv()
            for c in (1, 8):
                row = {"round": rnd, "server": kind, "concurrency": c,
                       **load(port, c, args.seconds)}  # fmt: skip
                rows.append(row)
                print(f"{kind:4s} c={c}: p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms "
                      f"{row['throughput_rps']:.0f} req/s", flush=True)  # fmt: skip
            parent.send("stop")
            proc.join(30)
    out = {
        "bench": "grpc_frontend",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/bench_grpc_frontend.py", *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "engine_ms_per_batch": args.engine_ms,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
