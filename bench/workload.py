"""The benchmark workload at full size (issue 14): how fast it is generated, written and read
as an events file, and produced into the embedded broker with kafka-python.

    .venv/bin/python bench/workload.py [--set workload.users=N ...] [--partitions 4]
        [--file PATH] [--encode-events 1000000] [--tag cpu] [--out DIR]

1. generation: every chunk of the workload (recmem/workload.py with the [workload] settings;
   1M users and 10M events by default), timed, and the shape it came out with: distinct
   users, the top 1 % of users' share against the prediction, the most active user, the top
   1 % of items' share, the time span;
2. the events file (``recmem produce --write``): written to --file (default: a temporary
   file, removed after) and read back, timed; the write includes generating the events;
3. wire messages alone: the first --encode-events events as protobuf records (ids looked
   up, ``make_event``, ``encode_event``) with no Kafka: the producer's Python cost;
4. production as ``recmem produce --dataset workload`` runs it (``produce_stream``:
   generation, EventProducer on kafka-python, acks=all, idempotent) into a fresh topic on
   the embedded tansu broker (started from ``kafka.broker_bin_dir``), timed; the topic's
   highwater marks must add up to every event; the broker's resident memory at the end.

Writes bench/results/workload_<tag>.json (or $OUT/...) with machine, date, commit, command
and the figures.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402
from tqdm import tqdm  # noqa: E402

from recmem.config import Config, load_config  # noqa: E402
from recmem.event_columns import read_event_file, write_event_file  # noqa: E402
from recmem.producing import produce_stream, stream_events  # noqa: E402
from recmem.workload import (  # noqa: E402
    BLOCK_EVENTS,
    START_MS,
    expected_top_share,
    top_share,
    workload_chunks,
    workload_stream,
)
from streams.admin import end_offsets  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.codec import encode_event  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generation(cfg: Config) -> dict[str, object]:
    spec = cfg.workload
    users = np.zeros(spec.users, dtype=np.int64)
    items = np.zeros(spec.items, dtype=np.int64)
    first_ts = last_ts = 0
    start = time.perf_counter()
    with tqdm(total=spec.events, unit="ev", desc="generate") as bar:
        for chunk in workload_chunks(spec):
            users += np.bincount(chunk.user, minlength=spec.users)
            items += np.bincount(chunk.item, minlength=spec.items)
            first_ts = first_ts or int(chunk.ts_ms[0])
            last_ts = int(chunk.ts_ms[-1])
            bar.update(len(chunk))
    seconds = time.perf_counter() - start
    return {
        "events": int(users.sum()),
        "seconds": round(seconds, 2),
        "events_per_s": round(users.sum() / seconds),
        "peak_rss_mb_after": round(peak_rss_mb()),
        "distinct_users": int((users > 0).sum()),
        "top_1pct_users_share": round(top_share(users), 4),
        "top_1pct_users_share_expected": round(expected_top_share(spec), 4),
        "most_active_user_events": int(users.max()),
        "median_user_events": float(np.median(users)),
        "distinct_items": int((items > 0).sum()),
        "top_1pct_items_share": round(top_share(items), 4),
        "most_popular_item_share": round(float(items.max() / items.sum()), 4),
        "first_ts_ms": first_ts,
        "span_days": round((last_ts - first_ts) / 86_400_000, 2),
    }


def event_file(cfg: Config, path: Path) -> dict[str, object]:
    start = time.perf_counter()
    n = write_event_file(path, workload_stream(cfg.workload))
    written = time.perf_counter() - start
    start = time.perf_counter()
    back = read_event_file(path)
    read = time.perf_counter() - start
    assert back.n_events == n
    return {
        "events": n,
        "bytes": path.stat().st_size,
        "write_seconds_incl_generation": round(written, 2),
        "read_seconds": round(read, 2),
    }


def encode_only(cfg: Config, n: int) -> dict[str, object]:
    stream = workload_stream(cfg.workload)
    n = min(n, stream.n_events)
    start = time.perf_counter()
    size = 0
    for event in itertools.islice(stream_events(stream), n):
        key, value = encode_event(event)
        size += len(key) + len(value)
    seconds = time.perf_counter() - start
    return {
        "events": n,
        "seconds": round(seconds, 2),
        "events_per_s": round(n / seconds),
        "mean_record_bytes": round(size / n, 1),
    }


def process_memory_mb(pid: int | None) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of a process, from /proc."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name.lower() + "_mb"] = round(int(value.split()[0]) / 1024)
    return out


def production(cfg: Config, work: Path, partitions: int) -> dict[str, object]:
    stream = workload_stream(cfg.workload)
    with EmbeddedBroker(log_path=work / "broker.log", bin_dir=cfg.kafka.broker_bin_dir) as b:
        cfg.kafka.bootstrap_servers = b.bootstrap
        cfg.kafka.partitions = partitions
        start = time.perf_counter()
        sent = produce_stream(cfg, stream, "workload")
        seconds = time.perf_counter() - start
        highwater = end_offsets(cfg.kafka, "workload", timeout_s=60)
        broker_memory = process_memory_mb(b.pid)
    if sum(highwater.values()) != stream.n_events or sent != stream.n_events:
        raise RuntimeError(f"sent {sent}, topic holds {highwater}, expected {stream.n_events}")
    return {
        "client": "kafka-python (EventProducer: acks=all, idempotent, linger 5 ms, 256 KiB batches)",
        "events": sent,
        "partitions": partitions,
        "seconds": round(seconds, 1),
        "events_per_s": round(sent / seconds),
        "records_per_partition": highwater,
        "broker_memory": broker_memory,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--file", help="where the events file goes (default: temporary, removed)")
    ap.add_argument("--encode-events", type=int, default=1_000_000, help="events encoded alone")
    ap.add_argument("--note", default="", help="a sentence saved in the JSON")
    ap.add_argument("--tag", default="cpu", help="result file name: workload_<tag>.json")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()

    cfg = load_config(None, args.set, environ={})
    default = Config().workload
    with tempfile.TemporaryDirectory(prefix="bench-workload-") as tmp:
        work = Path(tmp)
        path = Path(args.file) if args.file else work / "workload.npz"
        gen = generation(cfg)
        file = event_file(cfg, path)
        encode = encode_only(cfg, args.encode_events)
        produce = production(cfg, work, args.partitions)

    spec = cfg.workload
    result = {
        "benchmark": "workload",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
        "command": " ".join([".venv/bin/python", "bench/workload.py", *sys.argv[1:]]),
        "note": args.note,
        "full_size": spec.users >= default.users and spec.events >= default.events,
        "workload": {**cfg.to_dict()["workload"], "block_events": BLOCK_EVENTS},
        "start_ms": START_MS,
        "generation": gen,
        "events_file": file,
        "wire_messages_without_kafka": encode,
        "produce_embedded_broker": produce,
        "produce_vs_generation": round(
            float(produce["events_per_s"]) / float(gen["events_per_s"]),  # type: ignore[arg-type]
            4,
        ),
    }
    write_result(Path(args.out) / f"workload_{args.tag}.json", result)


if __name__ == "__main__":
    main()
