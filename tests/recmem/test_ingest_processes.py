"""kafka.consumer_processes > 0 (streams/processes.py) on a real tansu broker: consumer
processes feeding the engine of this process apply the same state, checkpoint and commit
the same offsets and write the same dead letters as the in-thread consumer; a stop and
restart skips nothing and applies nothing twice; a consumer process killed with SIGKILL
stops the ingest with an error, and the restart continues exactly; an error of the sink
stops every process without a checkpoint after it; the children's figures are summed on
the engine process's registry."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from recmem.config import Config, ConfigError, validate
from recmem.engine.builder import build_engine
from recmem.ingest import KafkaIngest
from streams.batch import EventBatch
from streams.config import KafkaConfig
from streams.processes import ConsumerProcesses
from streams.sink import RESTORING
from streams.validate import REASONS, ValidEvent
from tests.recmem.test_ingest import (
    REPO,
    alive,
    assert_checkpoints_equal_clean_pass,
    caught_up,
    checkpoints_of,
    make_events,
    send_with_bad,
    service_config,
    stop_service,
    wait_until,
)
from tests.recmem.test_ingest_confluent import committed, dead_letters, for_client, start_service
from tests.streams.sinks import RecordingSink


def figure(consumer, name: str, labels: dict[str, str] | None = None) -> float:
    value = consumer.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def at_ends(cfg: Config, ends: dict[int, int]) -> bool:
    """The group's committed offsets are the end offsets, on every partition."""
    return committed(cfg) == {p: ends.get(p, 0) for p in range(cfg.kafka.partitions)}


def test_restoring_stays_itself_across_processes():
    assert pickle.loads(pickle.dumps(RESTORING)) is RESTORING


def test_processes_apply_the_same_state_offsets_and_dead_letters(tmp_path, kafka_config):
    base = service_config(tmp_path, kafka_config(partitions=3))
    events = make_events(600, 40, seed=21)
    ends = send_with_bad(base, events, seed=21, n_bad=9)
    out = {}
    for procs in (0, 2):
        # a group, checkpoint directory and dead-letter topic of its own
        cfg = for_client(base, tmp_path / f"p{procs}", f"kafka-python-{procs}")
        cfg.kafka = dataclasses.replace(cfg.kafka, client="kafka-python", consumer_processes=procs)
        built, ingest, consumer, thread = start_service(cfg)
        assert (type(consumer) is ConsumerProcesses) == (procs > 0)
        wait_until(lambda cfg=cfg: caught_up(cfg, ends), 90, f"{procs} processes: caught up")
        # group commits are monitoring (the checkpoints hold the truth): one that meets a
        # rebalance (a child joining or leaving) fails and the next one makes up for it, so
        # they are awaited while the service runs, not asserted after a stop
        wait_until(lambda cfg=cfg: at_ends(cfg, ends), 60, f"{procs} processes: committed")
        applied = built.engine.totals.events
        if procs:
            # every child sent its figures: summed here; the sink's own gauges are kept
            wait_until(
                lambda c=consumer: figure(c, "recmem_ingest_events_total") == len(events),
                10,
                "the children's figures",
            )
            assert figure(consumer, "recmem_ingest_records_total") == len(events) + 9
            dead = sum(
                figure(consumer, "recmem_ingest_dead_letters_total", {"reason": r}) for r in REASONS
            )
            assert dead == 9
            assert figure(consumer, "recmem_ingest_assigned_partitions") == 3
            assert figure(consumer, "recmem_ingest_bytes_per_user") > 0
            assert sorted(consumer.assignment) == [0, 1, 2]
        stop_service(built, ingest, consumer, thread)
        assert thread.error is None, thread.error
        store = checkpoints_of(cfg)
        out[procs] = {
            "applied": applied,
            "offsets": {p: store.latest_offset(p) for p in range(3)},
            "committed": committed(cfg),
            "dead": dead_letters(cfg, 9),
            "ckpt": {p: store.restore(p) for p in range(3)},
        }
        assert_checkpoints_equal_clean_pass(cfg, events, tmp_path / f"p{procs}")
    a, b = out[0], out[2]
    assert a["applied"] == b["applied"] == len(events)
    assert a["offsets"] == b["offsets"] == {p: ends.get(p, 0) for p in range(3)}
    assert a["committed"] == b["committed"] == {p: ends.get(p, 0) for p in range(3)}
    assert len(b["dead"]) == 9 and a["dead"] == b["dead"]
    for p in range(3):
        ca, cb = a["ckpt"][p], b["ckpt"][p]
        assert ca.user_ids == cb.user_ids
        assert torch.equal(ca.state.pos, cb.state.pos)
        torch.testing.assert_close(ca.state.S, cb.state.S, rtol=1e-4, atol=1e-5)


