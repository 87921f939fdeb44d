"""Rank latency and throughput of the gRPC service on loopback, against a SASRec service.

    .venv/bin/python bench/bench_rank.py [--users N] [--events N] [--items N] [--seconds S]
        [--device auto|cpu|cuda] [--threads N] [--concurrency 1,8,32] [--replay 0,2,4]
        [--shapes cand100,catalog] [--systems memory,sasrec] [--budget-s S]
        [--replay-cache N] [--ingest-rate EV_PER_S] [--client-procs N]
        [--set section.field=value ...]
        [--out DIR | --json PATH]

A server process builds the real engine (``recmem.engine.builder.build_engine``: state
store, NoteBank, Ranker, engine loop) on the default memory configuration with a freshly
initialised model (latency does not depend on training), ingests synthetic Zipf histories
through ``Engine.apply`` (notes are written as at ingest) before starting the loop, and
serves two RecMem services: the memory model, and the SASRec baseline that re-encodes each
request's user's last 200 events (a micro-batch's windows left-padded into one forward;
``SASRecRanker(per_request=True)``: one ``SASRec.encode_history`` per request, as before)
behind an engine loop of its own (the same micro-batching) and the same servicer. The client process runs
closed-loop load at each concurrency for each request shape: 100 candidates (k=10) and
whole-catalog top-10, replay off and on (R = 2, 4). SASRec has no notes, so each memory
cell is compared with SASRec on the same request shape and concurrency. The replay cache
(``server.replay_cache_users``) is off unless ``--replay-cache N``: no events arrive while
the cells run, so with it every replay request after a user's first is answered from the
cache and the cells would not measure replay. ``--ingest-rate R`` applies R events/s
(random users, through the engine loop, as ``recmem serve``'s ingest) while
the cells run: rank latency under ingest, and with the cache the share of replay requests
it answers (each cell records ``replay_cache_hit_share`` and ``events_ingested``). The
flags above
pick a subset of cells; ``--budget-s`` shortens the cells so that the whole run, start-up
and ingest included, fits in S seconds (the full plan on the H200: ``--budget-s 200``).

Writes PATH, else DIR/rank_<cpu|gpu>.json (DIR = $OUT, else bench/results): machine, date,
commit, 1-minute load average at start, per cell and at the end, configuration, one row per
cell (p50/p99/mean ms, throughput, mean micro-batch size) and the SASRec/memory ratios, then
prints a table. The goal checked: CPU p99 <= 30 ms at concurrency 8 (GPU: p99 <= 10 ms at
100 candidates with replay).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from benchinfo import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONCURRENCY = (1, 8, 32)
SHAPE_NAMES = ("cand100", "catalog")
REPLAY = (0, 2, 4)
SERVER_FIELDS = (
    "batch_window_ms",
    "adaptive_window",
    "max_batch",
    "threads",
    "replay_query_events",
    "replay_cache_users",
    "cuda_graphs",
)
K = 10
N_CANDIDATES = 100
SASREC_WINDOW = 200


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


# ---- server process ----------------------------------------------------------------------


class SASRecRanker:
    """The baseline behind the same servicer: per micro-batch, re-encode each user's last 200
    events (plus the request's context) as one left-padded window, all windows in one SASRec
    forward, then score (``per_request=True``: one forward per request, the form of the
    runs before 2026-12-02)."""

    def __init__(
        self, model: Any, history: dict[str, np.ndarray], per_request: bool = False
    ) -> None:
        import torch

        self.model = model
        self.history = history
        self.per_request = per_request
        self.device = next(model.parameters()).device
        self.n_items = model.n_items
        self._torch = torch

    def _windows(self, queries: Sequence[Any]) -> tuple[list[np.ndarray], list[int]]:
        seqs, hist_lens = [], []
        for q in queries:
            hist = self.history.get(q.user_id, np.zeros(0, np.int64))
            seq = np.concatenate([hist, q.context.items])[-SASREC_WINDOW:]
            seqs.append(seq if len(seq) else np.zeros(1, np.int64))
            hist_lens.append(len(hist))
        return seqs, hist_lens

    def _vectors(self, seqs: Sequence[np.ndarray]) -> Any:
        """[B, D] user vectors: one forward over the left-padded windows (or one per
        window with ``per_request``)."""
        torch = self._torch
        if self.per_request:
            return torch.stack(
                [self.model.encode_history(torch.as_tensor(s, device=self.device)) for s in seqs]
            )
        T = max(len(s) for s in seqs)
        w = np.full((len(seqs), T), self.model.pad, np.int64)
        for i, s in enumerate(seqs):
            w[i, T - len(s) :] = s
        self.model.eval()
        return self.model(torch.as_tensor(w, device=self.device))[:, -1]

    def _top(self, q: Any, vec: Any) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        if q.candidates is None:
            val, idx = torch.topk(self.model.score(vec[None])[0], min(q.k, self.n_items))
        else:
            cand = torch.as_tensor(q.candidates, device=self.device)
            val, pos = torch.topk(self.model.score(vec[None], cand[None])[0], min(q.k, len(cand)))
            idx = cand[pos]
        return idx.cpu().numpy(), val.cpu().numpy()

    def rank(self, queries: Sequence[Any]) -> list[Any]:
        from recmem.ranking import RankResult

        torch = self._torch
        out = []
        with torch.no_grad():
            seqs, hist_lens = self._windows(queries)
            vecs = self._vectors(seqs)
            same = {None if q.candidates is None else len(q.candidates) for q in queries}
            if not self.per_request and len(same) == 1 and None not in same:
                # Equal candidate lists (the benchmark's shape): score and top-k at once.
                cand = torch.as_tensor(np.stack([q.candidates for q in queries]))
                cand = cand.to(self.device)
                k = min(max(q.k for q in queries), cand.shape[1])
                val, pos = torch.topk(self.model.score(vecs, cand), k)
                idx, val = torch.gather(cand, 1, pos).cpu().numpy(), val.cpu().numpy()
                top = [(idx[i, : q.k], val[i, : q.k]) for i, q in enumerate(queries)]
            else:
                top = [self._top(q, v) for q, v in zip(queries, vecs, strict=True)]
            for q, (idx, val), n_hist in zip(queries, top, hist_lens, strict=True):
                out.append(RankResult(idx, val, n_hist, n_hist == 0, 0, len(q.context)))
        return out


def synthetic_histories(
    n_users: int, events: int, n_items: int, seed: int
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Zipf item popularity, 1-10 min gaps; lengths uniform in [events/2, 3*events/2]."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_items + 1) ** 0.8
    p /= p.sum()
    out = {}
    for u in range(n_users):
        n = int(rng.integers(events // 2, 3 * events // 2 + 1))
        items = rng.choice(n_items, size=n, p=p).astype(np.int64)
        actions = rng.integers(0, 6, n).astype(np.int64)
        ts = (1_600_000_000_000 + np.cumsum(rng.integers(60_000, 600_000, n))).astype(np.int64)
        out[f"u{u}"] = (items, actions, ts)
    return out


def build_memory_stack(args: argparse.Namespace) -> dict[str, Any]:
    """The memory service's engine on the default configuration (plus ``args.set``) with a
    freshly initialised model, after ingesting the synthetic histories through
    ``Engine.apply`` (the loop not started yet): keys cfg, built, vocab, hist, popularity,
    device, ingest."""
    import torch

    from models.recommender import MemoryRecommender
    from recmem.config import Config, set_value
    from recmem.engine.builder import build_engine
    from recmem.ranking import train_popularity
    from recmem.vocab import ItemVocab
    from streams.validate import ValidEvent

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = Config()
    cfg.server.port = 0
    cfg.state.device_capacity = args.users  # the default slab (65536 users) is ~17 GB
    cfg.state.spill_dir = args.spill_dir
    # every request replays unless asked: the cache would answer all but the first request
    # per user here (no events arrive while the cells run)
    cfg.server.replay_cache_users = getattr(args, "replay_cache", 0)
    for item in args.set:
        key, _, value = item.partition("=")
        set_value(cfg, key.strip(), value.strip(), "--set")
    vocab = ItemVocab([f"item{i}" for i in range(args.items)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(args.items, cfg.model.n_oov_buckets, cfg.memory, cfg.model)
    model = model.to(device).eval()
    hist = synthetic_histories(args.users, args.events, args.items, seed=1)
    popularity = train_popularity(np.concatenate([h[0] for h in hist.values()]), args.items)
    built = build_engine(
        cfg, model=model, vocab=vocab, model_version="bench-memory", popularity=popularity,
        device=device, start=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    n_events = 0
    longest = max(len(h[0]) for h in hist.values())
    for start in range(0, longest, 64):
        batch = [
            ValidEvent(u, vocab.item_ids[it[i]], int(ts[i]), int(ac[i]), 1.0, None, 0, i)
            for u, (it, ac, ts) in hist.items()
            for i in range(start, min(start + 64, len(it)))
        ]
        built.engine.apply(batch)
        n_events += len(batch)
    ingest_s = time.perf_counter() - t0
    bank = built.engine.bank
    notes = sum(bank.note_count(u) for u in hist) if bank is not None else 0
    return {
        "cfg": cfg,
        "built": built,
        "vocab": vocab,
        "hist": hist,
        "popularity": popularity,
        "device": device,
        "ingest": {"events": n_events, "seconds": ingest_s, "notes": notes},
    }


class IngestFeed:
    """Events arriving while the cells run: a thread applies ``rate`` events/s (batches every
    20 ms, users uniform, Zipf items, each user's clock moving on) through the engine
    loop, as ``recmem serve``'s Kafka adapter hands them over."""

    def __init__(self, loop: Any, vocab: Any, hist: dict[str, Any], n_items: int,
                 rate: float) -> None:  # fmt: skip
        self.loop, self.vocab, self.rate = loop, vocab, rate
        self.users = list(hist)
        self.clock = {u: int(h[2][-1]) for u, h in hist.items()}
        self.offset = {u: len(h[0]) for u, h in hist.items()}
        p = 1.0 / np.arange(1, n_items + 1) ** 0.8
        self.p = p / p.sum()
        self.applied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-ingest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from streams.validate import ValidEvent

        rng = np.random.default_rng(7)
        tick = 0.02
        owed = 0.0
        while not self._stop.wait(tick):
            owed += self.rate * tick
            n = int(owed)
            owed -= n
            if n == 0:
                continue
            batch = []
            for u in rng.choice(self.users, n):
                self.clock[u] += int(rng.integers(60_000, 600_000))
                self.offset[u] += 1
                item = self.vocab.item_ids[int(rng.choice(len(self.p), p=self.p))]
                batch.append(ValidEvent(u, item, self.clock[u], int(rng.integers(0, 6)), 1.0,
                                        None, 0, self.offset[u]))  # fmt: skip
            self.loop.apply(batch)
            self.applied += n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def serve(args: argparse.Namespace, conn: Any) -> None:
    """Child process: build, ingest, serve both services, answer control messages."""
    import torch

    from models.sasrec import SASRec, SASRecConfig
    from recmem.engine import EngineLoop
    from recmem.server.app import RankServer

    made = build_memory_stack(args)
    cfg, built, vocab, hist = made["cfg"], made["built"], made["vocab"], made["hist"]
    device = made["device"]
    sasrec = SASRec(args.items, cfg.model.n_oov_buckets, SASRecConfig()).to(device).eval()
    sas_hist = {u: h[0][-SASREC_WINDOW:] for u, h in hist.items()}
    memory_server = RankServer(cfg, built.loop.start(), vocab, built.model_version).start()
    sas_ranker = SASRecRanker(sasrec, sas_hist)
    s = cfg.server
    sas_loop = EngineLoop(
        sas_ranker, window_ms=s.batch_window_ms, max_batch=s.max_batch, adaptive=s.adaptive_window
    ).start()
    sas_server = RankServer(cfg, sas_loop, vocab, "bench-sasrec")
    sas_server.start()
    conn.send(
        {
            "memory_port": memory_server.port,
            "sasrec_port": sas_server.port,
            "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name(),
            "torch_threads": torch.get_num_threads(),
            "ingest": made["ingest"],
            "config": {
                "memory": cfg.to_dict()["memory"],
                "model": cfg.to_dict()["model"],
                "archive": cfg.to_dict()["archive"],
                "server": {k: cfg.to_dict()["server"][k] for k in SERVER_FIELDS},
                "sasrec": {"max_len": SASREC_WINDOW, "embed_dim": sasrec.cfg.embed_dim,
                           "n_layers": sasrec.cfg.n_layers},
            },
        }
    )  # fmt: skip
    servers = {"memory": memory_server, "sasrec": sas_server}
    feed = (
        IngestFeed(built.loop, vocab, hist, args.items, args.ingest_rate)
        if args.ingest_rate
        else None
    )
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        b = servers[msg].loop.counts
        steps = dict(built.ranker.seconds) if msg == "memory" else {}
        conn.send(
            {
                "batches": b.batches,
                "requests": b.requests,
                "busy_s": b.busy_seconds,
                "collect_s": b.collect_seconds,
                "steps": steps,
                "cache": dict(built.ranker.cache_counts),
                "ingested": feed.applied if feed is not None else 0,
            }
        )
    if feed is not None:
        feed.stop()
    for srv in servers.values():
        srv.stop(grace=1.0)
    sas_loop.stop()
    built.close()


# ---- client ------------------------------------------------------------------------------


def _client_load(
    port: int, workers: list[int], shape: str, replay: int, start_at: float, seconds: float,
    users: int, n_items: int, seed: int, batch: int = 0,
) -> tuple[list[float], list[int], float]:  # fmt: skip
    """Closed-loop load from one process: a thread per worker id on one channel, from
    wall-clock ``start_at`` for ``seconds``; returns latencies (s), the notes replayed by
    worker 0's first 64 calls, and this process's CPU seconds over the timed window (the
    client's own cost, to tell whether the client bounds a cell). ``batch`` > 0: each call
    is a RankBatch of that many requests, and its latency is recorded once per request it
    answered."""
    import grpc

    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc

    def request(rng: np.random.Generator) -> Any:
        cands = []
        if shape == "cand100":
            cands = [f"item{i}" for i in rng.choice(n_items, N_CANDIDATES, replace=False)]
        return rank_pb2.RankRequest(
            user_id=f"u{rng.integers(users)}",
            k=K,
            candidate_item_ids=cands,
            replay=rank_pb2.ReplayOptions(enabled=replay > 0, notes=replay),
        )

    latencies: list[list[float]] = [[] for _ in workers]
    notes: list[int] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rank_pb2_grpc.RecMemStub(ch)
        rng0 = np.random.default_rng(seed + workers[0])
        for _ in range(3):  # warm up the channel and the path
            stub.Rank(request(rng0), timeout=60)
        stop_at = start_at + seconds

        def worker(slot: int, i: int) -> None:
            rng = np.random.default_rng(seed * 1000 + i)
            reqs = [request(rng) for _ in range(64)]
            time.sleep(max(0.0, start_at - time.time()))
            j = 0
            while time.time() < stop_at:
                t = time.perf_counter()
                if batch:
                    part = [reqs[(j + n) % len(reqs)] for n in range(batch)]
                    got = stub.RankBatch(rank_pb2.RankBatchRequest(requests=part), timeout=60)
                    if any(r.code for r in got.results):
                        raise RuntimeError(f"RankBatch failed: {got.results[0].message}")
                    latencies[slot] += [time.perf_counter() - t] * batch
                    res = got.results[0].response
                else:
                    res = stub.Rank(reqs[j % len(reqs)], timeout=60)
                    latencies[slot].append(time.perf_counter() - t)
                if i == 0 and j < 64:
                    notes.append(res.notes_replayed)
                j += max(batch, 1)

        threads = [
            threading.Thread(target=worker, args=(slot, i)) for slot, i in enumerate(workers)
        ]
        for t in threads:
            t.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = time.process_time()
        for t in threads:
            t.join()
        cpu = time.process_time() - cpu0
    return [x for xs in latencies for x in xs], notes, cpu


def _client_process(args: tuple[Any, ...], out: Any) -> None:
    out.put(_client_load(*args))


def run_cell(
    port: int, concurrency: int, shape: str, replay: int, seconds: float, users: int,
    n_items: int, seed: int, procs: int = 1, batch: int = 0,
    window: Callable[[float, float], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One cell: ``concurrency`` closed-loop workers as threads of this process, or spread
    over ``procs`` client processes (independent clients: no shared GIL between them).
    ``window``, if given, is called first with the timed window's wall-clock start and end
    (``time.time()``), for a caller that samples the server over the same span."""
    procs = max(1, min(procs, concurrency))
    groups = [list(range(concurrency))[p::procs] for p in range(procs)]
    lead = 1.0 if procs == 1 else 4.0  # time to start the processes and warm up
    start_at = time.time() + lead
    if window is not None:
        window(start_at, start_at + seconds)
    if procs == 1:
        lat_s, notes, client_cpu = _client_load(port, groups[0], shape, replay, start_at,
                                                seconds, users, n_items, seed, batch)  # fmt: skip
    else:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        ps = [
            ctx.Process(target=_client_process, daemon=True, args=(
                (port, g, shape, replay, start_at, seconds, users, n_items, seed, batch), out))
            for g in groups
        ]  # fmt: skip
        for p in ps:
            p.start()
        results = [out.get(timeout=seconds + 120) for _ in ps]
        for p in ps:
            p.join(30)
        lat_s = [x for r in results for x in r[0]]
        notes = [x for r in results for x in r[1]]
        client_cpu = sum(r[2] for r in results)
    lat = np.array(lat_s) * 1000.0
    return {
        "requests": int(len(lat)),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "mean_ms": float(lat.mean()),
        "throughput_rps": float(len(lat) / seconds),
        "mean_notes_replayed": float(np.mean(notes)) if notes else 0.0,
        "client_processes": procs,
        "client_cores_busy": client_cpu / seconds,
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown name(s) {bad}; choose from {list(allowed)}")
    return out


def plan(args: argparse.Namespace) -> list[tuple[str, int, str, int, int]]:
    """(system, concurrency, shape, R, RankBatch size) per cell, in run order; SASRec gets
    R = 0 only."""
    cells = []
    for system in args.systems:
        for c in args.concurrency:
            for shape in args.shapes:
                for replay in args.replay if system == "memory" else (0,):
                    for batch in args.rank_batch:
                        cells.append((system, c, shape, replay, batch))
    return cells


def table(cells: Sequence[dict[str, Any]]) -> str:
    """Markdown table: one row per memory cell with the SASRec cell of the same shape and c."""
    sas = {
        (x["concurrency"], x["shape"], x["rank_batch"]): x for x in cells if x["system"] == "sasrec"
    }
    head = (
        "| c | request | memory p50 / p99 ms | memory req/s | batch | SASRec p50 / p99 ms "
        "| SASRec req/s | SASRec/memory p99 | load 1m |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    mem = [x for x in cells if x["system"] == "memory"] or list(sas.values())
    for x in mem:
        shape = "100 cand." if x["shape"] == "cand100" else "catalog"
        req = f"{shape}, " + (f"R={x['replay_notes']}" if x["replay_notes"] else "no replay")
        if x["rank_batch"]:
            req += f", RankBatch of {x['rank_batch']}"
        b = sas.get((x["concurrency"], x["shape"], x["rank_batch"]))
        base = (
            f"{b['p50_ms']:.1f} / {b['p99_ms']:.1f} | {b['throughput_rps']:.0f} | "
            f"{b['p99_ms'] / x['p99_ms']:.2f}"
            if b is not None and x["system"] == "memory"
            else "- | - | -"
        )
        rows.append(
            f"| {x['concurrency']} | {req} | {x['p50_ms']:.1f} / {x['p99_ms']:.1f} | "
            f"{x['throughput_rps']:.0f} | {x['mean_batch']:.1f} | {base} | "
            f"{x['load_avg_1m']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    from models.memory.ops import flush_denormals

    flush_denormals()  # as `recmem` does at start (the CPU scan also sets it per thread)
    wall = time.perf_counter()
    load_start = os.getloadavg()[0]
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--events", type=int, default=300, help="mean events per user")
    ap.add_argument("--items", type=int, default=3706, help="catalog size (ML-1M: 3706)")
    ap.add_argument("--seconds", type=float, default=2.0, help="measurement time per cell")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="whole-run wall budget: cells get min(--seconds, what is left / cells) (0 = off)",
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads in the server (0 = torch default; default: 1 on the "
        "CPU, where one thread avoids OpenMP stalls on a small shared machine, else 0)",
    )
    ap.add_argument("--concurrency", type=_ints, default=CONCURRENCY, help="e.g. 1,8,32")
    ap.add_argument("--replay", type=_ints, default=REPLAY, help="R values, 0 = off; e.g. 0,2,4")
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES), help="cand100,catalog")
    ap.add_argument("--systems", default="memory,sasrec", help="memory,sasrec")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="config override in the server (e.g. server.batch_window_ms=4); repeatable",
    )
    ap.add_argument(
        "--replay-cache",
        type=int,
        default=0,
        help="server.replay_cache_users in the server (default 0: every replay request "
        "replays; with a cache every request after a user's first is a hit here)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="spread each cell's clients over this many processes (default 1: threads of "
        "one process share its GIL; on a many-core host N > 1 measures independent clients)",
    )
    ap.add_argument(
        "--ingest-rate",
        type=float,
        default=0.0,
        help="events/s applied to the memory service's engine while the cells run (0 = none; "
        "with --replay-cache this decides the cache's hit share)",
    )
    ap.add_argument(
        "--rank-batch",
        type=_ints,
        default=(0,),
        help="requests per call: 0 = Rank, N > 0 = RankBatch of N (each worker sends N per "
        "call); a list measures each in the same run, e.g. 0,32",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--json", default="", help="write the result to this file (overrides --out)")
    args = ap.parse_args()
    args.shapes = _names(args.shapes, SHAPE_NAMES)
    args.systems = _names(args.systems, ("memory", "sasrec"))
    if any(r < 0 for r in args.replay) or any(c < 1 for c in args.concurrency):
        raise SystemExit("--replay values must be >= 0 and --concurrency values >= 1")
    if any(b < 0 for b in args.rank_batch):
        raise SystemExit("--rank-batch values must be >= 0")
    todo = plan(args)
    if not todo:
        raise SystemExit("no cells selected")
    import tempfile

    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-rank-") as spill:
        args.spill_dir = spill
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(args, child), daemon=True)
        proc.start()
        try:
            info = parent.recv()
            print(
                f"server on {info['device']}: ingested {info['ingest']['events']} events "
                f"({info['ingest']['notes']} notes) in {info['ingest']['seconds']:.1f} s",
                flush=True,
            )
            seconds = args.seconds
            if args.budget_s > 0:
                left = args.budget_s - (time.perf_counter() - wall) - 10.0  # start-up, writing
                per_cell = left / len(todo) - 0.5  # warm-up calls and thread start per cell
                seconds = max(0.5, min(args.seconds, per_cell))
                print(f"{len(todo)} cells of {seconds:.2f} s (budget {args.budget_s:.0f} s)")
            for system, c, shape, replay, batch in todo:
                port = info[f"{system}_port"]
                parent.send(system)
                before = parent.recv()
                cell = run_cell(port, c, shape, replay, seconds, args.users, args.items, seed=c,
                                procs=args.client_procs, batch=batch)  # fmt: skip
                parent.send(system)
                after = parent.recv()
                n_b = after["batches"] - before["batches"]
                cell["mean_batch"] = (after["requests"] - before["requests"]) / max(n_b, 1)
                busy = after["busy_s"] - before["busy_s"]
                cell["mean_batch_ms"] = 1000.0 * busy / max(n_b, 1)
                cell["worker_busy_share"] = busy / seconds
                collect = after["collect_s"] - before["collect_s"]
                cell["mean_collect_ms"] = 1000.0 * collect / max(n_b, 1)
                cell["batch_ms_by_step"] = {
                    k: 1000.0 * (v - before["steps"][k]) / max(n_b, 1)
                    for k, v in after["steps"].items()
                }
                if system == "memory":
                    hits = after["cache"]["hits"] - before["cache"]["hits"]
                    cell["replay_cache_hits"] = hits
                    cell["replay_cache_hit_share"] = (
                        hits / max(1, cell["requests"]) if replay else 0.0
                    )
                    cell["events_ingested"] = after["ingested"] - before["ingested"]
                cell["load_avg_1m"] = os.getloadavg()[0]
                cell.update(system=system, concurrency=c, shape=shape, replay_notes=replay,
                            rank_batch=batch)  # fmt: skip
                cells.append(cell)
                print(
                    f"{system:6s} c={c:2d} {shape:7s} R={replay} B={batch}: p50 {cell['p50_ms']:6.2f}"
                    f" ms  p99 {cell['p99_ms']:6.2f} ms  {cell['throughput_rps']:7.1f}"
                    f" req/s  batch {cell['mean_batch']:.1f} ({cell['mean_batch_ms']:.1f} ms,"
                    f" busy {cell['worker_busy_share']:.0%}, collect"
                    f" {cell['mean_collect_ms']:.1f} ms)"
                    + "".join(f" {k} {v:.1f}" for k, v in cell["batch_ms_by_step"].items())
                    + f"  load {cell['load_avg_1m']:.1f}",
                    flush=True,
                )
            parent.send("stop")
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    sas = {
        (x["concurrency"], x["shape"], x["rank_batch"]): x for x in cells if x["system"] == "sasrec"
    }
    ratios = []
    for x in cells:
        base = sas.get((x["concurrency"], x["shape"], x["rank_batch"]))
        if x["system"] != "memory" or base is None:
            continue
        ratios.append(
            {
                "concurrency": x["concurrency"],
                "shape": x["shape"],
                "replay_notes": x["replay_notes"],
                "rank_batch": x["rank_batch"],
                "sasrec_over_memory_p50": base["p50_ms"] / x["p50_ms"],
                "sasrec_over_memory_p99": base["p99_ms"] / x["p99_ms"],
                "memory_over_sasrec_throughput": x["throughput_rps"] / base["throughput_rps"],
            }
        )
    gpu = info["device"].startswith("cuda")
    goal_cells = [
        x for x in cells
        if x["system"] == "memory" and not x["rank_batch"]
        and (x["concurrency"] == 8 if not gpu else (x["shape"] == "cand100" and x["replay_notes"]))
    ]  # fmt: skip
    limit = 10.0 if gpu else 30.0
    result = {
        "bench": "rank",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/bench_rank.py", *sys.argv[1:]]),
        "machine": {
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": load_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "python": platform.python_version(),
            "device": info["device"],
            "device_name": info["device_name"],
            "torch_threads": info["torch_threads"],
        },
        "setup": {
            "users": args.users,
            "mean_events_per_user": args.events,
            "items": args.items,
            "seconds_per_cell": seconds,
            "k": K,
            "candidates": N_CANDIDATES,
            "overrides": args.set,
            "ingest": info["ingest"],
            "ingest_rate_during_cells": args.ingest_rate,
            "model": "freshly initialised (latency does not depend on training)",
            **info["config"],
        },
        "cells": cells,
        "ratios": ratios,
        "goal": {
            "rule": "GPU: p99 <= 10 ms at 100 candidates with replay"
            if gpu
            else "CPU: p99 <= 30 ms at concurrency 8",
            "met": bool(goal_cells) and all(x["p99_ms"] <= limit for x in goal_cells),
            "worst_p99_ms": max((x["p99_ms"] for x in goal_cells), default=float("nan")),
            "cells": len(goal_cells),
        },
        "wall_seconds": time.perf_counter() - wall,
    }
    if args.json:
        path = Path(args.json)
    else:
        path = Path(args.out) / f"rank_{'gpu' if gpu else 'cpu'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    print()
    print(
        f"{info['device_name']} ({info['device']}), torch threads {info['torch_threads']}, "
        f"load avg {load_start:.1f} -> {result['machine']['load_avg_1m_at_end']:.1f}, "
        f"{seconds:.1f} s per cell, {result['wall_seconds']:.0f} s in all"
    )
    print(table(cells))
    print(
        f"goal ({result['goal']['rule']}): {'met' if result['goal']['met'] else 'NOT met'} "
        f"over {len(goal_cells)} cells, worst p99 {result['goal']['worst_p99_ms']:.1f} ms; "
        f"wrote {path}"
    )


if __name__ == "__main__":
    main()
