"""One member's per-event CPU between the broker and the engine, stage by stage, on the
embedded broker and the benchmark workload (issue 14), the consumer's old and new paths
alternating in one run.

    .venv/bin/python bench/member_cpu.py [--events 100000] [--users 20000]
        [--partitions 4] [--rounds 3] [--engine-events 20000] [--json PATH]

1. produce: the workload's first --events events (``workload.users`` = --users) into a
   fresh topic (``produce_stream``, as ``recmem produce`` sends them);
2. fetch: kafka-python's KafkaConsumer (every partition assigned, no group) polls them all
   as EventConsumer does (``max_poll_records`` records, each kept as (offset, key,
   value)): the client's fetch and record parsing, in wall and process CPU per event.
   kafka-python checks each record batch's CRC32C; with no C ``crc32c`` module importable
   (the project's environment) it does so in pure Python (``kafka.record._crc32c``), which
   every stage below uses. When one is importable (``PYTHONPATH`` with the ``crc32c``
   package), the fetch is also timed with it, alternating
   (``kafka.record.default_records.calc_crc32c`` swapped);
3. the polls held in memory, per round, old then new:
   old (the in-thread consumer before streams/columns.py): ``validate_record`` per record
   into ValidEvents (validation), ``EventBatch.of`` (batch building, which the engine ran
   in ``Engine.plan``), of which the duplicate keys (``key_of`` per event) are also timed
   alone; new: ``streams.columns.decode_records`` (decode, validation, columns and keys in
   one), of which ``keys_of`` is timed alone;
4. the consumer on the broker: the real EventConsumer (group member, poll, validate, dead
   letters, hand-over) feeding a sink that does nothing but what the engine would do with
   the batch before grouping it: old, a sink without ``takes_columns`` that builds
   ``EventBatch.of`` from the events; new, a ``takes_columns`` sink that takes the columns
   the consumer built. Events/s from the first batch to the last, alternating old, new;
5. the engine: ``Engine.apply`` of the first --engine-events events as columns (a CPU
   engine, fresh model and NoteBank, as bench/engine_apply.py builds it), its seconds per
   phase per event (the same for old and new: the engine takes the same columns).

Writes JSON (machine, date, commit, command, figures) to --json (default
bench/experiments/member_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kafka.record.default_records as default_records  # noqa: E402
import torch  # noqa: E402
from bench_consume import NullSink  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402
from kafka import KafkaConsumer, TopicPartition  # noqa: E402
from kafka.record._crc32c import crc as crc32c_py  # noqa: E402

from models.recommender import MemoryRecommender  # noqa: E402
from recmem.archive import NoteBank  # noqa: E402
from recmem.config import load_config  # noqa: E402
from recmem.engine.engine import Engine  # noqa: E402
from recmem.producing import produce_stream  # noqa: E402
from recmem.state_store import StateLayout, UserStateStore  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402
from recmem.workload import workload_stream  # noqa: E402
from streams.admin import client_settings  # noqa: E402
from streams.batch import EventBatch, key_of, keys_of  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.clients import make_consumer  # noqa: E402
from streams.columns import decode_records  # noqa: E402
from streams.config import KafkaConfig  # noqa: E402
from streams.validate import Limits, ValidEvent, validate_record  # noqa: E402

Poll = dict[int, list[tuple[int, bytes | None, bytes | None]]]


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, wall seconds, process CPU seconds) of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def fetch(cfg: KafkaConfig, n: int) -> tuple[list[Poll], float, float]:
    """Every record of the topic as EventConsumer's polls hold them; (polls, wall s, CPU
    s); the first poll's parsing is in the CPU figure only."""
    consumer = KafkaConsumer(
        auto_offset_reset="earliest", max_poll_records=cfg.max_poll_records, **client_settings(cfg)
    )
    consumer.assign([TopicPartition(cfg.topic, p) for p in range(cfg.partitions)])
    polls: list[Poll] = []
    seen = 0
    # CPU from the first poll on (waiting for the broker costs none); wall from the first
    # record (the connection and the first fetch's wait are not parsing)
    wall0, cpu0 = 0.0, time.process_time()
    while seen < n:
        got = consumer.poll(timeout_ms=50, max_records=cfg.max_poll_records)
        if not got:
            continue
        wall0 = wall0 or time.perf_counter()
        poll = {
            tp.partition: [(r.offset, r.key, r.value) for r in records]
            for tp, records in got.items()
        }
        polls.append(poll)
        seen += sum(map(len, poll.values()))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    consumer.close()
    return polls, wall, cpu


