from __future__ import annotations

import pytest

from streams.admin import client_settings, end_offsets, ensure_topics, librdkafka_settings
from streams.codec import make_event
from streams.producer import EventProducer


def test_end_offsets_are_true_highwaters_after_batched_produce(kafka_config):
    cfg = kafka_config(partitions=3)
    ensure_topics(cfg, {cfg.topic: 3})  # existing topic: left as it is
    events = [make_event("only-user", f"i{i}", 1 + i) for i in range(250)]
    with EventProducer(cfg, linger_ms=20) as producer:
        producer.send(events, progress=False)
    offsets = end_offsets(cfg)
    assert sorted(offsets) == [0, 1, 2]
    assert sorted(offsets.values()) == [0, 0, 250]  # one key: one partition, two empty


def test_end_offsets_of_a_missing_topic_is_an_error(kafka_config):
    cfg = kafka_config(partitions=1)
    with pytest.raises(ValueError, match="does not exist"):
        end_offsets(cfg, "no-such-topic-here", timeout_s=3)


def test_client_settings_carry_security():
    from recmem.config import KafkaConfig

    cfg = KafkaConfig(
        bootstrap_servers="a:1, b:2",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="me",
        sasl_password="pw",
        ssl_cafile="/ca.pem",
    )
    s = client_settings(cfg)
    assert s["bootstrap_servers"] == ["a:1", "b:2"]
    assert (s["sasl_mechanism"], s["sasl_plain_username"], s["sasl_plain_password"]) == (
        "SCRAM-SHA-512",
        "me",
        "pw",
    )
    assert s["ssl_cafile"] == "/ca.pem" and "ssl_certfile" not in s
    assert "sasl_mechanism" not in client_settings(KafkaConfig())
    r = librdkafka_settings(cfg)
    assert r == {
        "bootstrap.servers": "a:1,b:2",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "me",
        "sasl.password": "pw",
        "ssl.ca.location": "/ca.pem",
    }
    assert librdkafka_settings(KafkaConfig()) == {
        "bootstrap.servers": "127.0.0.1:9092",
        "security.protocol": "PLAINTEXT",
    }
