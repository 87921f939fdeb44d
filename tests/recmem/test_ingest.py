"""The ingest service against a real tansu broker: clean stop and restore, a rebalance
across two services, and the crash test (kill -9 at random points, restart, finish: every
state equals a clean single pass; nothing lost, nothing applied twice)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kafka import KafkaProducer

from models.recommender import MemoryRecommender
from recmem.checkpoint import CheckpointStore, checkpoint_root
from recmem.config import Config
from recmem.engine import Engine, EngineLoop
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.ingest import KafkaIngest, register_gauges
from recmem.modelstore import load_model, save_model
from recmem.ranking import Ranker
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab
from streams.admin import client_settings
from streams.codec import make_event
from streams.consumer import EventConsumer
from streams.validate import ValidEvent
from tests.recmem.test_engine import small_config

REPO = Path(__file__).resolve().parents[2]
BASE_TS = 1_700_000_000_000


def service_config(tmp_path: Path, kafka) -> Config:
    cfg = small_config()
    cfg.kafka = kafka
    cfg.state.device_capacity = 48  # ~200 users: the host and disk tiers are used too
    cfg.state.host_capacity = 48
    cfg.state.spill_dir = str(tmp_path / "spill")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.checkpoint.interval_s = 0.3
    cfg.server.model_dir = str(tmp_path / "model")
    torch.manual_seed(0)
    vocab = ItemVocab([f"i{j}" for j in range(30)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    save_model(cfg.server.model_dir, model, vocab, cfg)
    return cfg


def make_events(n: int, n_users: int, seed: int):
    rng = np.random.default_rng(seed)
    users = rng.integers(n_users, size=n)
    return [
        make_event(
            f"user{u}", f"i{int(rng.integers(40))}", BASE_TS + k * 1000, int(rng.integers(6)), 1.0
        )
        for k, u in enumerate(users)
    ]


def send_with_bad(
    cfg: Config, events, seed: int, n_bad: int, rate: float = 0.0, ends: dict | None = None
) -> dict[int, int]:
    """Send ``events`` in order with ``n_bad`` malformed records mixed in, at most ``rate``
    events per second (0: as fast as possible). Returns (and adds to ``ends``) the offset
    after the last record of each partition, from the broker's acknowledgements (tansu's
    ListOffsets answers one past the last record batch's first offset, not the highwater)."""
    rng = random.Random(seed)
    bad_at = set(rng.sample(range(len(events)), n_bad))
    ends = {} if ends is None else ends
    producer = KafkaProducer(acks="all", linger_ms=5, **client_settings(cfg.kafka))
    topic = cfg.kafka.topic
    futures = []

    def settle() -> None:
        for f in futures:
            md = f.get(timeout=30)
            ends[md.partition] = max(ends.get(md.partition, 0), md.offset + 1)
        futures.clear()

    start = time.monotonic()
    for k, ev in enumerate(events):
        if rate and k / rate > time.monotonic() - start:
            time.sleep(max(0.0, k / rate - (time.monotonic() - start)))
        key, value = ev.user_id.encode(), ev.SerializeToString()
        if k in bad_at:
            if k % 3 == 0:
                futures.append(producer.send(topic, key=key, value=b"\xff\x00garbage"))
            elif k % 3 == 1:  # missing item
                bad = make_event(ev.user_id, "x", ev.ts_ms)
                bad.item_id = ""
                futures.append(producer.send(topic, key=key, value=bad.SerializeToString()))
            else:  # keyed to another user: would be applied by the wrong owner
                futures.append(producer.send(topic, key=b"someone-else", value=value))
        futures.append(producer.send(topic, key=key, value=value))
        if len(futures) >= 200:
            settle()
    producer.flush()
    settle()
    producer.close()
    return ends


def checkpoints_of(cfg: Config) -> CheckpointStore:
    """The store the service of ``cfg`` writes (a model made by ``service_config`` has no
    version, so the group id needs none resolved)."""
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    root = checkpoint_root(cfg.checkpoint.dir, cfg.kafka.topic, cfg.kafka.group_id)
    return CheckpointStore(root, layout)