def test_processes_stop_restart_and_a_killed_process(tmp_path, kafka_config):
    """Stop and restart: nothing skipped or applied twice. Then SIGKILL one consumer
    process: the ingest stops with an error naming it, and a restart ends exactly where a
    clean pass does."""
    cfg = service_config(tmp_path, kafka_config(partitions=4, consumer_processes=2))
    events = make_events(1500, 60, seed=8)
    ends = send_with_bad(cfg, events[:600], seed=8, n_bad=5)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 90, "checkpoints at the end offsets")
    wait_until(lambda: at_ends(cfg, ends), 60, "group commits at the end offsets")
    stop_service(built, ingest, consumer, thread)
    assert thread.error is None and built.engine.totals.events == 600

    send_with_bad(cfg, events[600:1000], seed=9, n_bad=4, ends=ends)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 90, "checkpoints at the end offsets")
    assert built.engine.totals.events == 400
    children = [c.process for c in consumer._children]
    assert len(children) == 2 and all(p.is_alive() for p in children)
    os.kill(children[0].pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(thread.error, RuntimeError)
    assert "consumer process 0 exited with code -9" in str(thread.error)
    assert not any(p.is_alive() for p in children)
    ingest.close()
    built.close()

    send_with_bad(cfg, events[1000:], seed=10, n_bad=4, ends=ends)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 90, "checkpoints at the end offsets")
    wait_until(lambda: at_ends(cfg, ends), 60, "group commits at the end offsets")
    stop_service(built, ingest, consumer, thread)
    assert thread.error is None
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


class FailingSink(RecordingSink):
    """Raises on its second batch; counts the calls after that."""

    def __init__(self) -> None:
        super().__init__()  # no periodic checkpoints: only the final ones would write
        self.failed = False
        self.after: list[str] = []

    def apply_batch(self, events, next_offsets, source=None):  # type: ignore[override]
        if self.batches >= 1 or self.failed:
            self.failed = True
            raise ValueError("the engine broke")
        super().apply_batch(events, next_offsets, source)

    def checkpoint(self) -> dict[int, int]:
        if self.failed:
            self.after.append("checkpoint")
        return super().checkpoint()


def test_a_sink_error_stops_every_process_without_a_checkpoint(tmp_path, kafka_config):
    cfg = service_config(
        tmp_path, kafka_config(partitions=2, consumer_processes=2, max_poll_records=50)
    )
    ends = send_with_bad(cfg, make_events(400, 30, seed=3), seed=3, n_bad=0)
    assert sum(ends.values()) == 400
    sink = FailingSink()
    consumer = ConsumerProcesses(cfg.kafka, sink, 2)
    error: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as e:  # noqa: BLE001 - read below
            error.append(e)

    t = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(timeout=90)
    assert not t.is_alive(), "the consumer processes did not stop"
    assert len(error) == 1 and isinstance(error[0], ValueError), error
    assert "the engine broke" in str(error[0])
    assert sink.failed and sink.after == []
    assert not any(c.process.is_alive() for c in consumer._children)
    assert time.monotonic() - started < 90


