"""One host, several `recmem serve` members sharing its GPU: ingest and rank throughput of
the whole host against one member, in one run (issue 14's host-level goals).

    .venv/bin/python bench/host_members.py [--members 1,4] [--dataset workload]
        [--events 1000000] [--partitions 16] [--produce-procs 8] [--interval 10]
        [--concurrency 64] [--replay 0,2] [--rank-seconds 5] [--client-procs 4]
        [--set section.field=value ...] [--clients kafka-python,confluent] [--json PATH]

A member is an ordinary ``recmem serve`` process (tests/cluster.py starts them, each with
its own gRPC and metrics port); members of one consumer group split the topic's
partitions, so N members on one host run N engines, N consumers and N gRPC servers on
the one GPU (docs/scaling.md). The run:

1. an embedded tansu broker, a topic of ``--partitions`` partitions, and the first
   ``--events`` events of the dataset (default: the benchmark workload, 1M users with Zipf
   activity) sent from ``--produce-procs`` processes (bench_ingest.produce: each
   partition's highwater checked); a freshly initialised model of the default shape over
   the dataset's items, saved where every member loads it;
2. for each N of ``--members``, on the same records with a fresh group and checkpoint
   root: N members start; ingest is timed from their start (process start, model load,
   group join included) and from the first event any member applied, to the last event
   applied (the members' ``recmem_ingest_events_total``, polled every 0.2 s) and to the
   checkpoints of every partition at its end offset (``checkpoint.interval_s`` =
   ``--interval``), and between 10 % and 90 % of the events applied (the rate with every
   member at work: the first figure includes the group's join rounds, the last the tail
   of the largest partition). Each member's slab holds its share of the users with room to spare
   (``state.device_capacity``), so no user leaves the GPU;
3. then rank on the same members: closed-loop callers (``--concurrency`` in all, spread
   over ``--client-procs`` processes, each a ``RankClient`` that calls each user's owner
   directly) rank 100 random candidates (k = 10) for users drawn from those ingested,
   for ``--rank-seconds`` per replay setting of ``--replay`` (notes R; 0: off), after a
   3 s warm-up cell. Users are drawn in proportion to their events (callers rank active
   users more often; a uniform draw would mostly pick users too new to have notes).
   Figures: requests/s, p50 / p99 / mean latency, errors, mean notes replayed (each
   caller's first 64 answers), and the cores the members and the clients kept busy.

Each run also records the host's busy cores and the members' (their consumer processes
included) and the GPU's utilization (nvidia-smi, every 0.2 s) over the ingest's 10-90 %
window; ``--profile-member DIR`` records member 0 with
py-spy over the ingest (bench/experiments/member_profile.py summarises it; with
``PYSPY_IDLE=1`` in the environment idle samples are kept, so waits show where they sit).

``--clients``: run every N once per Kafka client (``kafka.client``; confluent is librdkafka,
whose members learn the other partitions' owners from the checkpoint claims,
docs/streams.md), in that order, on the same records; the runs are then keyed
``client/N`` and the JSON adds each client's ratios and each N's ingest rate over the
first client's. ``--rank-seconds 0``: ingest only.

Writes bench/results/host_members_<device>.json (or --json; also after each N, with
``complete`` false until the end): machine, date, commit, command, production, per N the
ingest figures and the rank cells, and the ratios of the largest N to the first.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
from benchinfo import cpu_seconds, git_commit, latency_percentiles, machine, write_result  # noqa: E402

log = logging.getLogger("host_members")
CANDIDATES = 100
K = 10


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def applied(ports: list[int]) -> int | None:
    """Events the members' consumers handed to their engines (summed; None while one does
    not answer)."""
    total = 0.0
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("recmem_ingest_events_total "):
                total += float(line.split()[1])
    return int(total)


def gpu_memory_by_pid(cluster: Any) -> dict[str, int]:
    """GPU memory (MiB) each live member process holds, from nvidia-smi ({} without one)."""
    pids = {inst.proc.pid: i for i, inst in enumerate(cluster.instances) if inst.proc}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    got = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            got[f"member {pids[int(pid)]}"] = int(mib.strip() or 0)
    return got


def member_log_errors(cluster: Any, most: int = 12) -> list[str]:
    """The first error lines of the members' logs (tracebacks' last lines, ERROR records)."""
    found: list[str] = []
    for i, inst in enumerate(cluster.instances):
        lines = inst.log().splitlines()
        for j, line in enumerate(lines):
            if " ERROR " in line or "Error:" in line or "error:" in line.lower()[:60]:
                found.append(f"serve {i}: {line[:300]}")
            elif line.startswith("Traceback") and j + 1 < len(lines):
                tail = next((x for x in lines[j + 1 :] if x and not x.startswith(" ")), "")
                found.append(f"serve {i}: {tail[:300]}")
            if len(found) >= most:
                return found
    return found


def host_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole host so far, from /proc/stat ((0, 0) without)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a member's consumer processes), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class IngestCpu:
    """The host's busy cores and the members' (with their consumer processes) over the
    ingest's 10-90 % window: sampled at every poll, the samples nearest the crossings used."""

    def __init__(self, member_pids: list[int]) -> None:
        self.member_pids = member_pids
        self.samples: list[tuple[float, int, int, float]] = []

    def sample(self, now: float) -> None:
        busy, total = host_jiffies()
        pids = [p for m in self.member_pids for p in tree_pids(m)]
        self.samples.append((now, busy, total, cpu_seconds(*pids)))

    def over(self, t_a: float, t_b: float) -> dict[str, float] | None:
        if len(self.samples) < 2 or t_b <= t_a:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - t_a))
        b = min(self.samples, key=lambda s: abs(s[0] - t_b))
        if b[0] <= a[0] or b[2] <= a[2]:
            return None
        cores = os.cpu_count() or 1
        return {
            "host_cores_busy": round((b[1] - a[1]) / (b[2] - a[2]) * cores, 2),
            "members_cores_busy": round((b[3] - a[3]) / (b[0] - a[0]), 2),
            "host_cores": cores,
        }


