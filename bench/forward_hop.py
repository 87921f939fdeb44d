"""Where a forwarded Rank's extra time goes (issue 13: a forwarded Rank adds at most 2 ms at
p99 over a direct one).

    .venv/bin/python bench/forward_hop.py [--calls 3000] [--cluster-calls 2000] [--json PATH]

1. The hop alone. An owner process and one forwarding process per variant, each the real
   server stack (``GrpcServer``: interceptors, health, reflection; ``RecMemServicer``;
   ``Router`` over an ``OwnerMap`` that names the owner for every partition; ``Forwarder``)
   over a backend that answers a fixed 10-item result at once, so the owner's rank costs
   nothing and what remains is gRPC and the forwarding code. One client calls the owner
   (direct) and every forwarder in turn, one call at a time, the order reversed every other
   round. Variants, all forwarders running side by side in the same run:

   - ``as_is``: the code as it is; it also times, inside the forwarder, the ``Rank`` handler
     and the forwarded call to the owner within it;
   - ``relay_bytes``: the owner's reply is relayed as its raw bytes (no parse in the
     forwarder, no serialisation of the reply), the request sent as bytes;
   - ``no_interceptors``: the forwarder's server without its interceptors (call arrivals,
     undecodable payloads), as a bound on what they cost.

   Also each process's CPU time per call (from /proc), the client's included.
2. With ``--cluster-calls`` > 0: three real ``recmem serve`` members on the embedded broker
   with all of ML-100K at the default state size (tests/cluster.py), direct against
   forwarded against RankClient as bench/scaleout.py measures it (its ``forwarding``).

Writes bench/results/forward_hop_cpu.json (or --json): machine, date, commit, command,
figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from benchinfo import cpu_seconds, git_commit, latency_percentiles, machine_facts  # noqa: E402

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc  # noqa: E402

VARIANTS = ("as_is", "relay_bytes", "no_interceptors")
N_ITEMS = 2000


# ---- the server processes -----------------------------------------------------------------


def serve(role: str, owner: str, ready_path: str, timings_path: str) -> None:
    """Run the owner (role ``owner``) or a forwarder of one variant until SIGTERM."""
    from recmem.config import Config
    from recmem.ranking import RankResult
    from recmem.routing import OwnerMap
    from recmem.server import app
    from recmem.server.app import GrpcServer, limits_from_config
    from recmem.server.guards import DecodeGuard
    from recmem.server.routing import Forwarder
    from recmem.server.servicer import RecMemServicer, Router
    from recmem.vocab import ItemVocab
    from streams.group import GroupView, Member

    class FixedAnswer:
        """The engine's place: a 10-item result at once."""

        def submit(self, query: Any, partition: int | None = None) -> Future[RankResult]:
            fut: Future[RankResult] = Future()
            fut.set_result(
                RankResult(np.arange(10), np.linspace(1, 0, 10, dtype=np.float32), 5, False, 0, 0)
            )
            return fut

        def inspect(
            self, user_id: str, timeout: float | None = 30.0, partition: Any = None
        ) -> None:
            return None

    timings: dict[str, list[float]] = {"handler": [], "forwarded_call": []}
    if role == "as_is":
        call, rank = Forwarder.call, RecMemServicer.Rank

        def timed_call(self: Forwarder, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return call(self, *args, **kwargs)
            finally:
                timings["forwarded_call"].append(time.perf_counter() - t)

        def timed_rank(self: RecMemServicer, request: Any, context: Any) -> Any:
            t = time.perf_counter()
            try:
                return rank(self, request, context)
            finally:
                timings["handler"].append(time.perf_counter() - t)

        Forwarder.call = timed_call  # type: ignore[method-assign]
        RecMemServicer.Rank = timed_rank  # type: ignore[method-assign]
    elif role == "relay_bytes":
        guard = DecodeGuard.intercept_service
        methods: dict[str, Any] = {}

        def relaying(self: DecodeGuard, continuation: Any, details: Any) -> Any:
            handler = guard(self, continuation, details)
            if handler is None or handler.response_serializer is None:
                return handler
            serialize = handler.response_serializer
            return handler._replace(
                response_serializer=lambda r: r if isinstance(r, bytes) else serialize(r)
            )

        def relay_call(
            self: Forwarder, method: str, address: str, request: Any, timeout: Any
        ) -> Any:
            multi = methods.get(address + method)
            if multi is None:
                channel = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
                multi = methods[address + method] = channel.unary_unary(
                    f"/recmem.v1.RecMem/{method}"
                )
            return multi(request.SerializeToString(), timeout=timeout, metadata=self._metadata)

        DecodeGuard.intercept_service = relaying  # type: ignore[method-assign]
        Forwarder.call = relay_call  # type: ignore[method-assign]
    elif role == "no_interceptors":
        server = grpc.server

        def bare(pool: Any, interceptors: Any = None, options: Any = None) -> Any:
            return server(pool, options=options)

        app.grpc.server = bare  # type: ignore[assignment]

    cfg = Config()
    cfg.server.host = "127.0.0.1"
    cfg.server.port = 0
    cfg.server.freeze_gc = False
    vocab = ItemVocab([f"item{i}" for i in range(N_ITEMS)], 8)
    owners = OwnerMap("")
    router = None if role == "owner" else Router(owners, None)
    servicer = RecMemServicer(FixedAnswer(), vocab, limits_from_config(cfg), "v1", router=router)
    srv = GrpcServer(cfg, servicer).start()
    forwarder = None
    if router is not None:
        owners.me = srv.address
        owners.update(GroupView(1, 6, {p: Member(owner, "v1") for p in range(6)}))
        forwarder = router.forwarder = Forwarder(srv.address)

    def stop(signum: int, frame: Any) -> None:
        Path(timings_path).write_text(json.dumps(timings))
        if forwarder is not None:
            forwarder.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    Path(ready_path + ".tmp").write_text(str(srv.port))
    os.rename(ready_path + ".tmp", ready_path)
    srv.wait()


def hop_alone(calls: int, tmp: Path) -> dict[str, Any]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}

    def start(role: str, owner: str = "") -> None:
        ready = tmp / f"{role}.port"
        cmd = [sys.executable, __file__, "--serve", role, "--owner", owner]
        cmd += ["--ready", str(ready), "--timings", str(tmp / f"{role}.json")]
        procs[role] = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        while not ready.exists():
            if procs[role].poll() is not None:
                raise RuntimeError(f"{role} server exited")
            time.sleep(0.05)
        ports[role] = int(ready.read_text())

    names = ["owner", *VARIANTS]
    try:
        start("owner")
        for v in VARIANTS:
            start(v, f"127.0.0.1:{ports['owner']}")
        options = [("grpc.enable_retries", 0)]
        channels = [grpc.insecure_channel(f"127.0.0.1:{ports[n]}", options=options) for n in names]
        stubs = [rank_pb2_grpc.RecMemStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
        request = rank_pb2.RankRequest(user_id="u1", k=10, request_ts_ms=1)
        answers = [stub.Rank(request, timeout=10) for stub in stubs]
        if any(a != answers[0] for a in answers):
            raise AssertionError("a forwarder's answer differs from the owner's")
        for _ in range(200):  # warm every channel and path
            for stub in stubs:
                stub.Rank(request, timeout=10)
        times: list[list[float]] = [[] for _ in names]
        cpu0 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
        client0 = time.process_time()
        for k in range(calls):
            order = list(range(len(names)))
            if k % 2:
                order.reverse()
            for i in order:
                t = time.perf_counter()
                stubs[i].Rank(request, timeout=10)
                times[i].append(time.perf_counter() - t)
        client_cpu = time.process_time() - client0
        cpu = {n: cpu_seconds(p.pid) - cpu0[n] for n, p in procs.items()}
        for ch in channels:
            ch.close()
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(10)
    inner = json.loads((tmp / "as_is.json").read_text())
    direct = latency_percentiles(times[0])
    out: dict[str, Any] = {"direct": direct}
    for i, v in enumerate(VARIANTS, start=1):
        f = latency_percentiles(times[i])
        out[v] = {
            "forwarded": f,
            "forwarded_minus_direct": {
                q: round(f[q] - direct[q], 3) for q in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")
            },
        }
    out["as_is"]["inside_the_forwarder"] = {
        "rank_handler": latency_percentiles(inner["handler"][201:]),
        "forwarded_call_to_the_owner": latency_percentiles(inner["forwarded_call"][201:]),
    }
    # the owner serves 1 + len(VARIANTS) calls per round
    out["cpu_ms_per_call"] = {
        "owner (per call served)": round(cpu["owner"] / calls / len(names) * 1000, 3),
        **{f"forwarder {v}": round(cpu[v] / calls * 1000, 3) for v in VARIANTS},
        "client (per call)": round(client_cpu / calls / len(names) * 1000, 3),
    }
    return out


def on_cluster(calls: int, tmp: Path) -> dict[str, Any]:
    from scaleout import forwarding

    from streams.broker import EmbeddedBroker
    from tests.cluster import Cluster, caught_up, ml100k_setup, scaleout_config
    from tests.kafka_env import kafka_settings

    logging.getLogger("kafka").setLevel(logging.ERROR)
    partitions = 6
    with EmbeddedBroker() as broker:
        kafka = kafka_settings(broker.bootstrap, partitions)
        cfg = scaleout_config(tmp, kafka, dims="default")
        cfg.kafka.group_id = "recmem-bench-forward"
        cfg.kafka.heartbeat_interval_ms = 100
        work = ml100k_setup(cfg)
        cluster = Cluster(cfg, tmp / "cluster", 3)
        try:
            cluster.start_all()
            cluster.wait(
                lambda: cluster.settled(3) and caught_up(cfg, work.ends),
                600,
                "every member settled, every event checkpointed",
            )
            result: dict[str, Any] = forwarding(cluster, sorted(work.counts), partitions, calls)
        finally:
            cluster.close()
    result["setup"] = "3 recmem serve members, 6 partitions, all of ML-100K, default state size"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="rounds of the hop alone")
    parser.add_argument("--cluster-calls", type=int, default=2000, help="0: skip the cluster")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "forward_hop_cpu.json"))
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--owner", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--timings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.owner, args.ready, args.timings)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    began = time.monotonic()
    machine = machine_facts()
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        hop = hop_alone(args.calls, Path(tmp))
        logging.info("hop alone: %s", json.dumps(hop))
        cluster = on_cluster(args.cluster_calls, Path(tmp)) if args.cluster_calls else None
    result = {
        "benchmark": "forward_hop",
        "machine": machine,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join([".venv/bin/python", "bench/forward_hop.py", *sys.argv[1:]]),
        "request": "k=10, whole catalog, no replay; one call at a time",
        "hop_alone": hop,
        "cluster": cluster,
        "goal": "forwarded p99 - direct p99 <= 2 ms",
        "wall_s": round(time.monotonic() - began, 1),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"hop_alone": hop, "cluster": cluster}, indent=2))


if __name__ == "__main__":
    main()