def wait_until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def caught_up(cfg: Config, ends: dict[int, int]) -> bool:
    """Every partition's newest checkpoint is at its end offset (0 where nothing was sent)."""
    store = checkpoints_of(cfg)
    return all(store.latest_offset(p) == ends.get(p, 0) for p in range(cfg.kafka.partitions))


def clean_pass(cfg: Config, events, tmp_path: Path) -> Engine:
    """Every valid event, in order, through one in-process engine (the reference)."""
    model, vocab, _, _ = load_model(cfg.server.model_dir)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    store = UserStateStore(layout, 4096, 0, tmp_path / "ref-spill", device="cpu")
    engine = Engine(model, vocab, store, cfg)
    valid = [
        ValidEvent(e.user_id, e.item_id, e.ts_ms, e.action - 1, e.value, None, 0, k)
        for k, e in enumerate(events)
    ]
    for start in range(0, len(valid), 500):
        engine.apply(valid[start : start + 500])
    return engine


def assert_checkpoints_equal_clean_pass(cfg: Config, events, tmp_path: Path) -> None:
    ref = clean_pass(cfg, events, tmp_path)
    counts: dict[str, int] = {}
    for e in events:
        counts[e.user_id] = counts.get(e.user_id, 0) + 1
    store = checkpoints_of(cfg)
    seen: set[str] = set()
    for p in range(cfg.kafka.partitions):
        ckpt = store.restore(p)
        assert ckpt is not None, f"partition {p} has no checkpoint"
        assert not seen & set(ckpt.user_ids)
        seen |= set(ckpt.user_ids)
        want = ref.snapshot(ckpt.user_ids)
        got = ckpt.state
        assert got.pos.tolist() == [counts[u] for u in ckpt.user_ids]
        assert torch.equal(got.last_ts, want.last_ts)
        torch.testing.assert_close(got.S, want.S, rtol=1e-4, atol=1e-5)
        assert got.M is not None and want.M is not None
        torch.testing.assert_close(got.M, want.M, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.h, want.h, rtol=1e-4, atol=1e-5)
    assert seen == set(counts)


def start_service(cfg: Config) -> tuple[BuiltEngine, KafkaIngest, EventConsumer, threading.Thread]:
    """``recmem ingest`` in this process: the builder, the Kafka adapter, the consumer."""
    built = build_engine(cfg, device="cpu")
    ingest = KafkaIngest(built.loop, built.checkpoints(), cfg)
    consumer = EventConsumer(cfg.kafka, ingest)
    register_gauges(consumer.metrics, built.engine)
    thread = ConsumerThread(consumer)
    thread.start()
    return built, ingest, consumer, thread


class ConsumerThread(threading.Thread):
    """Runs ``consumer.run``; keeps the error it ended with (``error``)."""

    def __init__(self, consumer: EventConsumer) -> None:
        super().__init__(daemon=True)
        self.consumer = consumer
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e


def stop_service(built: BuiltEngine, ingest: KafkaIngest, consumer: EventConsumer, thread):
    consumer.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    ingest.close()
    built.close()


def loop_over(engine: Engine) -> EngineLoop:
    return EngineLoop(Ranker(engine.model, engine), engine).start()


