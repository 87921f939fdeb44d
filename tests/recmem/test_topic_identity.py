"""Defect 2: a checkpoint's offsets are only sought to in the topic they were read from.
Against the real broker: a topic deleted and created again, with and without broker topic
ids (then the fingerprint of the record before the offset decides), and an offset past the
end of the log. The default stops loudly naming the setting; ``earliest`` keeps the states
and applies every record of the new topic."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient

from recmem.checkpoint import IncompatibleCheckpoint, checkpoint_root
from recmem.config import Config
from streams.admin import client_settings, ensure_topics
from streams.positions import PositionError
from tests.recmem.test_ingest import (
    caught_up,
    make_events,
    send_with_bad,
    service_config,
    start_service,
    stop_service,
    wait_until,
)


def run_until_caught_up(cfg: Config, ends: dict[int, int]) -> dict[str, int]:
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    positions = {u: int(built.engine.snapshot([u]).pos[0]) for u in built.engine.partition_of}
    stop_service(built, ingest, consumer, thread)
    return positions


def run_expecting_failure(cfg: Config) -> BaseException:
    """Start the service; it must stop on its own with the error it returns."""
    built, _, consumer, thread = start_service(cfg)
    thread.join(60)
    alive = thread.is_alive()
    if alive:
        consumer.stop()
        thread.join(30)
    built.close()
    assert not alive, "the service kept running"
    assert thread.error is not None
    return thread.error


def recreate(cfg: Config) -> None:
    admin = KafkaAdminClient(**client_settings(cfg.kafka))
    try:
        admin.delete_topics([cfg.kafka.topic])
    finally:
        admin.close()
    time.sleep(0.5)
    ensure_topics(cfg.kafka, {cfg.kafka.topic: cfg.kafka.partitions})


@pytest.mark.parametrize("topic_ids", [True, False], ids=["topic-ids", "fingerprints"])
def test_a_recreated_topic_is_refused_then_read_from_its_start(
    tmp_path: Path, kafka_config, monkeypatch, topic_ids: bool
) -> None:
    if not topic_ids:  # a broker that gives no topic ids: the record before the offset decides
        monkeypatch.setattr("streams.positions.topic_id_of", lambda consumer, topic: "")
    cfg = service_config(tmp_path, kafka_config(partitions=2))
    old = make_events(300, 12, seed=1)
    ends = send_with_bad(cfg, old, seed=1, n_bad=0)
    before = run_until_caught_up(cfg, ends)
    assert sum(before.values()) == 300

    recreate(cfg)
    new = make_events(200, 12, seed=2)  # other records at the old offsets
    ends = send_with_bad(cfg, new, seed=2, n_bad=0)
    err = run_expecting_failure(cfg)
    assert isinstance(err, PositionError)
    assert "kafka.on_topic_mismatch" in str(err)
    assert ("topic id" in str(err)) == topic_ids

    cfg.kafka.on_topic_mismatch = "earliest"
    after = run_until_caught_up(cfg, ends)
    counts: dict[str, int] = {}
    for e in new:
        counts[e.user_id] = counts.get(e.user_id, 0) + 1
    # every new record applied on top of the kept states: none skipped
    for user, n in counts.items():
        assert after[user] == before.get(user, 0) + n, user


def test_an_offset_past_the_end_is_refused(tmp_path: Path, kafka_config) -> None:
    cfg = service_config(tmp_path, kafka_config(partitions=1))
    ends = send_with_bad(cfg, make_events(40, 4, seed=3), seed=3, n_bad=0)
    run_until_caught_up(cfg, ends)
    pdir = Path(checkpoint_root(cfg.checkpoint.dir, cfg.kafka.topic, cfg.kafka.group_id))
    pdir = pdir / "p-00000"
    newest = json.loads((pdir / "MANIFEST.json").read_text())["checkpoints"][0]
    meta_path = pdir / newest / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["next_offset"] = 10_000  # e.g. a broker that lost the log's tail
    meta_path.write_text(json.dumps(meta))
    err = run_expecting_failure(cfg)
    assert "kafka.on_offset_out_of_range" in str(err) and "10000" in str(err)


def test_a_checkpoint_of_other_archive_settings_is_refused_by_name(
    tmp_path: Path, kafka_config
) -> None:
    """The settings that shape stored data include the archive's: a service with another
    chunk size must not continue notes written under the old one."""
    cfg = service_config(tmp_path, kafka_config(partitions=1))
    ends = send_with_bad(cfg, make_events(40, 4, seed=4), seed=4, n_bad=0)
    run_until_caught_up(cfg, ends)
    cfg.archive.chunk_events = 16
    err = run_expecting_failure(cfg)
    assert isinstance(err, IncompatibleCheckpoint)
    assert "archive.chunk_events: checkpoint 32, this service 16" in str(err)
