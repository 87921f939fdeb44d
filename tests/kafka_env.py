"""The Kafka settings every test and cluster benchmark starts from (a light module: the
conftest fixtures and bench/ import it without the model stack)."""

from __future__ import annotations

from streams.admin import ensure_topics
from streams.config import KafkaConfig


def kafka_settings(
    bootstrap: str, partitions: int, topic: str = "events", **fields: object
) -> KafkaConfig:
    """A KafkaConfig on ``bootstrap`` with topic ``topic`` (``partitions`` partitions) and
    its dead-letter topic ``topic.dlq``, both created on the broker; no time bounds, the
    metrics endpoint off, polls of 100 ms; ``fields`` set any other KafkaConfig field."""
    cfg = KafkaConfig(
        bootstrap_servers=bootstrap,
        topic=topic,
        dead_letter_topic=f"{topic}.dlq",
        max_wait_ms=100,
        min_ts_ms=0,
        max_past_ms=0,
        max_future_ms=0,
        partitions=partitions,
        metrics_port=0,
    )
    for key, value in fields.items():
        if not hasattr(cfg, key):
            raise AttributeError(f"KafkaConfig has no field {key!r}")
        setattr(cfg, key, value)
    ensure_topics(cfg, {cfg.topic: partitions, cfg.dead_letter_topic: 1})
    return cfg