def test_service_writes_deltas_and_restores_them_bit_exact(tmp_path):
    """No broker: the sink driven directly. First checkpoint full, then deltas of the users
    that changed, a full one every ``full_every``; a new service restores the same states,
    latest events and notes."""
    from recmem.archive import NoteBank
    from tests.recmem.test_engine import make_engine, random_events

    events = random_events(400, 40, seed=7, n_partitions=2)
    cfg = small_config()
    cfg.checkpoint.full_every = 3
    layout = StateLayout.from_config(cfg.memory, cfg.model)

    def service(sub: str) -> KafkaIngest:
        bank = NoteBank(cfg.archive, cfg.memory.key_dim, cfg.memory.n_layers * cfg.memory.n_heads)
        loop = loop_over(make_engine(tmp_path / sub, cfg=cfg, bank=bank))
        cfg.checkpoint.interval_s = 0.0
        return KafkaIngest(loop, CheckpointStore(tmp_path / "ckpt", layout), cfg)

    a = service("a")
    assert {p: r.next_offset for p, r in a.restore_now([0, 1]).items()} == {0: 0, 1: 0}
    kinds = []
    for k in range(0, 400, 20):
        batch = events[k : k + 20]
        a.apply_batch(batch, {p: k + 20 for p in (0, 1)})
        a.checkpoint()  # written by the writer thread while ingest goes on
        assert a.flush() == {0: k + 20, 1: k + 20}
        kinds.append(checkpoints_kind(tmp_path / "ckpt", 0))
    assert kinds[0] == "full" and "delta" in kinds
    assert "delta" * 3 not in "".join(kinds)  # full_every=3: at most 2 deltas in a row
    b = service("b")
    assert {p: r.next_offset for p, r in b.restore_now([0, 1]).items()} == {0: 400, 1: 400}
    ea, eb = a.engine, b.engine
    a.loop.stop()
    b.loop.stop()
    for p in (0, 1):
        users = ea.users_of(p)
        assert eb.users_of(p) == users
        got, want = eb.snapshot(users), ea.snapshot(users)
        assert torch.equal(got.S, want.S) and torch.equal(got.M, want.M)
        assert torch.equal(got.pos, want.pos) and torch.equal(got.h, want.h)
        for u in users:
            assert eb.recent_events(u, 8).ts_ms.tolist() == ea.recent_events(u, 8).ts_ms.tolist()
            assert eb.bank.note_count(u) == ea.bank.note_count(u)
    ea.store.close()
    eb.store.close()


def checkpoints_kind(root: Path, partition: int) -> str:
    import json

    pdir = root / f"p-{partition:05d}"
    newest = json.loads((pdir / "MANIFEST.json").read_text())["checkpoints"][0]
    return json.loads((pdir / newest / "meta.json").read_text())["kind"]


def test_clean_stop_restores_and_continues(tmp_path, kafka_config):
    cfg = service_config(tmp_path, kafka_config(partitions=3))
    events = make_events(900, 40, seed=1)
    ends = send_with_bad(cfg, events[:600], seed=1, n_bad=10)

    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    assert built.engine.totals.events == 600
    registry = consumer.metrics.registry
    resident = {
        tier: registry.get_sample_value("recmem_ingest_users_resident", {"tier": tier})
        for tier in ("device", "host", "disk")
    }
    assert resident["device"] <= 48  # state.device_capacity
    assert sum(resident.values()) == len({e.user_id for e in events[:600]})
    assert registry.get_sample_value("recmem_ingest_bytes_per_user") == (
        built.engine.store.bytes_per_user()
    )
    stop_service(built, ingest, consumer, thread)
    first = {p: checkpoints_of(cfg).restore(p) for p in range(3)}
    # `recmem ingest` writes what `recmem serve` writes: states, notes, latest events, keys
    arrays = [a for c in first.values() if c is not None for _, a in c.notes_parts if a]
    for prefix in ("archive.", "recent.", "seen."):
        assert any(k.startswith(prefix) for a in arrays for k in a), prefix

    # a new service restores exactly that state and applies only what is new
    send_with_bad(cfg, events[600:], seed=2, n_bad=5, ends=ends)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    stop_service(built, ingest, consumer, thread)
    assert built.engine.totals.events == 300
    for p, ckpt in first.items():
        assert ckpt is not None and ckpt.next_offset < checkpoints_of(cfg).latest_offset(p)
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


def test_rebalance_across_two_services(tmp_path, kafka_config):
    cfg = service_config(tmp_path, kafka_config(partitions=4))
    events = make_events(1200, 60, seed=3)
    ends = send_with_bad(cfg, events[:500], seed=3, n_bad=6)
    a = start_service(cfg)
    wait_until(lambda: a[0].engine.totals.events >= 500, 60, "service A to apply 500 events")
    # B joins the group: A's revoked partitions move to B through their checkpoints
    b = start_service(cfg)
    wait_until(lambda: a[1].assigned and b[1].assigned, 60, "both services to own partitions")
    assert not a[1].assigned & b[1].assigned
    send_with_bad(cfg, events[500:], seed=4, n_bad=6, ends=ends)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    stop_service(*a)
    stop_service(*b)
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


