"""EventConsumer against a real tansu broker: produce/consume, checkpoints and commits,
stop semantics."""

from __future__ import annotations

import threading
import time
import urllib.request

from kafka import KafkaConsumer, TopicPartition

from streams.broker import free_port
from streams.codec import make_event
from streams.consumer import EventConsumer
from streams.producer import EventProducer
from tests.streams.sinks import RecordingSink

BASE_TS = 1_700_000_000_000


def events_for(n_users: int, per_user: int):
    return [
        make_event(f"user-{u}", f"item-{u}-{i}", BASE_TS + i * 1000 + u, i % 6, float(i))
        for i in range(per_user)
        for u in range(n_users)
    ]


def start(consumer: EventConsumer) -> threading.Thread:
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    return t


def wait_until(pred, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def committed(cfg, partitions) -> dict[int, int | None]:
    c = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, group_id=cfg.group_id)
    try:
        return {p: c.committed(TopicPartition(cfg.topic, p)) for p in partitions}
    finally:
        c.close()


def test_produce_consume_in_order_then_stop_commits(kafka_config):
    cfg = kafka_config(partitions=3)
    sent = events_for(n_users=12, per_user=20)
    with EventProducer(cfg) as producer:
        assert producer.send(sent, progress=False) == len(sent)

    sink = RecordingSink(checkpoint_every=3)
    cfg.metrics_port = free_port()
    consumer = EventConsumer(cfg, sink)
    resident = consumer.metrics.gauge("users_resident", "users held by the sink")
    resident.set(12)
    thread = start(consumer)
    wait_until(lambda: len(sink.snapshot()) >= len(sent), what="all events")

    def scrape() -> dict[str, float]:
        url = f"http://127.0.0.1:{cfg.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    wait_until(
        lambda: (
            sum(v for k, v in scrape().items() if k.startswith("recmem_ingest_consumer_lag{")) == 0
            and any(k.startswith("recmem_ingest_consumer_lag{") for k in scrape())
        ),
        what="lag gauges at 0",
    )
    figures = scrape()
    assert figures["recmem_ingest_events_total"] == len(sent)
    assert figures["recmem_ingest_records_total"] == len(sent)
    assert figures["recmem_ingest_batch_seconds_count"] >= 1
    assert figures["recmem_ingest_users_resident"] == 12
    assert figures["recmem_ingest_assigned_partitions"] == 3
    consumer.stop()
    thread.join(timeout=15)
    assert not thread.is_alive()

    got = sink.snapshot()
    assert len(got) == len(sent)
    by_user: dict[str, list] = {}
    for e in got:
        by_user.setdefault(e.user_id, []).append(e)
    for user, evs in by_user.items():
        assert len({e.partition for e in evs}) == 1, f"{user} spread over partitions"
        assert [e.ts_ms for e in evs] == sorted(e.ts_ms for e in evs)
        assert [e.offset for e in evs] == sorted(e.offset for e in evs)
    assert {(e.user_id, e.item_id) for e in got} == {(e.user_id, e.item_id) for e in sent}
    first = next(e for e in got if e.user_id == "user-3" and e.item_id == "item-3-4")
    assert (first.ts_ms, first.action, first.value) == (BASE_TS + 4003, 4, 4.0)

    # every batch lists its partitions in order; stop checkpointed and committed the end
    for kind, arg in sink.calls:
        if kind == "batch":
            assert list(arg[1]) == sorted(arg[1])
    assert sink.calls[-1] == ("revoked", [0, 1, 2])
    checkpoints = [arg for kind, arg in sink.calls if kind == "checkpoint"]
    assert checkpoints, "stop() must checkpoint"
    used = sorted({e.partition for e in got})
    assert len(used) >= 2
    ends = {p: max(e.offset for e in got if e.partition == p) + 1 for p in used}
    assert checkpoints[-1] == ends
    assert committed(cfg, used) == ends