def old_path(topic: str, polls: list[Poll], limits: Limits) -> dict[str, float]:
    """CPU seconds of the old in-thread path's stages over every poll."""
    out = dict.fromkeys(("validate", "batch", "keys"), 0.0)
    for poll in polls:

        def validate(poll: Poll = poll) -> list[ValidEvent]:
            events = []
            for p in sorted(poll):
                for offset, key, value in poll[p]:
                    v = validate_record(topic, p, offset, key, value, 0, limits)
                    if isinstance(v, ValidEvent):
                        events.append(v)
            return events

        events, _, cpu = timed(validate)
        out["validate"] += cpu
        _, _, cpu = timed(lambda events=events: EventBatch.of(events))
        out["batch"] += cpu

        def keys(events: list[ValidEvent] = events) -> list[int]:
            return [key_of(e.item_id, e.ts_ms, e.action, e.event_id) for e in events]

        out["keys"] += timed(keys)[2]
    out["batch_without_keys"] = out["batch"] - out["keys"]
    return out


def new_path(topic: str, polls: list[Poll], limits: Limits) -> dict[str, float]:
    """CPU seconds of ``decode_records`` over every poll, and of its keys alone."""
    out = dict.fromkeys(("decode_records", "keys"), 0.0)
    for poll in polls:
        (batch, _), _, cpu = timed(lambda poll=poll: decode_records(topic, poll, 0, limits))
        out["decode_records"] += cpu
        _, _, cpu = timed(lambda b=batch: keys_of(b.item_id, b.ts_ms, b.action, b.event_id))
        out["keys"] += cpu
    out["decode_records_without_keys"] = out["decode_records"] - out["keys"]
    return out


class EventsSink(NullSink):
    """Old: takes ValidEvents and builds the columns the engine would (``EventBatch.of``)."""

    def apply_batch(self, events: Any, next_offsets: dict[int, int], source: Any = None) -> None:
        batch = events if isinstance(events, EventBatch) else EventBatch.of(events)
        self.events += len(batch)
        self.offsets.update(next_offsets)


class ColumnsSink(EventsSink):
    """New: takes the consumer's columns as they are."""

    takes_columns = True


def consumer_rate(cfg: KafkaConfig, n: int, sink: EventsSink) -> dict[str, float]:
    """The real EventConsumer into ``sink``: events/s and process CPU us/event from the
    first batch to the last."""
    consumer = make_consumer(cfg, sink)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    while sink.events == 0:
        time.sleep(0.001)
    w, c, first = time.perf_counter(), time.process_time(), sink.events
    while sink.events < n:
        time.sleep(0.002)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    consumer.stop()
    thread.join(timeout=30)
    done = n - first
    return {"events_per_s": round(done / wall), "cpu_us_per_event": round(cpu / done * 1e6, 2)}


