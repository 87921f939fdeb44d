"""Client settings shared by the consumer, producer and admin client, and topic creation."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from streams.config import KafkaConfig

log = logging.getLogger(__name__)


_NAMES: dict[str, tuple[str, str]] = {
    "bootstrap_servers": ("bootstrap_servers", "bootstrap.servers"),
    "security_protocol": ("security_protocol", "security.protocol"),
    "sasl_mechanism": ("sasl_mechanism", "sasl.mechanism"),
    "sasl_username": ("sasl_plain_username", "sasl.username"),
    "sasl_password": ("sasl_plain_password", "sasl.password"),
    "ssl_cafile": ("ssl_cafile", "ssl.ca.location"),
    "ssl_certfile": ("ssl_certfile", "ssl.certificate.location"),
    "ssl_keyfile": ("ssl_keyfile", "ssl.key.location"),
}
"""KafkaConfig field -> (kafka-python argument, librdkafka property)."""


def _connection(cfg: KafkaConfig) -> dict[str, Any]:
    """KafkaConfig field -> value, for the fields that reach the client: the servers as a
    list, the SASL fields with a SASL protocol, the SSL files that are set with SSL."""
    out: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in cfg.bootstrap_servers.split(",") if s.strip()],
        "security_protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL"):
        out["sasl_mechanism"] = cfg.sasl_mechanism or "PLAIN"
        out["sasl_username"] = cfg.sasl_username
        out["sasl_password"] = cfg.sasl_password
    if cfg.security_protocol.endswith("SSL"):
        for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(cfg, key):
                out[key] = getattr(cfg, key)
    return out


def client_settings(cfg: KafkaConfig) -> dict[str, Any]:
    """kafka-python keyword arguments for the bootstrap servers and security settings."""
    return {_NAMES[field][0]: value for field, value in _connection(cfg).items()}


def librdkafka_settings(cfg: KafkaConfig) -> dict[str, Any]:
    """The same as librdkafka properties (confluent-kafka's configuration dict)."""
    out = {_NAMES[field][1]: value for field, value in _connection(cfg).items()}
    out["bootstrap.servers"] = ",".join(out["bootstrap.servers"])
    return out


def ensure_topics(cfg: KafkaConfig, partitions: dict[str, int], timeout_s: float = 10.0) -> None:
    """Create each missing topic with the given partition count (existing ones are left as
    they are: the partition count of a topic cannot be changed on every broker)."""
    admin = KafkaAdminClient(
        client_id="recmem-admin", request_timeout_ms=int(timeout_s * 1000), **client_settings(cfg)
    )
    try:
        existing = set(admin.list_topics())
        missing = {name: n for name, n in partitions.items() if name not in existing}
        if missing:
            log.info("creating topics %s", missing)
            admin.create_topics(
                {
                    name: {"num_partitions": n, "replication_factor": 1}
                    for name, n in missing.items()
                },
                timeout_ms=int(timeout_s * 1000),
            )
    finally:
        admin.close()


def end_offsets(
    cfg: KafkaConfig, topic: str | None = None, timeout_s: float = 10.0
) -> dict[int, int]:
    """Partition -> highwater (the offset the next record will get) of ``topic``
    (``cfg.topic`` when not given).

    Read from fetch responses rather than ``KafkaConsumer.end_offsets``, which tansu answers
    wrongly after batched produce: seek each partition to (about) its end and poll until
    every partition reported its highwater. Raises TimeoutError after ``timeout_s``."""
    topic = topic or cfg.topic
    consumer = KafkaConsumer(
        client_id="recmem-offsets", enable_auto_commit=False, **client_settings(cfg)
    )
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"topic {topic!r} does not exist")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        deadline = time.monotonic() + timeout_s
        while any(consumer.highwater(tp) is None for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no highwater for every partition of {topic} in {timeout_s}s")
            consumer.poll(timeout_ms=100)
        return {tp.partition: int(consumer.highwater(tp)) for tp in tps}
    finally:
        consumer.close()


def partition_count(cfg: KafkaConfig, topic: str | None = None) -> int:
    """How many partitions ``topic`` (``cfg.topic`` when not given) has, from the broker's
    metadata; raises ValueError when the topic does not exist."""
    topic = topic or cfg.topic
    consumer = KafkaConsumer(client_id="recmem-metadata", **client_settings(cfg))
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"topic {topic!r} does not exist")
        return len(partitions)
    finally:
        consumer.close()