def test_restart_resumes_from_the_sinks_checkpoint(kafka_config):
    cfg = kafka_config(partitions=2)
    store: dict[int, int] = {}
    with EventProducer(cfg) as producer:
        producer.send(events_for(4, 10), progress=False)
    first = RecordingSink(store)
    c1 = EventConsumer(cfg, first)
    t1 = start(c1)
    wait_until(lambda: len(first.snapshot()) == 40, what="first pass")
    c1.stop()
    t1.join(timeout=15)

    # the sink's checkpoint, not the group's commit, decides where a member starts: rewind
    # partition 0 to offset 5 and expect exactly those records again plus the new ones
    store[0] = 5
    with EventProducer(cfg) as producer:
        producer.send(events_for(4, 12)[40:], progress=False)
    second = RecordingSink(store)
    c2 = EventConsumer(cfg, second)
    t2 = start(c2)
    replayed_p0 = sum(1 for e in first.snapshot() if e.partition == 0 and e.offset >= 5)
    wait_until(lambda: len(second.snapshot()) == replayed_p0 + 8, what="second pass")
    c2.stop()
    t2.join(timeout=15)
    got = second.snapshot()
    assert min(e.offset for e in got if e.partition == 0) == 5
    assert sorted(e.item_id for e in got if e.item_id.endswith(("-10", "-11"))) == sorted(
        f"item-{u}-{i}" for u in range(4) for i in (10, 11)
    )


SIGTERM_SCRIPT = """
import json, sys, time
from recmem.config import KafkaConfig
from streams.consumer import EventConsumer
from tests.streams.sinks import RecordingSink

class SlowSink(RecordingSink):
    def apply_batch(self, events, next_offsets, source=None):
        super().apply_batch(events, next_offsets)
        print("applied", len(self.events), flush=True)
        time.sleep(0.05)

cfg = KafkaConfig(**json.loads(sys.argv[1]))
sink = SlowSink()
consumer = EventConsumer(cfg, sink)
consumer.install_signal_handlers()
consumer.run()
ckpts = [arg for kind, arg in sink.calls if kind == "checkpoint"]
json.dump({"applied": len(sink.events), "owned_at_stop": ckpts[-1], "last": sink.calls[-1]},
          open(sys.argv[2], "w"))
"""


def test_sigterm_finishes_the_batch_checkpoints_and_commits(kafka_config, tmp_path):
    import dataclasses
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    cfg = kafka_config(partitions=1, max_poll_records=50)
    with EventProducer(cfg) as producer:
        producer.send(events_for(n_users=10, per_user=100), progress=False)
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, json.dumps(dataclasses.asdict(cfg)), str(out)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("applied"), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    result = json.loads(out.read_text())
    # stopped early (mid-stream), but after whole batches: the checkpoint covers exactly
    # the events applied, and the group's commit equals the checkpoint
    assert 0 < result["applied"] < 1000
    assert result["owned_at_stop"] == {"0": result["applied"]}
    assert result["last"] == ["revoked", [0]]
    assert committed(cfg, [0]) == {0: result["applied"]}


def test_a_failing_sink_ends_the_run_without_a_checkpoint(kafka_config):
    class Failing(RecordingSink):
        def apply_batch(self, events, next_offsets, source=None):
            super().apply_batch(events, next_offsets)
            raise RuntimeError("disk full")

    cfg = kafka_config(partitions=2)
    with EventProducer(cfg) as producer:
        producer.send(events_for(4, 5), progress=False)
    sink = Failing(checkpoint_every=1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            EventConsumer(cfg, sink).run()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [str(e) for e in errors] == ["disk full"]
    kinds = [kind for kind, _ in sink.calls]
    # the half-applied batch is never checkpointed or revoked into a checkpoint
    assert kinds[-1] == "batch" and "checkpoint" not in kinds and "revoked" not in kinds
    assert committed(cfg, [0, 1]) == {0: None, 1: None}