def engine_split(polls: list[Poll], topic: str, n: int) -> dict[str, Any]:
    """``Engine.apply`` of the first ``n`` events, poll by poll, as columns; seconds per
    phase per event."""
    cfg = load_config(None, [], environ={})
    torch.manual_seed(cfg.train.seed)
    batches: list[EventBatch] = []
    total = 0
    for poll in polls:
        batch, _ = decode_records(topic, poll, 0, Limits())
        batches.append(batch)
        total += len(batch)
        if total >= n and len(batches) > 1:
            break
    items = sorted({i for b in batches for i in b.item_id})
    vocab = ItemVocab(items, cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    users = len({u for b in batches for u in b.user_id})
    store = UserStateStore(layout, max(users, 1024), 0, Path("/tmp/member-cpu-spill"), "cpu")
    mem = cfg.memory
    bank = NoteBank(cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed,
                    use_gpu=False, query_dim=model.route_dim)  # fmt: skip
    engine = Engine(model, vocab, store, cfg, bank=bank)
    engine.apply(batches[0])  # warm-up
    for k in engine.seconds:
        engine.seconds[k] = 0.0
    done = sum(len(b) for b in batches[1:])
    _, wall, cpu = timed(lambda: [engine.apply(b) for b in batches[1:]])
    return {
        "events": done,
        "users": users,
        "events_per_s": round(done / wall),
        "cpu_us_per_event": round(cpu / done * 1e6, 2),
        "us_per_event_by_phase": {
            k: round(v / done * 1e6, 2) for k, v in engine.seconds.items() if k != "user_steps"
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-events", type=int, default=20_000)
    ap.add_argument("--json", type=Path, default=ROOT / "bench/experiments/member_cpu.json")
    args = ap.parse_args()
    try:
        import crc32c  # type: ignore[import-not-found]

        c_crc: Callable[[Any], int] | None = crc32c.crc32c
    except ImportError:
        c_crc = None

    def py_crc(data: Any) -> int:
        return int(crc32c_py(data))

    n = args.events
    with EmbeddedBroker() as broker:
        cfg = load_config(None, [
            f"workload.users={args.users}", f"workload.events={max(n, args.users)}",
            f"kafka.bootstrap_servers={broker.bootstrap}", f"kafka.partitions={args.partitions}",
            "kafka.topic=member-cpu", "kafka.dead_letter_topic=member-cpu.dlq",
            "kafka.max_past_ms=0", "kafka.max_future_ms=0", "kafka.metrics_port=0",
            "kafka.session_timeout_ms=6000", "kafka.heartbeat_interval_ms=1000",
        ], environ={})  # fmt: skip
        kcfg = cfg.kafka
        _, produce_s, _ = timed(
            lambda: produce_stream(cfg, workload_stream(cfg.workload), kcfg.topic, limit=n)
        )
        limits = Limits.from_config(kcfg)
        rounds: list[dict[str, Any]] = []
        polls: list[Poll] = []
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for crc_name, crc in (("python_crc32c", py_crc), ("c_crc32c", c_crc)):
                if crc is None:
                    continue
                default_records.calc_crc32c = crc  # type: ignore[assignment]
                polls, wall, cpu = fetch(kcfg, n)
                row[f"fetch_{crc_name}"] = {
                    "wall_us_per_event": round(wall / n * 1e6, 2),
                    "cpu_us_per_event": round(cpu / n * 1e6, 2),
                }
            # the rest as in the project's environment, which has no C crc32c module
            default_records.calc_crc32c = py_crc  # type: ignore[assignment]
            for name, path in (("old", old_path), ("new", new_path)):
                row[name] = {
                    k: round(v / n * 1e6, 2) for k, v in path(kcfg.topic, polls, limits).items()
                }
            for name, sink_type in (("old", EventsSink), ("new", ColumnsSink)):
                run = KafkaConfig(**{**vars(kcfg), "group_id": f"member-cpu-{name}-{r}"})
                row[f"consumer_{name}"] = consumer_rate(run, n, sink_type())
            print(f"round {r}: {row}", flush=True)
            rounds.append(row)
        engine = engine_split(polls, kcfg.topic, args.engine_events)
        print(f"engine: {engine}", flush=True)

    def median(path: list[str]) -> float:
        vals = []
        for row in rounds:
            v: Any = row
            for k in path:
                v = v[k]
            vals.append(v)
        return round(statistics.median(vals), 2)

    summary: dict[str, Any] = {
        "fetch_python_crc32c_cpu_us_per_event": median(["fetch_python_crc32c", "cpu_us_per_event"]),
        "old_validate_us_per_event": median(["old", "validate"]),
        "old_batch_without_keys_us_per_event": median(["old", "batch_without_keys"]),
        "old_keys_us_per_event": median(["old", "keys"]),
        "new_decode_records_without_keys_us_per_event": median(
            ["new", "decode_records_without_keys"]
        ),
        "new_keys_us_per_event": median(["new", "keys"]),
        "consumer_old_events_per_s": median(["consumer_old", "events_per_s"]),
        "consumer_new_events_per_s": median(["consumer_new", "events_per_s"]),
        "consumer_old_cpu_us_per_event": median(["consumer_old", "cpu_us_per_event"]),
        "consumer_new_cpu_us_per_event": median(["consumer_new", "cpu_us_per_event"]),
        "engine_cpu_us_per_event": engine["cpu_us_per_event"],
    }
    if c_crc is not None:
        summary["fetch_c_crc32c_cpu_us_per_event"] = median(["fetch_c_crc32c", "cpu_us_per_event"])
    result = {
        "benchmark": "member_cpu",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
        "command": shlex.join([".venv/bin/python", "bench/member_cpu.py", *sys.argv[1:]]),
        "events": n,
        "workload_users": args.users,
        "partitions": args.partitions,
        "max_poll_records": kcfg.max_poll_records,
        "produce_s": round(produce_s, 1),
        "polls": len(polls),
        "summary_medians": summary,
        "engine": engine,
        "rounds": rounds,
    }
    write_result(args.json, result)


if __name__ == "__main__":
    main()
