"""Client settings shared by the consumer, producer and admin client, and topic creation."""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaAdminClient

from recmem.config import KafkaConfig

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
