"""What the embedded broker (tansu) serves to many raw consumers at once: the ceiling that
bench/host_members.py's serve members ingest under (issue 14's ingest goal: 500,000 ev/s
from the broker to applied state on one host).

    .venv/bin/python bench/broker_fanout.py [--events 1000000] [--partitions 16]
        [--procs 1,4,8,12,16] [--clients confluent,kafka-python] [--json PATH]

The first ``--events`` events of the benchmark workload are produced once into a topic of
``--partitions`` partitions (bench_ingest.produce, each partition's highwater checked). Then,
for each client and each K of ``--procs``, K processes (spawned) each take the partitions
p with p mod K = i (assigned, no group: nothing to join), connect, wait for the others, and
read their partitions to their highwater from the start, counting records with a value
(nothing decoded: a raw client, as bench/bench_consume.py's raw passes). Figures: records/s
from the first record any process got to the last record, and per process its own rate and
CPU seconds. Rounds alternate the clients. A K whose rate grows with K is not broker-bound
at that K; one that stays flat is the broker's (or the host's) ceiling.

Writes JSON (machine, date, commit, command, figures): --json, or
bench/results/broker_fanout_<device>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchinfo import cpu_seconds, git_commit, machine, write_result  # noqa: E402

CLIENTS = ("confluent", "kafka-python")


def _reader(
    client: str, kafka: Any, parts: list[int], ends: dict[int, int], go: Any, out: Any
) -> None:
    """One process: read ``parts`` from the start to ``ends`` once ``go`` is set."""
    want = sum(ends[p] for p in parts)
    if client == "confluent":
        from confluent_kafka import OFFSET_BEGINNING, Consumer
        from confluent_kafka import TopicPartition as CTP

        from streams.admin import librdkafka_settings

        c = Consumer(
            {**librdkafka_settings(kafka), "group.id": "fanout", "enable.auto.commit": False}
        )
        go.wait()
        c.assign([CTP(kafka.topic, p, OFFSET_BEGINNING) for p in parts])

        def poll() -> int:
            return sum(
                1
                for m in c.consume(kafka.max_poll_records, 0.01)
                if m.error() is None and m.value() is not None
            )
    else:
        from kafka import KafkaConsumer, TopicPartition

        from streams.admin import client_settings

        k = KafkaConsumer(
            auto_offset_reset="earliest",
            max_poll_records=kafka.max_poll_records,
            **client_settings(kafka),
        )
        go.wait()
        k.assign([TopicPartition(kafka.topic, p) for p in parts])

        def poll() -> int:
            got = k.poll(timeout_ms=50)
            return sum(1 for recs in got.values() for r in recs if r.value is not None)

    cpu0 = cpu_seconds("self")
    seen, first, deadline = 0, 0.0, time.monotonic() + 300
    while seen < want and time.monotonic() < deadline:
        n = poll()
        if n and not first:
            first = time.time()
        seen += n
    last = time.time()
    out.put({"parts": parts, "records": seen, "want": want, "first": first, "last": last,
             "cpu_s": round(cpu_seconds("self") - cpu0, 2)})  # fmt: skip


def fanout(client: str, kafka: Any, k: int, ends: dict[int, int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = []
    for i in range(k):
        parts = [p for p in sorted(ends) if p % k == i]
        if parts:
            procs.append(ctx.Process(target=_reader, args=(client, kafka, parts, ends, go, out)))
    for p in procs:
        p.start()
    time.sleep(2.0 + 0.2 * k)  # spawned, imported, connected
    go.set()
    got = [out.get(timeout=330) for _ in procs]
    for p in procs:
        p.join(30)
    total = sum(g["records"] for g in got)
    first = min(g["first"] for g in got if g["first"])
    last = max(g["last"] for g in got)
    return {
        "client": client,
        "procs": len(procs),
        "records": total,
        "complete": all(g["records"] >= g["want"] for g in got),
        "records_per_s": round(total / max(last - first, 1e-9)),
        "seconds": round(last - first, 2),
        "per_proc_records_per_s": [
            round(g["records"] / max(g["last"] - g["first"], 1e-9)) for g in got
        ],
        "cpu_s_per_100k_records": round(100_000 * sum(g["cpu_s"] for g in got) / max(total, 1), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--produce-procs", type=int, default=8)
    ap.add_argument("--procs", default="1,4,8,12,16", help="comma-separated reader counts")
    ap.add_argument("--clients", default="confluent,kafka-python")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from bench_ingest import produce

    from recmem.config import load_config
    from recmem.producing import open_stream
    from streams.admin import end_offsets, ensure_topics
    from streams.broker import EmbeddedBroker

    ks = [int(x) for x in args.procs.split(",") if x]
    clients = [c for c in args.clients.split(",") if c]
    if any(c not in CLIENTS for c in clients):
        ap.error(f"--clients: each one of {', '.join(CLIENTS)}")
    cfg = load_config(None, args.set, environ={})
    stream = open_stream("workload", cfg)
    n = min(args.events, stream.n_events)
    dev = "cuda" if shutil.which("nvidia-smi") else "cpu"
    path = (
        Path(args.json) if args.json else ROOT / "bench" / "results" / f"broker_fanout_{dev}.json"
    )
    result: dict[str, Any] = {
        "benchmark": "broker_fanout",
        "machine": machine(),
        "commit": git_commit(),
        "command": " ".join(["python", "bench/broker_fanout.py", *sys.argv[1:]]),
        "events": n,
        "partitions": args.partitions,
        "cells": [],
    }
    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    try:
        with EmbeddedBroker(log_path=work / "broker.log", bin_dir=cfg.kafka.broker_bin_dir) as b:
            k = cfg.kafka
            k.bootstrap_servers = b.bootstrap
            k.topic, k.dead_letter_topic = "fanout", "fanout.dlq"
            k.partitions = args.partitions
            ensure_topics(k, {k.topic: k.partitions, k.dead_letter_topic: 1})
            result["produce"] = produce("workload", args.set, stream, n, k, args.produce_procs)
            print(f"produced {n}: {result['produce']['events_per_s']} ev/s", flush=True)
            ends = end_offsets(k, k.topic, timeout_s=60)
            for r in range(args.rounds):
                for client in clients if r % 2 == 0 else clients[::-1]:
                    for kk in ks:
                        cell = fanout(client, k, kk, ends)
                        cell["round"] = r
                        result["cells"].append(cell)
                        print(f"{client} x{kk}: {cell['records_per_s']} rec/s "
                              f"({cell['cpu_s_per_100k_records']} CPU-s per 100k)", flush=True)  # fmt: skip
                        result["date"] = datetime.now(UTC).isoformat(timespec="seconds")
                        result["load_average_1_5_15m"] = [round(x, 2) for x in os.getloadavg()]
                        write_result(path, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