def alive(proc: subprocess.Popen, log_path: Path) -> bool:
    """True while ``proc`` runs; a process that exited on its own fails the test at once."""
    if proc.poll() is not None:
        raise AssertionError(
            f"recmem ingest exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        )
    return True


@pytest.mark.slow
def test_crash_kill9_restart_equals_clean_pass(tmp_path, kafka_config):
    cfg = service_config(tmp_path, kafka_config(partitions=4))
    cfg_path = tmp_path / "ingest.toml"
    cfg_path.write_text(cfg.to_toml())
    events = make_events(4000, 200, seed=5)
    ends: dict[int, int] = {}
    producer = threading.Thread(
        target=send_with_bad, args=(cfg, events, 5, 60, 160.0, ends), daemon=True
    )
    producer.start()
    rng = random.Random(5)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log_path = tmp_path / "ingest.log"
    cmd = [sys.executable, "-m", "recmem.cli", "ingest", "--config", str(cfg_path)]
    store = checkpoints_of(cfg)

    def progress() -> int:
        return sum(store.latest_offset(p) or 0 for p in range(cfg.kafka.partitions))

    kills = 0
    with open(log_path, "ab") as log:
        for _ in range(3):
            before = progress()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
            try:
                # kill only once this process has made progress, at a random moment after
                wait_until(
                    lambda b=before, p=proc: alive(p, log_path) and progress() > b,
                    60,
                    "checkpoint progress",
                )
                time.sleep(rng.uniform(0.0, 0.8))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
            kills += 1
        producer.join(timeout=60)
        assert not producer.is_alive()
        assigned_before = log_path.read_text().count("; resuming from")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
        try:
            # judge progress only once this process owns its partitions: the killed runs
            # may already have checkpointed everything, and a SIGTERM that lands before the
            # handlers are installed ends the process with the default action
            wait_until(
                lambda: (
                    alive(proc, log_path)
                    and log_path.read_text().count("; resuming from") > assigned_before
                    and caught_up(cfg, ends)
                ),
                90,
                "checkpoints at the end offsets",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)
    assert kills == 3
    assert rc == 0, log_path.read_text()[-3000:]
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


def test_executor_flushes_denormals_when_the_process_opted_in(tmp_path):
    """The loop's executor thread (the model steps of ingest) flushes before its first
    tensor operation (its OpenMP workers copy the flag when they are created), only in a
    process that opted in."""
    from models.memory import recurrent
    from tests.recmem.test_engine import make_engine, random_events

    seen: list[bool] = []
    torch.set_flush_denormal(False)  # threads start with their creator's flags
    for opted_in in (False, True):
        recurrent._process_flushes_denormals = opted_in
        try:
            engine = make_engine(tmp_path / str(opted_in))
            inner = engine.compute

            def probe(piece, inner=inner):
                seen.append((torch.tensor([1e-39]) * 1.0).item() == 0.0)
                inner(piece)

            engine.compute = probe  # type: ignore[method-assign]
            loop = loop_over(engine)
            loop.apply(random_events(5, 1), timeout=30)
            loop.stop()
            engine.store.close()
        finally:
            recurrent._process_flushes_denormals = False
    assert seen == [False, True]


def test_duplicate_records_are_applied_once(tmp_path, kafka_config):
    """Records sent twice (a source replaying what it sent, here each 5th event) reach the
    engine once; the metric counts the copies; the producer is idempotent for retries."""
    from streams.producer import EventProducer

    cfg = service_config(tmp_path, kafka_config(partitions=2))
    events = make_events(200, 10, seed=11)
    doubled = []
    for k, e in enumerate(events):
        doubled.append(e)
        if k % 5 == 0:
            doubled.append(e)
    with EventProducer(cfg.kafka) as producer:
        assert producer._producer.config["enable_idempotence"]
        producer.send(doubled, progress=False)
    ends = {p: n for p, n in end_offsets_of(cfg).items()}
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    registry = consumer.metrics.registry
    assert registry.get_sample_value("recmem_ingest_duplicate_events_total") == 40
    stop_service(built, ingest, consumer, thread)
    assert built.engine.totals.events == 200
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


def end_offsets_of(cfg: Config) -> dict[int, int]:
    from streams.admin import end_offsets

    return end_offsets(cfg.kafka)