class GpuBusy:
    """The GPU's utilization (nvidia-smi's ``utilization.gpu``: the share of each sample
    period in which some kernel ran, any process's) sampled every 0.2 s in the background,
    averaged over a window: how busy the one GPU was while the members ingested. Records
    nothing without nvidia-smi."""

    def __init__(self, t0: float) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen[str] | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        out = self.proc.stdout

        def read() -> None:
            for line in out or ():
                try:
                    util = float(line.split(",")[0])
                except ValueError:
                    continue  # "[N/A]" and the like
                self.samples.append((time.monotonic() - t0, util))

        threading.Thread(target=read, name="gpu-busy", daemon=True).start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def over(self, t_a: float, t_b: float) -> dict[str, float] | None:
        inside = [u for t, u in self.samples if t_a <= t <= t_b]
        if not inside:
            return None
        return {
            "mean_percent": round(sum(inside) / len(inside), 1),
            "samples": len(inside),
            "samples_at_100_percent": sum(1 for u in inside if u >= 100.0),
        }


def py_spy_member(pid: int, path: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording a member (every thread and its consumer processes; raw collapsed
    stacks) until it is sent SIGINT; None without py-spy ($PYSPY or on PATH)."""
    exe = os.environ.get("PYSPY") or shutil.which("py-spy")
    if exe is None:
        say("no py-spy: --profile-member records nothing")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--duration", "600", "--rate", "100", "--threads",
           "--subprocesses", "--nonblocking", "--format", "raw", "-o", str(path)]  # fmt: skip
    if os.environ.get("PYSPY_IDLE") == "1":
        cmd.append("--idle")  # waiting threads too: where a member waits, not only works
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def ingest_pass(
    cluster: Any, cfg: Any, n_events: int, ends: dict[int, int], profile: Path | None = None
) -> dict[str, Any]:
    """Start the members and time them to every event applied and checkpointed
    (``profile``: py-spy member 0 from the first event applied to the last, into it)."""
    from tests.cluster import caught_up

    ports = [inst.metrics_port for inst in cluster.instances]
    t0 = time.monotonic()
    cluster.start_all()
    cpu = IngestCpu([inst.proc.pid for inst in cluster.instances if inst.proc])
    gpu = GpuBusy(t0)
    try:
        spy: subprocess.Popen[bytes] | None = None
        first = last = settled = None
        trace: list[tuple[float, int]] = []
        while True:
            for i in cluster.live():
                cluster.alive(i)  # raises with the log tail of a member that died
            now = time.monotonic() - t0
            got = applied(ports)
            cpu.sample(now)
            if got is not None:
                if got and first is None:
                    first = now
                    if profile is not None and cluster.instances[0].proc:
                        spy = py_spy_member(cluster.instances[0].proc.pid, profile)
                if not trace or trace[-1][1] != got:
                    trace.append((round(now, 2), got))
                if got >= n_events and last is None:
                    last = now
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
            if settled is None and cluster.settled(cluster.n):
                settled = now
            if last is not None and caught_up(cfg, ends):
                done = time.monotonic() - t0
                break
            if now > 900:
                raise RuntimeError(f"not caught up after 900 s: {got} of {n_events} applied")
            time.sleep(0.2)
    finally:
        gpu.stop()
    assert first is not None and last is not None
    span = max(last - first, 1e-9)
    t10, t90 = (crossing(trace, q * n_events) for q in (0.1, 0.9))
    if spy is not None:
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()
    return {
        "cpu_10_to_90_percent": cpu.over(t10, t90),
        "gpu_utilization_10_to_90_percent": gpu.over(t10, t90),
        "profiled_seconds": None if spy is None else round(last - first, 2),
        "members": cluster.n,
        "seconds_to_first_applied": round(first, 2),
        "seconds_to_settled": None if settled is None else round(settled, 2),
        "seconds_to_last_applied": round(last, 2),
        "seconds_to_checkpointed": round(done, 2),
        "events_per_s_first_to_last_applied": round(n_events / span),
        "events_per_s_start_to_checkpointed": round(n_events / done),
        "events_per_s_10_to_90_percent": round(0.8 * n_events / max(t90 - t10, 1e-9)),
        "applied_trace": trace[:: max(1, len(trace) // 60)],
        # stalls: no event applied for over a second (the count is polled every 0.2 s)
        "stalls_over_1s": [
            [round(a[0], 2), round(b[0] - a[0], 2)]
            for a, b in zip(trace, trace[1:])
            if b[0] - a[0] > 1.0 and a[1] > 0
        ],
        "seconds_in_stalls_over_1s": round(
            sum(b[0] - a[0] for a, b in zip(trace, trace[1:]) if b[0] - a[0] > 1.0 and a[1] > 0),
            2,
        ),
    }


def crossing(trace: list[tuple[float, int]], level: float) -> float:
    """When the applied count first reached ``level`` (linear between polls)."""
    prev_t, prev_n = 0.0, 0
    for t, got in trace:
        if got >= level:
            if got == prev_n:
                return t
            return prev_t + (t - prev_t) * (level - prev_n) / (got - prev_n)
        prev_t, prev_n = t, got
    return trace[-1][0]


def _client(
    addresses: list[str], threads: int, users: list[str], items: list[str], replay: int,
    start_at: float, seconds: float, seed: int, out: Any,
) -> None:  # fmt: skip
    """One client process: ``threads`` closed-loop callers through one RankClient."""
    from recmem.client import RankClient

    lat: list[list[float]] = [[] for _ in range(threads)]
    notes: list[int] = []
    errors: list[str] = []
    with RankClient(addresses) as client:

        def call(rng: np.random.Generator) -> Any:
            return client.rank(
                users[int(rng.integers(len(users)))], K,
                candidates=[items[j] for j in rng.choice(len(items), CANDIDATES, replace=False)],
                replay=replay > 0, notes=replay, timeout=30,
            )  # fmt: skip

        warm = np.random.default_rng(seed)
        for _ in range(20):
            call(warm)

        def worker(t: int) -> None:
            rng = np.random.default_rng(seed * 1000 + t)
            time.sleep(max(0.0, start_at - time.time()))
            stop = start_at + seconds
            while time.time() < stop:
                s = time.perf_counter()
                try:
                    res = call(rng)
                except Exception as e:  # noqa: BLE001 - counted, the load goes on
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                lat[t].append(time.perf_counter() - s)
                if len(lat[t]) <= 64:
                    notes.append(res.notes_replayed)

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = time.process_time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        cpu = time.process_time() - cpu0
    out.put(([x for xs in lat for x in xs], errors[:5], len(errors), notes, cpu))


def rank_cell(
    addresses: list[str], users: list[str], items: list[str], replay: int, args: Any,
    member_pids: list[int], seconds: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One closed-loop cell; CPU seconds of the members and of the clients over it."""
    seconds = args.rank_seconds if seconds is None else seconds
    procs = max(1, min(args.client_procs, args.concurrency))
    per = [len(range(p, args.concurrency, procs)) for p in range(procs)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 8.0  # the client processes import and warm up first
    ps = [
        ctx.Process(target=_client, daemon=True, args=(
            addresses, per[p], users, items, replay, start_at, seconds, p + 1, out))
        for p in range(procs)
    ]  # fmt: skip
    for p in ps:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    members0 = cpu_seconds(*member_pids)
    time.sleep(seconds)
    members_cpu = cpu_seconds(*member_pids) - members0
    results = [out.get(timeout=seconds + 180) for _ in ps]
    for p in ps:
        p.join(30)
    lat = [x for r in results for x in r[0]]
    n_err = sum(r[2] for r in results)
    notes = [x for r in results for x in r[3]]
    cell = {
        "replay_notes": replay,
        "concurrency": args.concurrency,
        "client_processes": procs,
        "requests": len(lat),
        "errors": n_err,
        "error_examples": [e for r in results for e in r[1]][:5],
        "throughput_rps": round(len(lat) / seconds, 1),
        "mean_notes_replayed": round(float(np.mean(notes)), 2) if notes else 0.0,
        **latency_percentiles(lat),
        "cores_busy": {
            "members": round(members_cpu / seconds, 2),
            "clients": round(sum(r[4] for r in results) / seconds, 2),
            "host": os.cpu_count(),
        },
    }
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--members", default="1,4", help="comma-separated member counts")
    ap.add_argument("--dataset", default="workload")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--produce-procs", type=int, default=8)
    ap.add_argument("--interval", type=float, default=10.0, help="checkpoint.interval_s")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--replay", default="0,2", help="comma-separated notes R (0: off)")
    ap.add_argument("--rank-seconds", type=float, default=5.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    ap.add_argument(
        "--clients",
        default="",
        help="comma-separated kafka.client values, each run over every N of --members "
        "(e.g. kafka-python,confluent; default: the configured one only)",
    )
    ap.add_argument(
        "--keep-logs",
        default="",
        help="folder to copy each run's member logs into (DIR/<run>/serve-N.log)",
    )
    ap.add_argument(
        "--profile-member",
        default="",
        metavar="DIR",
        help="record member 0 with py-spy (threads and consumer processes, raw collapsed "
        "stacks) from the first event applied to the last, into DIR/<run>.txt (py-spy from "
        "$PYSPY or PATH)",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch
    from bench_ingest import distinct_users, produce

    from models.recommender import MemoryRecommender
    from recmem.config import Config, load_config
    from recmem.modelstore import save_model
    from recmem.producing import open_stream
    from recmem.vocab import ItemVocab
    from streams.admin import end_offsets, ensure_topics
    from streams.broker import EmbeddedBroker
    from tests.cluster import Cluster

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    members = [int(x) for x in args.members.split(",")]
    replays = [int(x) for x in args.replay.split(",")]
    clients = [x for x in args.clients.split(",") if x] or [""]
    from streams.clients import CLIENTS

    if any(cl and cl not in CLIENTS for cl in clients):
        ap.error(f"--clients: each one of {', '.join(CLIENTS)}")
    cfg = load_config(None, args.set, environ={})
    stream = open_stream(args.dataset, cfg)
    n = min(args.events, stream.n_events) if args.events else stream.n_events
    n_users = distinct_users(stream, n)
    path = Path(args.json) if args.json else (
        Path(os.environ.get("OUT", ROOT / "bench" / "results")) / f"host_members_{dev}.json"
    )  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": "host_members",
        "machine": machine() + (f", {torch.cuda.get_device_name(0)}" if dev == "cuda" else ""),
        "commit": git_commit(),
        "command": " ".join(["python", "bench/host_members.py", *sys.argv[1:]]),
        "dataset": args.dataset,
        "events": n,
        "users": n_users,
        "partitions": args.partitions,
        "checkpoint_interval_s": args.interval,
        "overrides": args.set,
        "kafka_clients": [cl or cfg.kafka.client for cl in clients],
        "rank_request": f"{CANDIDATES} random candidates, k = {K}, users drawn in proportion "
        "to their ingested events (20,000 draws), RankClient (owner called directly); "
        "a warm-up cell of 3 s per N first, not recorded",
        "runs": {},
    }

    def save(complete: bool) -> None:
        result["date"] = datetime.now(UTC).isoformat(timespec="seconds")
        result["load_average_1_5_15m_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result["complete"] = complete
        write_result(path, result)

    work = Path(tempfile.mkdtemp(prefix="bench-host-"))
    say(f"{n} events of {args.dataset} ({n_users} users), {args.partitions} partitions, {dev}")
    try:
        with EmbeddedBroker(log_path=work / "broker.log", bin_dir=cfg.kafka.broker_bin_dir) as b:
            k = cfg.kafka
            k.bootstrap_servers = b.bootstrap
            k.topic, k.dead_letter_topic = "bench", "bench.dlq"
            k.partitions = args.partitions
            k.session_timeout_ms, k.heartbeat_interval_ms = 3000, 500
            k.max_past_ms = k.max_future_ms = 0
            k.metrics_port = 0
            ensure_topics(k, {k.topic: k.partitions, k.dead_letter_topic: 1})
            result["produce"] = produce(args.dataset, args.set, stream, n, k, args.produce_procs)
            say(f"produced: {result['produce']['events_per_s']} events/s")
            ends = end_offsets(k, k.topic, timeout_s=60)
            cfg.server.model_dir = str(work / "model")
            cfg.server.shutdown_grace_s = 1.0
            torch.manual_seed(cfg.train.seed)
            vocab = ItemVocab(stream.item_ids.tolist(), cfg.model.n_oov_buckets)
            model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
            save_model(cfg.server.model_dir, model, vocab, cfg)
            rng = np.random.default_rng(0)
            counts = user_counts(stream, n)  # callers rank users in proportion to activity
            users = stream.user_ids[rng.choice(len(counts), 20000, p=counts / counts.sum())]
            users_l = [str(u) for u in users.tolist()]
            items_l = [str(i) for i in stream.item_ids.tolist()]
            for client, m in [(cl, m) for cl in clients for m in members]:
                key = str(m) if len(clients) == 1 else f"{client}/{m}"
                c = Config.from_dict(cfg.to_dict())
                if client:
                    c.kafka.client = client
                c.kafka.group_id = f"bench-host-{client or 'default'}-{m}"
                c.checkpoint.dir = str(work / f"ckpt-{m}")
                c.checkpoint.interval_s = args.interval
                # each member's slab holds its share of the users, with room for skew
                share = math.ceil(n_users / m * 1.25) + 1024
                c.state.device_capacity = max(c.state.device_capacity, share)
                cluster = Cluster(c, work / f"cluster-{m}", m, metrics=True)
                run: dict[str, Any] = {"kafka_client": c.kafka.client}
                result["runs"][key] = run
                try:
                    spy = None
                    if args.profile_member:
                        spy = Path(args.profile_member) / f"{key.replace('/', '-')}.txt"
                    run["ingest"] = ingest_pass(cluster, c, n, ends, spy)
                    say(f"{key} member(s), {c.kafka.client}: {run['ingest']}")
                    save(complete=False)
                    if args.rank_seconds <= 0:
                        continue
                    addrs = [inst.address for inst in cluster.instances]
                    pids = [inst.proc.pid for inst in cluster.instances if inst.proc]
                    rank_cell(addrs, users_l, items_l, max(replays), args, pids, 3.0)
                    run["rank"] = []
                    for r in replays:
                        cell = rank_cell(addrs, users_l, items_l, r, args, pids)
                        run["rank"].append(cell)
                        say(f"{key} member(s), R={r}: {cell['throughput_rps']} req/s, "
                            f"p99 {cell['p99_ms']:.1f} ms, errors {cell['errors']}")  # fmt: skip
                        save(complete=False)
                except Exception as e:  # noqa: BLE001 - keep the runs measured so far
                    log.exception("members=%d failed", m)
                    run["error"] = f"{type(e).__name__}: {e}"
                finally:
                    run["gpu_memory_mib"] = gpu_memory_by_pid(cluster)
                    cluster.close()
                    run["member_log_errors"] = member_log_errors(cluster)
                    if args.keep_logs:
                        keep = Path(args.keep_logs) / key.replace("/", "-")
                        keep.mkdir(parents=True, exist_ok=True)
                        for inst in cluster.instances:
                            if inst.log_path.exists():
                                shutil.copy(inst.log_path, keep / inst.log_path.name)
                    shutil.rmtree(c.checkpoint.dir, ignore_errors=True)
                    shutil.rmtree(work / f"cluster-{m}", ignore_errors=True)
            runs = result["runs"]
            for client in clients:
                pre = "" if len(clients) == 1 else f"{client}/"
                ratios = ratios_last_to_first(runs, f"{pre}{members[0]}", f"{pre}{members[-1]}")
                if len(clients) == 1:
                    result.update(ratios)
                else:
                    result.setdefault("ratios_by_client", {})[client] = ratios
            if len(clients) > 1:  # each N: the other clients' ingest rate over the first's
                key = "events_per_s_first_to_last_applied"
                result["ingest_ratio_to_first_client"] = {
                    f"{cl}/{m}": round(
                        runs[f"{cl}/{m}"]["ingest"][key] / runs[f"{clients[0]}/{m}"]["ingest"][key],
                        2,
                    )
                    for cl in clients[1:]
                    for m in members
                    if "ingest" in runs[f"{cl}/{m}"] and "ingest" in runs[f"{clients[0]}/{m}"]
                }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(complete=True)


def ratios_last_to_first(runs: dict[str, Any], first: str, last: str) -> dict[str, Any]:
    """The largest N's ingest rate and rank throughput over the first N's."""
    out: dict[str, Any] = {}
    if "ingest" in runs.get(first, {}) and "ingest" in runs.get(last, {}):
        key = "events_per_s_first_to_last_applied"
        out["ingest_ratio_last_to_first"] = round(
            runs[last]["ingest"][key] / runs[first]["ingest"][key], 2
        )
    if runs.get(first, {}).get("rank") and runs.get(last, {}).get("rank"):
        out["rank_ratio_last_to_first"] = {
            str(a["replay_notes"]): round(b["throughput_rps"] / a["throughput_rps"], 2)
            for a, b in zip(runs[first]["rank"], runs[last]["rank"])
            if a["throughput_rps"]
        }
    return out


def user_counts(stream: Any, n: int) -> np.ndarray:
    """Events per user code in the stream's first ``n`` events."""
    codes, taken = [], 0
    for c in stream.chunks(1 << 16):
        codes.append(c.user[: n - taken])
        taken += len(codes[-1])
        if taken >= n:
            break
    return np.bincount(np.concatenate(codes)).astype(np.float64)


if __name__ == "__main__":
    main()
