"""kafka.client = "confluent" (librdkafka) against the kafka-python default on a real tansu
broker: the same records ingested once with each client give the same applied state, the
same checkpointed and committed offsets and the same dead letters; a stop and restart with
librdkafka skips nothing and applies nothing twice; the configuration refuses what the
client cannot do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from kafka import KafkaConsumer, TopicPartition

from recmem.config import Config, ConfigError, validate
from recmem.engine.builder import build_engine
from recmem.ingest import KafkaIngest, register_gauges
from streams.admin import client_settings, ensure_topics
from streams.clients import make_consumer
from streams.confluent import ConfluentEventConsumer, generation_of
from streams.consumer import EventConsumer
from tests.recmem.test_ingest import (
    ConsumerThread,
    assert_checkpoints_equal_clean_pass,
    caught_up,
    checkpoints_of,
    make_events,
    send_with_bad,
    service_config,
    stop_service,
    wait_until,
)


def start_service(cfg: Config):
    """``recmem ingest`` in this process with the consumer ``kafka.client`` and
    ``kafka.consumer_processes`` name."""
    built = build_engine(cfg, device="cpu")
    ingest = KafkaIngest(built.loop, built.checkpoints(), cfg)
    consumer = make_consumer(cfg.kafka, ingest)
    register_gauges(consumer.metrics, built.engine)
    thread = ConsumerThread(consumer)  # type: ignore[arg-type]
    thread.start()
    return built, ingest, consumer, thread


def for_client(cfg: Config, tmp_path: Path, client: str) -> Config:
    """``cfg`` read by ``client`` in a group, checkpoint directory and dead-letter topic of
    its own (the same input topic)."""
    out = dataclasses.replace(cfg)
    out.kafka = dataclasses.replace(
        cfg.kafka,
        client=client,
        group_id=f"{cfg.kafka.group_id}-{client}",
        dead_letter_topic=f"{cfg.kafka.dead_letter_topic}-{client}",
    )
    out.checkpoint = dataclasses.replace(cfg.checkpoint, dir=str(tmp_path / f"ckpt-{client}"))
    out.state = dataclasses.replace(cfg.state, spill_dir=str(tmp_path / f"spill-{client}"))
    ensure_topics(out.kafka, {out.kafka.dead_letter_topic: 1})
    return out


def committed(cfg: Config) -> dict[int, int | None]:
    kafka = cfg.kafka
    c = KafkaConsumer(group_id=kafka.group_id, **client_settings(kafka))
    try:
        return {p: c.committed(TopicPartition(kafka.topic, p)) for p in range(kafka.partitions)}
    finally:
        c.close()


def dead_letters(cfg: Config, n: int) -> list[tuple]:
    """The first ``n`` records of the dead-letter topic: (key, value, headers), in the order
    of their source partition and offset."""
    topic = cfg.kafka.dead_letter_topic
    c = KafkaConsumer(
        auto_offset_reset="earliest", consumer_timeout_ms=5000, **client_settings(cfg.kafka)
    )
    try:
        c.assign([TopicPartition(topic, 0)])
        got = []
        for rec in c:
            got.append((rec.key, rec.value, tuple(rec.headers)))
            if len(got) == n:
                break
    finally:
        c.close()

    def source(r: tuple) -> tuple[int, int]:
        h = dict(r[2])
        return int(h["source_partition"]), int(h["source_offset"])

    return sorted(got, key=source)


def test_both_clients_apply_the_same_state_offsets_and_dead_letters(tmp_path, kafka_config):
    base = service_config(tmp_path, kafka_config(partitions=3))
    events = make_events(600, 40, seed=11)
    ends = send_with_bad(base, events, seed=11, n_bad=9)
    out = {}
    for client in ("kafka-python", "confluent"):
        cfg = for_client(base, tmp_path / client, client)
        built, ingest, consumer, thread = start_service(cfg)
        expected = ConfluentEventConsumer if client == "confluent" else EventConsumer
        assert type(consumer) is expected
        wait_until(lambda cfg=cfg: caught_up(cfg, ends), 60, f"{client}: checkpoints at the end")
        generation = ingest.generation
        applied = built.engine.totals.events
        stop_service(built, ingest, consumer, thread)
        assert thread.error is None
        store = checkpoints_of(cfg)
        out[client] = {
            "applied": applied,
            "generation": generation,
            "offsets": {p: store.latest_offset(p) for p in range(3)},
            "committed": committed(cfg),
            "dead": dead_letters(cfg, 9),
            "ckpt": {p: store.restore(p) for p in range(3)},
        }
        # each client's state is every valid event applied once, in order
        assert_checkpoints_equal_clean_pass(cfg, events, tmp_path / client)
    a, b = out["kafka-python"], out["confluent"]
    assert a["applied"] == b["applied"] == len(events)
    assert a["offsets"] == b["offsets"] == {p: ends.get(p, 0) for p in range(3)}
    assert a["committed"] == b["committed"] == {p: ends.get(p, 0) for p in range(3)}
    assert len(a["dead"]) == 9 and a["dead"] == b["dead"]
    # the librdkafka member learnt its group generation (what fences stale writers)
    assert b["generation"] >= 0
    for p in range(3):
        ca, cb = a["ckpt"][p], b["ckpt"][p]
        assert ca.user_ids == cb.user_ids
        assert torch.equal(ca.state.pos, cb.state.pos)
        assert torch.equal(ca.state.last_ts, cb.state.last_ts)
        torch.testing.assert_close(ca.state.S, cb.state.S, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ca.state.h, cb.state.h, rtol=1e-4, atol=1e-5)


def test_confluent_stop_and_restart_skips_nothing_and_applies_nothing_twice(tmp_path, kafka_config):
    cfg = service_config(tmp_path, kafka_config(partitions=3, client="confluent"))
    events = make_events(900, 40, seed=5)
    ends = send_with_bad(cfg, events[:600], seed=5, n_bad=6)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    stop_service(built, ingest, consumer, thread)
    assert thread.error is None and built.engine.totals.events == 600
    first = {p: checkpoints_of(cfg).latest_offset(p) for p in range(3)}
    assert committed(cfg) == first

    send_with_bad(cfg, events[600:], seed=6, n_bad=4, ends=ends)
    built, ingest, consumer, thread = start_service(cfg)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    stop_service(built, ingest, consumer, thread)
    assert thread.error is None and built.engine.totals.events == 300
    assert committed(cfg) == {p: ends.get(p, 0) for p in range(3)}
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)


def test_the_configuration_takes_confluent_and_refuses_unknown_clients(tmp_path):
    cfg = Config()
    cfg.kafka.client = "librdkafka"
    with pytest.raises(ConfigError, match="kafka.client 'librdkafka' is not one of"):
        validate(cfg)
    cfg.kafka.client = "confluent"
    validate(cfg)  # recmem ingest with librdkafka is fine
    cfg.server.advertised_address = "10.0.0.1:50051"
    validate(cfg)  # recmem serve too: its claims name the address (test_scaleout_confluent)
    with pytest.raises(ValueError, match="kafka.client 'x' is not one of"):
        make_consumer(dataclasses.replace(cfg.kafka, client="x"), None)  # type: ignore[arg-type]


def test_the_generation_is_read_from_librdkafkas_group_metadata():
    member = b"rdkafka-0c1d\x00\x01"
    assert generation_of(b"CGMDv2:" + (7).to_bytes(4, "little") + b"g\x00" + member) == 7
    assert generation_of(b"CGMDv3:" + (7).to_bytes(4, "little")) == -1
    assert generation_of(object()) == -1


def test_confluent_rebalance_across_two_services(tmp_path, kafka_config):
    """Cooperative-sticky through librdkafka's incremental assignment: B joins, A's
    revoked partitions move to B through their checkpoints, each claimed by the newer
    generation."""
    cfg = service_config(tmp_path, kafka_config(partitions=4, client="confluent"))
    events = make_events(1200, 60, seed=13)
    ends = send_with_bad(cfg, events[:500], seed=13, n_bad=6)
    a = start_service(cfg)
    wait_until(lambda: a[0].engine.totals.events >= 500, 60, "service A to apply 500 events")
    first_generation = a[1].generation
    b = start_service(cfg)
    wait_until(lambda: a[1].assigned and b[1].assigned, 60, "both services to own partitions")
    assert not a[1].assigned & b[1].assigned
    assert b[1].generation > first_generation >= 0
    send_with_bad(cfg, events[500:], seed=14, n_bad=6, ends=ends)
    wait_until(lambda: caught_up(cfg, ends), 60, "checkpoints at the end offsets")
    stop_service(*a)
    stop_service(*b)
    assert a[3].error is None and b[3].error is None
    assert_checkpoints_equal_clean_pass(cfg, events, tmp_path)