def test_the_configuration_bounds_the_processes():
    cfg = Config()
    cfg.kafka.consumer_processes = 65
    with pytest.raises(ConfigError, match=r"kafka.consumer_processes = 65 is outside \[0, 64\]"):
        validate(cfg)
    cfg.kafka.consumer_processes = 4
    validate(cfg)
    with pytest.raises(ValueError, match="consumer processes must be >= 1"):
        ConsumerProcesses(cfg.kafka, RecordingSink(), 0)


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_a_stop_signals_the_group_leader_first(monkeypatch):
    """The child that led the latest generation it reported is stopped alone first (on
    tansu a leader that leaves after another member stays the group's leader for good);
    the others once it has finished, or after LEADER_FIRST_S; all at once when none
    leads."""
    import streams.processes as processes
    from streams.group import GroupView
    from streams.processes import LEADER_FIRST_S, _Child

    killed: list[int] = []
    monkeypatch.setattr(processes.os, "kill", lambda pid, sig: killed.append(pid))
    consumer = ConsumerProcesses(KafkaConfig(partitions=2), RecordingSink(), 2)
    consumer._children = [_Child(i, _Process(100 + i), None) for i in range(2)]  # type: ignore[arg-type]
    leader, other = consumer._children[1], consumer._children[0]
    consumer._call(leader, "on_group", (GroupView(3, 2, leads=True),))
    consumer._call(other, "on_group", (GroupView(3, 2),))
    assert consumer._leader == 1
    signalled: set[int] = set()
    now = time.monotonic()
    consumer._signal_stop(signalled, now)
    consumer._signal_stop(signalled, now)
    assert killed == [101]
    leader.finished = True
    consumer._signal_stop(signalled, now)
    assert killed == [101, 100]
    # a leader that does not finish holds the others back LEADER_FIRST_S at most
    killed.clear()
    leader.finished = False
    consumer._signal_stop(set(), now - LEADER_FIRST_S - 1)
    assert killed == [100, 101]
    # a new generation led by no child here: all at once
    killed.clear()
    consumer._call(leader, "on_group", (GroupView(4, 2),))
    assert consumer._leader is None
    consumer._signal_stop(set(), now)
    assert killed == [100, 101]


def children_of(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out |= {int(x) for x in text}
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later child of this test counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_consumer_processes_leave_when_the_engine_process_is_killed(tmp_path, kafka_config):
    cfg = service_config(tmp_path, kafka_config(partitions=2, consumer_processes=2))
    cfg_path = tmp_path / "ingest.toml"
    cfg_path.write_text(cfg.to_toml())
    ends = send_with_bad(cfg, make_events(300, 20, seed=4), seed=4, n_bad=0)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log_path = tmp_path / "ingest.log"
    cmd = [sys.executable, "-m", "recmem.cli", "ingest", "--config", str(cfg_path)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
        try:
            wait_until(lambda: alive(proc, log_path) and caught_up(cfg, ends), 90, "caught up")
            kids = children_of(proc.pid)
            assert len([k for k in kids if running(k)]) >= 2, kids
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
    # orphaned, each notices its parent is gone and closes (no checkpoint is written)
    wait_until(lambda: not any(running(k) for k in kids), 30, "the consumer processes to exit")
    assert "the engine process is gone" in log_path.read_text()


def test_columns_of_a_partition_not_owned_here_are_not_applied(tmp_path):
    """A batch of columns with events of a partition dropped here meanwhile (a fenced
    write): only the owned partitions' events and offsets are taken."""
    cfg = service_config(tmp_path, KafkaConfig(partitions=2))
    built = build_engine(cfg, device="cpu")
    ingest = KafkaIngest(built.loop, built.checkpoints(), cfg)
    try:
        ingest.assigned = {0}
        events = [ValidEvent(f"u{k % 4}", "i1", 1000 + k, 0, 1.0, None, k % 2, k) for k in range(8)]
        ingest.apply_batch(EventBatch.of(events), {0: 7, 1: 8})
        ingest.drain()
        assert built.engine.totals.events == 4
        assert sorted(built.engine.partition_of) == ["u0", "u2"]
        assert ingest.next_offsets == {0: 7}
    finally:
        ingest.close()
        built.close()
