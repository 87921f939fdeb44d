"""Consume rates on the embedded broker: the raw kafka-python client against EventConsumer
(group member, decode, validate, batch hand-over) feeding a sink that does nothing.

The gap between the two is what the streams layer costs; the engine's end-to-end rate is
measured against the same raw figure (issue 4: end-to-end >= 50% of the raw client rate).

    .venv/bin/python bench/bench_consume.py [--events 200000] [--partitions 4]

writes bench/results/consume_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kafka import KafkaConsumer, TopicPartition  # noqa: E402

from recmem.config import KafkaConfig  # noqa: E402
from streams.admin import ensure_topics  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.codec import make_event  # noqa: E402
from streams.consumer import EventConsumer  # noqa: E402
from streams.producer import EventProducer  # noqa: E402
from streams.validate import ValidEvent  # noqa: E402


class NullSink:
    """Counts events and keeps offsets; no state."""

    def __init__(self) -> None:
        self.events = 0
        self.offsets: dict[int, int] = {}

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        return {p: 0 for p in partitions}

    def on_revoked(self, partitions: list[int]) -> None:
        pass

    def apply_batch(self, events: list[ValidEvent], next_offsets: dict[int, int]) -> None:
        self.events += len(events)
        self.offsets.update(next_offsets)

    def checkpoint_due(self) -> bool:
        return False

    def checkpoint(self) -> dict[int, int]:
        return dict(self.offsets)


def raw_rate(cfg: KafkaConfig, n: int) -> float:
    consumer = KafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        auto_offset_reset="earliest",
        max_poll_records=cfg.max_poll_records,
    )
    consumer.assign([TopicPartition(cfg.topic, p) for p in range(cfg.partitions)])
    seen = 0
    start = time.perf_counter()
    while seen < n:
        for records in consumer.poll(timeout_ms=500).values():
            seen += len(records)
    elapsed = time.perf_counter() - start
    consumer.close()
    return seen / elapsed


def streams_rate(cfg: KafkaConfig, n: int) -> tuple[float, float]:
    """(events/s from the first batch to the last, seconds to join the group)."""
    sink = NullSink()
    consumer = EventConsumer(cfg, sink)
    thread = threading.Thread(target=consumer.run, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    while sink.events == 0:
        time.sleep(0.001)
    first = time.perf_counter()
    first_count = sink.events
    while sink.events < n:
        time.sleep(0.005)
    elapsed = time.perf_counter() - first
    consumer.stop()
    thread.join(timeout=30)
    return (n - first_count) / elapsed, first - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--users", type=int, default=2000)
    args = ap.parse_args()
    with EmbeddedBroker() as broker:
        cfg = KafkaConfig(
            bootstrap_servers=broker.bootstrap,
            topic="bench",
            dead_letter_topic="bench.dlq",
            group_id="bench",
            partitions=args.partitions,
            session_timeout_ms=3000,
            heartbeat_interval_ms=500,
            max_past_ms=0,
            max_future_ms=0,
            metrics_port=0,
        )
        ensure_topics(cfg, {cfg.topic: args.partitions, cfg.dead_letter_topic: 1})
        ts0 = 1_700_000_000_000
        events = (
            make_event(f"user-{i % args.users}", f"item-{(i * 7919) % 5000}", ts0 + i, i % 6, 1.0)
            for i in range(args.events)
        )
        t = time.perf_counter()
        with EventProducer(cfg) as producer:
            producer.send(events, total=args.events, progress=False)
        produce = args.events / (time.perf_counter() - t)
        raw = raw_rate(cfg, args.events)
        ours, join_s = streams_rate(cfg, args.events)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
        "benchmark": "consume",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "events": args.events,
        "partitions": args.partitions,
        "produce_events_per_s": round(produce),
        "raw_kafka_python_events_per_s": round(raw),
        "event_consumer_null_sink_events_per_s": round(ours),
        "event_consumer_vs_raw": round(ours / raw, 3),
        "group_join_s": round(join_s, 2),
    }
    out = Path(__file__).resolve().parent / "results" / f"consume_{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
