"""Several `recmem serve` processes in one consumer group on the embedded broker, for the
scale-out tests (tests/test_scaleout.py) and the handoff benchmark (bench/scaleout.py).

Every process is a real ``python -m recmem.cli serve`` with its own gRPC port on
127.0.0.1, its own spill directory and log file, sharing the model and the checkpoint root
(a directory or a bucket of the S3 emulator). ``Cluster`` starts, signals and always kills
them (``close`` in a finally block); waits raise with the log tail of a process that exited
on its own.

``ml100k_setup`` builds the test's model (random weights over ML-100K's catalog, small
state: the scale-out mechanics do not depend on training) and sends the first ``limit``
events of ML-100K in time order; ``reference`` is the single-process run the cluster must
equal: every event through one in-process engine, ranked by its Ranker. ``Prober`` keeps
ranking users through some members while the group changes and records every answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import torch

from models.recommender import MemoryRecommender
from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.checkpoint import CheckpointStore, checkpoint_root
from recmem.config import Config, DataConfig
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.modelstore import save_model
from recmem.ranking import RankQuery
from recmem.state_store import StateLayout
from recmem.vocab import ItemVocab
from streams.admin import end_offsets
from streams.broker import free_port
from streams.codec import action_from_wire, make_event
from streams.partitioner import partition_for
from streams.producer import EventProducer
from streams.validate import ValidEvent

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RECMEM_TEST_CACHE", "~/.cache/recmem")).expanduser()
REQUEST_TS = 900_000_000_000
"""Rank requests ask at this time (after ML-100K's last event), so answers compare."""


def scaleout_config(tmp_path: Path, kafka: Any, *, dims: str = "small") -> Config:
    """The configuration every process of a test cluster shares (small state by default)."""
    cfg = Config()
    if dims == "small":
        cfg.memory.n_layers = 2
        cfg.memory.n_heads = 2
        cfg.memory.key_dim = 8
        cfg.memory.value_dim = 8
        cfg.memory.n_blocks = 4
        cfg.memory.horizon = 32
        cfg.model.embed_dim = 16
        cfg.model.n_oov_buckets = 8
        cfg.archive.address_dim = 4
    cfg.kafka = kafka
    cfg.kafka.max_poll_records = 2048
    cfg.state.spill_dir = str(tmp_path / "spill")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.checkpoint.interval_s = 0.5
    cfg.server.model_dir = str(tmp_path / "model")
    cfg.server.metrics_port = 0
    cfg.server.replay_cache_users = 0
    cfg.server.shutdown_grace_s = 1.0
    cfg.server.freeze_gc = False
    cfg.data.cache_dir = str(CACHE)
    return cfg


@dataclass
class Workload:
    events: list[Any]
    """The Event messages sent, in order."""
    counts: dict[str, int]
    """Events per user (each user's true position once everything is applied)."""
    ends: dict[int, int]
    """Per partition: the offset after its last record."""


def ml100k_setup(cfg: Config, limit: int = 0, seed: int = 0) -> Workload:
    """Save the test model in ``server.model_dir`` (ML-100K's catalog, TRAIN-less popularity
    from the sent events) and send the first ``limit`` (0: all) events of ML-100K."""
    from recmem.datasets import load_dataset

    data = load_dataset("ml-100k", DataConfig(cache_dir=str(CACHE)))
    rows = data.events.select(["user_id", "item_id", "ts_ms", "action", "value"]).rows()
    if limit:
        rows = rows[:limit]
    items = sorted({r[1] for r in rows}, key=lambda x: (len(x), x))
    vocab = ItemVocab(items, cfg.model.n_oov_buckets)
    torch.manual_seed(seed)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    counts_per_item = np.bincount(vocab.encode(r[1] for r in rows), minlength=vocab.n_items)
    popularity = counts_per_item[: vocab.n_items].astype(np.float32).tolist()
    save_model(cfg.server.model_dir, model, vocab, cfg, {"popularity": popularity})
    events = [make_event(u, i, ts, a, v) for u, i, ts, a, v in rows]
    with EventProducer(cfg.kafka) as producer:
        producer.send(events, progress=False)
    counts: dict[str, int] = {}
    for e in events:
        counts[e.user_id] = counts.get(e.user_id, 0) + 1
    return Workload(events, counts, end_offsets(cfg.kafka))


def reference(cfg: Config, work: Workload, spill: Path) -> BuiltEngine:
    """Every event through one in-process engine (the single-process run), not started."""
    ref_cfg = Config.from_dict(cfg.to_dict())
    ref_cfg.state.spill_dir = str(spill)
    ref_cfg.state.device_capacity = max(4096, len(work.counts))
    built = build_engine(ref_cfg, device="cpu", start=False)
    valid = [
        ValidEvent(e.user_id, e.item_id, e.ts_ms, action_from_wire(e.action), e.value, None,
                   partition_for(e.user_id, cfg.kafka.partitions), k)
        for k, e in enumerate(work.events)
    ]  # fmt: skip
    for start in range(0, len(valid), 2000):
        built.engine.apply(valid[start : start + 2000])
    return built


def reference_ranks(built: BuiltEngine, users: Sequence[str], k: int = 10) -> dict[str, Any]:
    """user -> (item ids, scores, position) from the reference's Ranker."""
    out = {}
    ids = built.vocab.item_ids
    for start in range(0, len(users), 64):
        chunk = users[start : start + 64]
        results = built.ranker.rank([RankQuery(u, k=k, request_ts_ms=REQUEST_TS) for u in chunk])
        for u, r in zip(chunk, results):
            out[u] = ([ids[int(i)] for i in r.items], np.asarray(r.scores), r.position)
    return out


def assert_same_ranking(got: rank_pb2.RankResponse, want: tuple, user: str, tol=1e-4) -> None:
    """Same position; the same items with scores within ``tol`` (two items whose scores are
    within ``tol`` of each other may come in either order)."""
    items, scores, position = want
    assert got.position == position, f"{user}: position {got.position}, want {position}"
    got_items = [i.item_id for i in got.items]
    got_scores = np.array([i.score for i in got.items])
    assert len(got_items) == len(items), user
    np.testing.assert_allclose(got_scores, scores, atol=tol, rtol=0, err_msg=user)
    for j, (a, b) in enumerate(zip(got_items, items)):
        if a != b:
            near = [scores[m] for m in range(len(items)) if abs(scores[m] - scores[j]) <= tol]
            assert len(near) > 1, f"{user}: item {j} is {a}, want {b} (no tie)"


def checkpoints(cfg: Config) -> CheckpointStore:
    from recmem.blobstore import S3Settings

    ck = cfg.checkpoint
    return CheckpointStore(
        checkpoint_root(ck.dir, cfg.kafka.topic, cfg.kafka.group_id),
        StateLayout.from_config(cfg.memory, cfg.model),
        s3=S3Settings(ck.s3_endpoint_url, ck.s3_region),
    )


def assert_checkpoints_equal(cfg: Config, ref: BuiltEngine, counts: dict[str, int]) -> None:
    """Every partition's restore point holds each user's true position (0 lost, 0 applied
    twice) and the reference's state within rtol 1e-4, atol 1e-5."""
    store = checkpoints(cfg)
    seen: set[str] = set()
    for p in range(cfg.kafka.partitions):
        ckpt = store.restore(p)
        assert ckpt is not None, f"partition {p} has no checkpoint"
        assert not seen & set(ckpt.user_ids)
        seen |= set(ckpt.user_ids)
        want = ref.engine.snapshot(ckpt.user_ids)
        got = ckpt.state
        assert got.pos.tolist() == [counts[u] for u in ckpt.user_ids], f"partition {p}"
        assert torch.equal(got.last_ts, want.last_ts)
        for name in ("S", "M", "h"):
            a, b = getattr(got, name), getattr(want, name)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert seen == set(counts)


@dataclass
class Instance:
    index: int
    port: int
    config_path: Path
    log_path: Path
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Cluster:
    """``n`` serve processes over ``cfg`` (each with its own port, spill dir and log;
    ``metrics``: each its own ``server.metrics_port`` too, ``Instance.metrics_port``)."""

    cfg: Config
    workdir: Path
    n: int
    env: dict[str, str] = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)
    metrics: bool = False

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            port = free_port()
            c = Config.from_dict(self.cfg.to_dict())
            c.server.port = port
            c.server.advertised_address = f"127.0.0.1:{port}"
            c.state.spill_dir = str(self.workdir / f"spill-{i}")
            c.server.metrics_port = free_port() if self.metrics else 0
            path = self.workdir / f"serve-{i}.toml"
            path.write_text(c.to_toml())
            self.instances.append(
                Instance(i, port, path, self.workdir / f"serve-{i}.log", c.server.metrics_port)
            )
        self._channels: dict[int, grpc.Channel] = {}

    def start(self, i: int) -> Instance:
        inst = self.instances[i]
        # the repository first, then whatever the caller's path holds (carried wheels)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, **self.env}
        cmd = [sys.executable, "-m", "recmem.cli", "serve", "--config", str(inst.config_path)]
        with open(inst.log_path, "ab") as log:
            inst.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
        return inst

    def start_all(self) -> None:
        for i in range(self.n):
            self.start(i)

    def alive(self, i: int) -> bool:
        inst = self.instances[i]
        if inst.proc is None:
            return False
        if inst.proc.poll() is not None:
            raise AssertionError(
                f"serve {i} exited with {inst.proc.returncode}:\n{inst.log()[-4000:]}"
            )
        return True

    def signal(self, i: int, sig: int) -> None:
        proc = self.instances[i].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def kill(self, i: int) -> None:
        proc = self.instances[i].proc
        self.instances[i].proc = None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=15)
        self._drop_channel(i)

    def stop(self, i: int, timeout_s: float = 60.0) -> int:
        """SIGTERM (final checkpoints, leave the group); the exit status."""
        proc = self.instances[i].proc
        self.instances[i].proc = None
        self._drop_channel(i)
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
            raise AssertionError(f"serve {i} did not stop on SIGTERM") from None

    def close(self) -> None:
        for i, inst in enumerate(self.instances):
            if inst.proc is not None and inst.proc.poll() is None:
                inst.proc.send_signal(signal.SIGCONT)
            self.kill(i)

    def stub(self, i: int) -> Any:
        ch = self._channels.get(i)
        if ch is None:
            ch = self._channels[i] = grpc.insecure_channel(self.instances[i].address)
        return rank_pb2_grpc.RecMemStub(ch)  # type: ignore[no-untyped-call]

    def _drop_channel(self, i: int) -> None:
        ch = self._channels.pop(i, None)
        if ch is not None:
            ch.close()

    def routing(self, i: int) -> rank_pb2.RoutingResponse | None:
        try:
            return self.stub(i).Routing(rank_pb2.RoutingRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def live(self) -> list[int]:
        return [i for i, inst in enumerate(self.instances) if inst.proc is not None]

    def wait(self, pred: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Wait for ``pred``, checking that every started process still runs; seconds."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            for i in self.live():
                self.alive(i)
            if pred():
                return time.monotonic() - began
            time.sleep(0.1)
        logs = "\n".join(f"--- serve {i}\n{self.instances[i].log()[-2000:]}" for i in self.live())
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{logs}")

    def settled(self, members: int) -> bool:
        """The live members agree on one generation in which they own every partition."""
        maps = [self.routing(i) for i in self.live()]
        if any(m is None for m in maps) or len(maps) != members:
            return False
        gens = {m.generation for m in maps if m is not None}
        first = maps[0]
        assert first is not None
        owners = {o.address for o in first.owners}
        return (
            len(gens) == 1
            and len(first.owners) == self.cfg.kafka.partitions
            and owners == {self.instances[i].address for i in self.live()}
        )

    def owners(self, via: int | None = None) -> dict[int, int]:
        """partition -> instance index, from member ``via``'s map (default the first live
        one); {} when it does not answer."""
        by_address = {inst.address: inst.index for inst in self.instances}
        m = self.routing(self.live()[0] if via is None else via)
        if m is None:
            return {}
        return {o.partition: by_address[o.address] for o in m.owners}

    def rank_all(
        self, i: int, users: Sequence[str], threads: int = 4, k: int = 10
    ) -> dict[str, Any]:
        """Rank every user through instance ``i`` (forwarded where it is not the owner)."""
        stub = self.stub(i)

        def one(user: str) -> Any:
            return stub.Rank(
                rank_pb2.RankRequest(user_id=user, k=k, request_ts_ms=REQUEST_TS), timeout=30
            )

        with ThreadPoolExecutor(threads) as pool:
            return dict(zip(users, pool.map(one, users)))


class Answer(NamedTuple):
    """One probed Rank call: seconds since the probe started, the user, the status code's
    name, the answer's position and cold-start flag (-1, False unless OK), and whether an
    UNAVAILABLE carried a retry hint (grpc-retry-pushback-ms > 0)."""

    t: float
    user: str
    code: str
    position: int
    cold_start: bool
    hint: bool


class Prober:
    """Threads that keep ranking ``users`` through ``members`` in turn, pausing ``pause_s``
    after each call, and record every answer (``Answer``)."""

    def __init__(
        self,
        cluster: Cluster,
        members: list[int],
        users: list[str],
        threads: int = 3,
        pause_s: float = 0.0,
    ) -> None:
        self.cluster, self.members, self.users, self.pause_s = cluster, members, users, pause_s
        self.records: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self._threads = [
            threading.Thread(target=self._run, args=(k, threads), daemon=True)
            for k in range(threads)
        ]

    def start(self) -> Prober:
        for t in self._threads:
            t.start()
        return self

    def _run(self, k: int, n: int) -> None:
        mine = self.users[k::n]
        j = 0
        while not self._stop.is_set() and mine:
            user = mine[j % len(mine)]
            member = self.members[j % len(self.members)]
            j += 1
            request = rank_pb2.RankRequest(user_id=user, k=5, request_ts_ms=REQUEST_TS)
            try:
                res = self.cluster.stub(member).Rank(request, timeout=5)
                rec = Answer(time.monotonic() - self.t0, user, "OK", res.position,
                             res.cold_start, False)  # fmt: skip
            except grpc.RpcError as e:
                md = dict(e.trailing_metadata() or ())
                hint = int(md.get("grpc-retry-pushback-ms", "0")) > 0
                code = e.code().name
                rec = Answer(time.monotonic() - self.t0, user, code, -1, False, hint)
            with self._lock:
                self.records.append(rec)
            time.sleep(self.pause_s)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        return self.answers()

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self.records)

    def first_right(self, counts: dict[str, int], since: float) -> dict[str, float]:
        """Per user: the first time after ``since`` it was answered OK at its true
        position."""
        out: dict[str, float] = {}
        for a in self.answers():
            if a.t >= since and a.code == "OK" and a.position == counts[a.user]:
                out.setdefault(a.user, a.t)
        return out


def restored_lines(log: str) -> list[int]:
    """Partitions a serve log says it restored, in order ("partition N: restored ...")."""
    out = []
    for line in log.splitlines():
        if ": restored " in line and "partition " in line:
            part = line.split("partition ", 1)[1].split(":", 1)[0]
            if part.isdigit():
                out.append(int(part))
    return out


def caught_up(cfg: Config, ends: dict[int, int]) -> bool:
    """Every partition's restore point is at its end offset."""
    store = checkpoints(cfg)
    return all(store.latest_offset(p) == ends.get(p, 0) for p in range(cfg.kafka.partitions))
