"""Client settings shared by the consumer, producer and admin client, and topic creation."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from streams.config import KafkaConfig

log = logging.getLogger(__name__)


def client_settings(cfg: KafkaConfig) -> dict[str, Any]:
    """kafka-python keyword arguments for the bootstrap servers and security settings."""
    settings: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in cfg.bootstrap_servers.split(",") if s.strip()],
        "security_protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL"):
        settings["sasl_mechanism"] = cfg.sasl_mechanism or "PLAIN"
        settings["sasl_plain_username"] = cfg.sasl_username
        settings["sasl_plain_password"] = cfg.sasl_password
    if cfg.security_protocol.endswith("SSL"):
        for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(cfg, key):
                settings[key] = getattr(cfg, key)
    return settings


def librdkafka_settings(cfg: KafkaConfig) -> dict[str, object]:
    """librdkafka properties for the bootstrap servers and security settings (the twin of
    ``streams.admin.client_settings``)."""
    settings: dict[str, object] = {
        "bootstrap.servers": ",".join(
            s.strip() for s in cfg.bootstrap_servers.split(",") if s.strip()
        ),
        "security.protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL"):
        settings["sasl.mechanism"] = cfg.sasl_mechanism or "PLAIN"
        settings["sasl.username"] = cfg.sasl_username
        settings["sasl.password"] = cfg.sasl_password
    if cfg.security_protocol.endswith("SSL"):
        for key, prop in (
            ("ssl_cafile", "ssl.ca.location"),
            ("ssl_certfile", "ssl.certificate.location"),
            ("ssl_keyfile", "ssl.key.location"),
        ):
            if getattr(cfg, key):
                settings[prop] = getattr(cfg, key)
    return settings


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
