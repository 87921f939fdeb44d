"""Capacity model of a recmem deployment on a Kafka consumer group (docs/scaling.md).

    .venv/bin/python bench/capacity.py [--users 100e6] [--events-per-s 1e6]
        [--bytes-per-user B] [--write-mb-s W] [--restore-mb-s R]
        [--kernel-events-per-s K] [--consume-events-per-s C] [--machine-state-gb 256]
        [--processes-per-machine 1] [--partitions 0] [--active-fraction 0.05]
        [--interval-s 30] [--full-every 8] [--session-s 10] [--restore-threads 2]
        [--json PATH]
    .venv/bin/python bench/capacity.py --measure [--measure-users 2000] [--s3]

Inputs are measured costs (defaults: the committed figures named in ``SOURCES``; pass your
own from your hardware):

- bytes per user: one user's memory state and window (``recmem_ingest_bytes_per_user``);
- checkpoint write and restore MB/s of the checkpoint store, per writer / restore thread
  (``--measure`` times a checkpoint of ``--measure-users`` default-size states written to
  and restored from a local directory, and with ``--s3`` from the S3 emulator);
- kernel events/s: what one process's engine applies (bench/bench_ingest.py,
  end-to-end);
- Kafka consume rate per process (bench/bench_ingest.py, raw consume + decode).

For a target (users, events/s) it prints the machines needed and what bounds them (state
memory, the engine, consumption), the partition count, the checkpoint bandwidth (deltas of
the active users every interval plus the periodic full checkpoints), the restore time of
one partition, and the cost of a rebalance after a lost machine (detection, the group's
rejoin, restores spread over the survivors, replay since the last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchinfo import git_commit, machine_facts  # noqa: E402

SOURCES = {
    "bytes_per_user": "bench/results/capacity_cpu.json measured.bytes_per_user",
    "write_mb_s": "bench/results/capacity_cpu.json measured.dir.write_mb_s",
    "restore_mb_s": "bench/results/capacity_cpu.json measured.dir.restore_mb_s",
    "kernel_events_per_s": "bench/results/capacity_cpu.json measured.kernel.events_per_s",
    "consume_events_per_s": "bench/results/ingest_cpu.json raw_consume_decode.events_per_s",
}
"""Where each default input was measured (the 2-core CPU VM; ``--measure`` measures all
but the last again: the state size of the default configuration, checkpoint MB/s, and the
engine's events/s at the default configuration)."""
FALLBACK = {
    "bytes_per_user": 34_064.0,
    "write_mb_s": 150.0,
    "restore_mb_s": 270.0,
    "kernel_events_per_s": 12_000.0,
    "consume_events_per_s": 78_000.0,
}


def measured_default(name: str) -> float:
    path, key = SOURCES[name].split(" ")
    try:
        data = json.loads((ROOT / path).read_text())
        for part in key.split("."):
            data = data[part]
        return float(data)
    except (OSError, KeyError, ValueError, TypeError):
        return FALLBACK[name]


def kernel_rate(events: int = 40_000, users: int = 2_000) -> dict[str, float]:
    """The engine's events/s at the default configuration (fresh weights, NoteBank on), in
    full batches of 4,000 events over ``users`` users with Zipf-like activity, no Kafka."""
    import numpy as np

    from recmem.config import Config
    from recmem.engine.builder import build_engine
    from recmem.vocab import ItemVocab
    from streams.validate import ValidEvent

    cfg = Config()
    tmp = tempfile.TemporaryDirectory(prefix="capacity-kernel-")
    cfg.state.spill_dir = tmp.name
    vocab = ItemVocab([str(i) for i in range(1682)], cfg.model.n_oov_buckets)
    from models.recommender import MemoryRecommender

    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    built = build_engine(cfg, model=model, vocab=vocab, device="cpu", start=False)
    rng = np.random.default_rng(0)
    who = rng.zipf(1.3, events) % users
    what = rng.integers(0, 1682, events)
    evs = [
        ValidEvent(f"u{w}", str(i), 880_000_000_000 + k * 1000, 4, 4.0, None, 0, k)
        for k, (w, i) in enumerate(zip(who, what))
    ]
    built.engine.apply(evs[:4000])  # warm-up
    t = time.perf_counter()
    for start in range(4000, events, 4000):
        built.engine.apply(evs[start : start + 4000])
    seconds = time.perf_counter() - t
    built.close()
    tmp.cleanup()
    return {"events": events - 4000, "seconds": round(seconds, 2),
            "events_per_s": round((events - 4000) / seconds)}  # fmt: skip


def measure(users: int, s3: bool) -> dict[str, dict[str, float]]:
    """Write and restore one checkpoint of ``users`` default-size states (random values),
    in a local directory (and the S3 emulator); MB/s of each."""
    import numpy as np
    import torch

    from recmem.blobstore import S3Settings
    from recmem.checkpoint import CheckpointStore
    from recmem.config import Config
    from recmem.state_store import StateLayout

    cfg = Config()
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    gen = torch.Generator().manual_seed(0)
    state = layout.zeros(users)
    state.S.copy_(torch.randn(state.S.shape, generator=gen))
    if state.M is not None:
        state.M.copy_(torch.randn(state.M.shape, generator=gen))
    state.pos.copy_(torch.arange(users))
    ids = [f"u{i}" for i in range(users)]
    notes = {"recent.items": np.zeros((users, 8), np.int64)}
    out: dict = {"bytes_per_user_default": layout.bytes_per_user()}
    targets: list[tuple[str, str, S3Settings | None]] = []
    tmp = tempfile.TemporaryDirectory(prefix="capacity-")
    targets.append(("dir", tmp.name, None))
    moto = None
    if s3:
        from tests.moto import MotoServer

        moto = MotoServer().start()
        targets.append(("s3", moto.bucket(), S3Settings(endpoint_url=moto.endpoint)))
    try:
        for name, root, settings in targets:
            store = CheckpointStore(root, layout, s3=settings)
            t = time.perf_counter()
            store.write(0, ids, state, 1, model_version="m", settings={}, notes=notes)
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            ckpt = store.restore(0)
            restore_s = time.perf_counter() - t
            assert ckpt is not None and ckpt.user_ids == ids
            mb = store.bytes_written / 1e6
            out[name] = {
                "users": users,
                "mb": round(mb, 1),
                "write_s": round(write_s, 3),
                "restore_s": round(restore_s, 3),
                "write_mb_s": round(mb / write_s, 1),
                "restore_mb_s": round(ckpt.bytes_read / 1e6 / restore_s, 1),
            }
    finally:
        tmp.cleanup()
        if moto is not None:
            moto.stop()
    return out


def model(a: argparse.Namespace) -> dict[str, object]:
    """The capacity figures for the target in ``a`` (see the module docstring)."""
    state_gb = a.users * a.bytes_per_user / 1e9
    procs_per_machine = a.processes_per_machine
    by_memory = math.ceil(state_gb / a.machine_state_gb)
    per_process_rate = min(a.kernel_events_per_s, a.consume_events_per_s)
    by_events = math.ceil(a.events_per_s / (per_process_rate * procs_per_machine))
    # checkpoints: deltas of the users active in an interval, a full one every full_every
    delta_mb_s = a.users * a.active_fraction * a.bytes_per_user / 1e6 / a.interval_s
    full_mb_s = a.users * a.bytes_per_user / 1e6 / (a.full_every * a.interval_s)
    ckpt_mb_s = delta_mb_s + full_mb_s
    by_checkpoints = math.ceil(ckpt_mb_s / (a.write_mb_s * a.checkpoint_budget * procs_per_machine))
    bounds = {
        "state memory": by_memory,
        "engine events/s" if a.kernel_events_per_s <= a.consume_events_per_s
        else "Kafka consumption": by_events,
        "checkpoint writes": by_checkpoints,
    }  # fmt: skip
    machines = max(*bounds.values(), 1)
    bound = max(bounds, key=lambda k: bounds[k])
    processes = machines * procs_per_machine
    partitions = a.partitions or processes * 4
    users_per_partition = a.users / partitions
    partition_gb = users_per_partition * a.bytes_per_user / 1e9
    per_process_ckpt = ckpt_mb_s / processes
    restore_partition_s = partition_gb * 1e3 / a.restore_mb_s
    # one machine lost: its partitions spread over the survivors' restore threads
    moved = partitions / machines
    survivors = max(machines - 1, 1)
    rounds = math.ceil(moved / (survivors * procs_per_machine * a.restore_threads))
    restore_s = rounds * restore_partition_s
    # a rejoin round: about half the session timeout on the embedded broker (tansu holds a
    # JoinGroup that long, in 1 s steps); Apache Kafka completes it once the members rejoin
    join_s = a.rejoin_s if a.rejoin_s >= 0 else math.ceil(a.session_s / 2)
    events_per_partition = a.events_per_s / partitions
    replay_s = events_per_partition * a.interval_s / per_process_rate  # at most one interval
    return {
        "state_tb": round(state_gb / 1e3, 3),
        "machines": machines,
        "machines_by_state_memory": by_memory,
        "machines_by_events": by_events,
        "machines_by_checkpoint_writes": by_checkpoints,
        "bound_by": bound,
        "processes": processes,
        "partitions": partitions,
        "users_per_partition": round(users_per_partition),
        "partition_gb": round(partition_gb, 2),
        "checkpoint_mb_s_total": round(ckpt_mb_s, 1),
        "checkpoint_mb_s_deltas": round(delta_mb_s, 1),
        "checkpoint_mb_s_full": round(full_mb_s, 1),
        "checkpoint_mb_s_per_process": round(per_process_ckpt, 1),
        "checkpoint_writer_busy_share": round(per_process_ckpt / a.write_mb_s, 3),
        "restore_s_per_partition": round(restore_partition_s, 2),
        "rebalance_after_losing_a_machine": {
            "partitions_moved": round(moved, 1),
            "gb_moved": round(moved * partition_gb, 1),
            "detection_s": a.session_s,
            "rejoin_s": round(join_s, 1),
            "restore_s": round(restore_s, 2),
            "replay_since_checkpoint_s_at_most": round(replay_s, 2),
            "moved_users_unavailable_s": round(a.session_s + join_s + restore_s + replay_s, 1),
            "other_users": "answered throughout (cooperative-sticky: nothing else moves)",
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=float, default=100e6)
    p.add_argument("--events-per-s", type=float, default=1e6)
    p.add_argument("--bytes-per-user", type=float, default=measured_default("bytes_per_user"))
    p.add_argument("--write-mb-s", type=float, default=measured_default("write_mb_s"))
    p.add_argument("--restore-mb-s", type=float, default=measured_default("restore_mb_s"))
    p.add_argument(
        "--kernel-events-per-s", type=float, default=measured_default("kernel_events_per_s")
    )
    p.add_argument(
        "--consume-events-per-s", type=float, default=measured_default("consume_events_per_s")
    )
    p.add_argument("--machine-state-gb", type=float, default=256.0,
                   help="memory per machine for user states (host RAM, or GPU memory)")  # fmt: skip
    p.add_argument("--processes-per-machine", type=int, default=1)
    p.add_argument("--partitions", type=int, default=0, help="0: 4 per process")
    p.add_argument("--active-fraction", type=float, default=0.05,
                   help="share of users with events in one checkpoint interval")  # fmt: skip
    p.add_argument("--interval-s", type=float, default=30.0, help="checkpoint.interval_s")
    p.add_argument("--full-every", type=int, default=8, help="checkpoint.full_every")
    p.add_argument("--session-s", type=float, default=10.0, help="kafka.session_timeout_ms/1000")
    p.add_argument("--restore-threads", type=int, default=2, help="checkpoint.restore_threads")
    p.add_argument("--rejoin-s", type=float, default=-1.0,
                   help="a rejoin round (-1: the embedded broker's, ceil(session / 2))")  # fmt: skip
    p.add_argument("--checkpoint-budget", type=float, default=0.5,
                   help="share of a process's time its checkpoint writer may be busy")  # fmt: skip
    p.add_argument("--measure", action="store_true", help="measure checkpoint MB/s here")
    p.add_argument("--measure-users", type=int, default=2000)
    p.add_argument("--s3", action="store_true", help="--measure the S3 emulator too")
    p.add_argument("--json", default="", help="write the result here")
    a = p.parse_args()
    result: dict[str, object] = {
        "benchmark": "capacity",
        "machine": machine_facts(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join([".venv/bin/python", "bench/capacity.py", *sys.argv[1:]]),
    }
    if a.measure:
        got: dict = measure(a.measure_users, a.s3)
        got["kernel"] = kernel_rate()
        got["bytes_per_user"] = got.pop("bytes_per_user_default")
        result["measured"] = got
        a.write_mb_s = got["dir"]["write_mb_s"]
        a.restore_mb_s = got["dir"]["restore_mb_s"]
        a.kernel_events_per_s = got["kernel"]["events_per_s"]
        a.bytes_per_user = got["bytes_per_user"]
    inputs = {k: v for k, v in vars(a).items() if k not in ("json", "measure", "s3")}
    result["inputs"] = inputs
    result["input_sources"] = dict(SOURCES)
    result["model"] = model(a)
    text = json.dumps(result, indent=2)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    m = result["model"]
    assert isinstance(m, dict)
    print(
        f"target: {a.users:,.0f} users, {a.events_per_s:,.0f} events/s, "
        f"{a.bytes_per_user:,.0f} bytes per user ({m['state_tb']} TB of state)\n"
        f"machines: {m['machines']} (state memory {m['machines_by_state_memory']}, "
        f"events {m['machines_by_events']}, checkpoint writes "
        f"{m['machines_by_checkpoint_writes']}; bound by {m['bound_by']}), "
        f"{m['processes']} processes, {m['partitions']} partitions of "
        f"{m['users_per_partition']:,} users ({m['partition_gb']} GB)\n"
        f"checkpoint bandwidth: {m['checkpoint_mb_s_total']} MB/s "
        f"({m['checkpoint_mb_s_deltas']} deltas + {m['checkpoint_mb_s_full']} full), "
        f"{m['checkpoint_mb_s_per_process']} MB/s per process (writer busy "
        f"{m['checkpoint_writer_busy_share']:.0%} at {a.write_mb_s} MB/s)\n"
        f"restore: {m['restore_s_per_partition']} s per partition at {a.restore_mb_s} MB/s\n"
        f"rebalance after losing a machine: {json.dumps(m['rebalance_after_losing_a_machine'])}"
    )


if __name__ == "__main__":
    main()
