"""Consume rates on the embedded broker, both Kafka clients in one run: each raw client
(kafka-python's KafkaConsumer, librdkafka's confluent_kafka.Consumer; assigned every
partition, no group, records counted and their values taken, nothing decoded, timed from
the first record) against the
recmem consumer built on it (``kafka.client`` = kafka-python: EventConsumer, = confluent:
ConfluentEventConsumer; group member, decode, validate, batch hand-over) feeding a sink that
does nothing.

The gap between a raw client and its consumer is what the streams layer costs; the engine's
end-to-end rate is measured against the raw kafka-python figure (issue 4: end-to-end >= 50%
of the raw client rate). ``--rounds N`` repeats the four measurements N times in turn
(the machine's other load moves every figure; the JSON keeps each round and the medians).

    .venv/bin/python bench/bench_consume.py [--events 200000] [--partitions 4] [--rounds 3]

writes bench/results/consume_<machine>.json (``--out`` to choose).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import confluent_kafka  # noqa: E402
import kafka  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402
from confluent_kafka import OFFSET_BEGINNING, Consumer  # noqa: E402
from confluent_kafka import TopicPartition as ConfluentPartition  # noqa: E402
from kafka import KafkaConsumer, TopicPartition  # noqa: E402

from recmem.config import KafkaConfig  # noqa: E402
from streams.admin import client_settings, ensure_topics, librdkafka_settings  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.clients import make_consumer  # noqa: E402
from streams.codec import make_event  # noqa: E402
from streams.producer import EventProducer  # noqa: E402
from streams.validate import ValidEvent  # noqa: E402

CLIENTS = ("kafka-python", "confluent")


class NullSink:
    """Counts events and keeps offsets; no state."""

    def __init__(self) -> None:
        self.events = 0
        self.offsets: dict[int, int] = {}

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        return {p: 0 for p in partitions}

    def on_revoked(self, partitions: list[int]) -> None:
        pass

    def apply_batch(
        self, events: list[ValidEvent], next_offsets: dict[int, int], source: object = None
    ) -> None:
        self.events += len(events)
        self.offsets.update(next_offsets)

    def checkpoint_due(self) -> bool:
        return False

    def checkpoint(self) -> dict[int, int]:
        return dict(self.offsets)


def raw_kafka_python(cfg: KafkaConfig, n: int) -> float:
    consumer = KafkaConsumer(
        auto_offset_reset="earliest", max_poll_records=cfg.max_poll_records, **client_settings(cfg)
    )
    consumer.assign([TopicPartition(cfg.topic, p) for p in range(cfg.partitions)])
    seen, start = 0, 0.0
    while seen < n:
        for records in consumer.poll(timeout_ms=50).values():
            start = start or time.perf_counter()
            seen += sum(1 for r in records if r.value is not None)
    elapsed = time.perf_counter() - start
    consumer.close()
    return seen / elapsed


def raw_confluent(cfg: KafkaConfig, n: int) -> float:
    consumer = Consumer(
        {**librdkafka_settings(cfg), "group.id": "bench-raw", "enable.auto.commit": False}
    )
    consumer.assign(
        [ConfluentPartition(cfg.topic, p, OFFSET_BEGINNING) for p in range(cfg.partitions)]
    )
    seen, start = 0, 0.0
    while seen < n:
        # a short timeout: consume() waits for a full batch or the timeout, also at the end
        for m in consumer.consume(cfg.max_poll_records, 0.01):
            start = start or time.perf_counter()
            if m.error() is None and m.value() is not None:
                seen += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return seen / elapsed


def streams_rate(cfg: KafkaConfig, n: int) -> tuple[float, float]:
    """(events/s from the first batch to the last, seconds to join the group)."""
    sink = NullSink()
    consumer = make_consumer(cfg, sink)
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


def one_round(cfg: KafkaConfig, n: int, k: int) -> dict[str, float]:
    out: dict[str, float] = {
        "raw_kafka_python_events_per_s": raw_kafka_python(cfg, n),
        "raw_confluent_events_per_s": raw_confluent(cfg, n),
    }
    for client in CLIENTS:
        name = client.replace("-", "_")
        run = KafkaConfig(**{**vars(cfg), "client": client, "group_id": f"bench-{name}-{k}"})
        rate, join_s = streams_rate(run, n)
        out[f"{name}_consumer_null_sink_events_per_s"] = rate
        out[f"{name}_group_join_s"] = join_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
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
        rounds = [one_round(cfg, args.events, k) for k in range(args.rounds)]
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    kp, cf = "kafka_python", "confluent"
    raw_kp, raw_cf = med["raw_kafka_python_events_per_s"], med["raw_confluent_events_per_s"]
    result = {
        "benchmark": "consume",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
        "command": shlex.join([".venv/bin/python", "bench/bench_consume.py", *sys.argv[1:]]),
        "clients": {"kafka-python": kafka.__version__, "confluent-kafka": confluent_kafka.version(),
                    "librdkafka": confluent_kafka.libversion()[0]},  # fmt: skip
        "events": args.events,
        "partitions": args.partitions,
        "max_poll_records": cfg.max_poll_records,
        "rounds": args.rounds,
        "produce_events_per_s": round(produce),
        "raw_kafka_python_events_per_s": round(raw_kp),
        "event_consumer_null_sink_events_per_s": round(med[f"{kp}_consumer_null_sink_events_per_s"]),
        "event_consumer_vs_raw": round(med[f"{kp}_consumer_null_sink_events_per_s"] / raw_kp, 3),
        "group_join_s": round(med[f"{kp}_group_join_s"], 2),
        "raw_confluent_events_per_s": round(raw_cf),
        "confluent_consumer_null_sink_events_per_s": round(med[f"{cf}_consumer_null_sink_events_per_s"]),
        "confluent_consumer_vs_raw_confluent": round(med[f"{cf}_consumer_null_sink_events_per_s"] / raw_cf, 3),
        "confluent_consumer_vs_event_consumer": round(
            med[f"{cf}_consumer_null_sink_events_per_s"] / med[f"{kp}_consumer_null_sink_events_per_s"], 3
        ),
        "raw_confluent_vs_raw_kafka_python": round(raw_cf / raw_kp, 3),
        "confluent_group_join_s": round(med[f"{cf}_group_join_s"], 2),
        "per_round": [{k: round(v, 2 if k.endswith("_s") else 0) for k, v in r.items()} for r in rounds],
    }  # fmt: skip
    out = (
        args.out
        or Path(__file__).resolve().parent / "results" / f"consume_{machine().split()[0]}.json"
    )
    write_result(out, result)


if __name__ == "__main__":
    main()
