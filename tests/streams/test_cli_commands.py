"""The streams subcommands of the recmem CLI: ``produce`` into a real broker and ``broker``
in the foreground until SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kafka import KafkaConsumer, TopicPartition

from recmem.cli import main
from streams.broker import free_port, wait_for_port
from streams.codec import decode_event


def read_all(cfg, expected: int, timeout_s: float = 15.0):
    c = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, auto_offset_reset="earliest")
    parts = [TopicPartition(cfg.topic, p) for p in range(cfg.partitions)]
    c.assign(parts)
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            out.extend(recs)
    c.close()
    return out


def test_produce_streams_a_csv_in_time_order(kafka_config, tmp_path, capsys):
    cfg = kafka_config(partitions=2)
    csv = tmp_path / "events.csv"
    rows = ["user_id,item_id,timestamp,rating"]
    # written out of order: the command must send in timestamp order
    for i in reversed(range(40)):
        rows.append(f"u{i % 5},item{i},{1_600_000_000 + i * 60},{i % 5 + 1}")
    csv.write_text("\n".join(rows) + "\n")
    rc = main(
        [
            "produce",
            "--dataset",
            f"csv:{csv}",
            "--topic",
            cfg.topic,
            "--bootstrap",
            cfg.bootstrap_servers,
            "--limit",
            "30",
            "--set",
            "kafka.partitions=2",
        ]
    )
    assert rc == 0
    assert "produced 30 events" in capsys.readouterr().out
    records = read_all(cfg, 30)
    assert len(records) == 30
    events = [decode_event(r.value) for r in records]
    assert all(r.key == e.user_id.encode() for r, e in zip(records, events))
    # the 30 earliest rows, each user's in time order within its partition
    assert sorted(e.item_id for e in events) == sorted(f"item{i}" for i in range(30))
    for user in {e.user_id for e in events}:
        ts = [e.ts_ms for e in events if e.user_id == user]
        assert ts == sorted(ts)
    assert {e.ts_ms for e in events} == {(1_600_000_000 + i * 60) * 1000 for i in range(30)}


def test_produce_reports_a_missing_file(kafka_config, tmp_path, capsys):
    cfg = kafka_config(partitions=1)
    rc = main(
        ["produce", "--dataset", f"csv:{tmp_path / 'nope.csv'}", "--topic", cfg.topic]
        + ["--bootstrap", cfg.bootstrap_servers]
    )
    assert rc == 2
    assert "not found" in capsys.readouterr().err


def test_broker_command_runs_until_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "recmem.cli", "broker", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert wait_for_port("127.0.0.1", port, 20.0), "broker did not listen"
        line = ""
        while "tansu broker on" not in line:
            line = proc.stdout.readline()
            assert line, "broker command exited early"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "broker stopped" in proc.stdout.read()
        assert not wait_for_port("127.0.0.1", port, 0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
