from __future__ import annotations

import pytest
from kafka import KafkaConsumer, TopicPartition

from streams.codec import decode_event, make_event
from streams.producer import EventProducer


def test_send_honours_limit_keys_by_user_and_counts(kafka_config):
    cfg = kafka_config(partitions=1)
    events = (make_event(f"u{i % 3}", f"i{i}", 1_000 + i) for i in range(50))
    with EventProducer(cfg) as producer:
        assert producer.send(events, limit=20, rate=5000.0, progress=False) == 20
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, auto_offset_reset="earliest")
    consumer.assign([TopicPartition(cfg.topic, 0)])
    records = []
    for _ in range(50):
        records += [r for recs in consumer.poll(timeout_ms=200).values() for r in recs]
        if len(records) >= 20:
            break
    consumer.close()
    assert len(records) == 20
    assert [decode_event(r.value).item_id for r in records] == [f"i{i}" for i in range(20)]
    assert all(r.key == decode_event(r.value).user_id.encode() for r in records)


def test_negative_rate_or_limit_is_refused(kafka_config):
    cfg = kafka_config(partitions=1)
    with EventProducer(cfg) as producer, pytest.raises(ValueError, match="must be >= 0"):
        producer.send([], rate=-1.0)
