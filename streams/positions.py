"""Checking a resume point against the broker before seeking to it.

A checkpoint's offsets only mean something in the topic they were read from. A topic that
was deleted and created again (or lost by a broker with in-memory storage) starts its
offsets anew, so seeking to the old offsets would silently skip the new records. And an
offset the log no longer holds (retention) means records were removed before they were
applied. The consumer checks each partition it resumes:

1. the topic's id (Kafka's topic UUID, from the metadata) against the one the checkpoint
   recorded, where both are known;
2. where either is unknown (a broker that gives no topic ids), the record at the offset
   before the resume point against the fingerprint the checkpoint recorded: blake2b of its
   key and value. A re-created topic passes only if it holds the same bytes at the same
   offset (e.g. a byte-identical replay of the same history), and then continuing is right;
3. the log's bounds: a resume point past the end means the records applied are gone (the
   topic was re-created or truncated); one before the log's start means retention removed
   records not yet applied.

Policies (``kafka.on_topic_mismatch``, ``kafka.on_offset_out_of_range``): ``fail`` (the
default) stops with a :class:`PositionError` naming the setting; ``earliest`` / ``latest``
keep the states and read the partition from its first / next new offset.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from streams.admin import client_settings
from streams.config import KafkaConfig
from streams.sink import Resume

log = logging.getLogger(__name__)

POLICIES = ("fail", "earliest", "latest")


class PositionError(ValueError):
    """A resume point this consumer must not seek to under the configured policy."""


def fingerprint(key: bytes | None, value: bytes | None) -> str:
    """Identity of one record's content (key and value), as stored with a checkpoint."""
    h = hashlib.blake2b(digest_size=12)
    for part in (key, value):
        h.update(b"\x00" if part is None else b"\x01" + len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def topic_id_of(consumer: KafkaConsumer, topic: str) -> str:
    """The broker's id of ``topic`` ("" when the broker gives none). kafka-python keeps it
    in the cluster metadata (Metadata v10+), which has no public accessor."""
    consumer.partitions_for_topic(topic)  # metadata for the topic is loaded
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    getter = getattr(cluster, "topic_id", None)
    tid = getter(topic) if callable(getter) else None
    return str(tid) if tid else ""


@dataclass(frozen=True)
class PartitionFacts:
    """What the broker says about one partition around a resume point."""

    log_start: int
    highwater: int
    record_before: str | None
    """Fingerprint of the record at resume - 1 (None: not in the log)."""


def probe(
    cfg: KafkaConfig, resumes: dict[int, int], timeout_s: float = 15.0
) -> tuple[str, dict[int, PartitionFacts]]:
    """(topic id, facts per partition) for resume offsets > 0 of ``cfg.topic``, read by a
    consumer of its own (outside the group): log start (ListOffsets earliest), highwater
    (from fetch responses; tansu's ListOffsets latest is wrong) and the record before the
    resume point."""
    consumer = KafkaConsumer(
        client_id="recmem-probe",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **client_settings(cfg),
    )
    try:
        tid = topic_id_of(consumer, cfg.topic)
        tps = {p: TopicPartition(cfg.topic, p) for p in resumes}
        if not tps:
            return tid, {}
        consumer.assign(list(tps.values()))
        starts = consumer.beginning_offsets(list(tps.values()))
        for p, tp in tps.items():
            consumer.seek(tp, max(resumes[p] - 1, int(starts[tp])))
        found: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout_s
        while len(found) < len(tps) and time.monotonic() < deadline:
            got = consumer.poll(timeout_ms=200)
            for tp, records in got.items():
                want = resumes[tp.partition] - 1
                for rec in records:
                    if rec.offset == want:
                        found[tp.partition] = fingerprint(rec.key, rec.value)
                        break
                    if rec.offset > want:
                        found.setdefault(tp.partition, None)
                        break
            for p, tp in tps.items():
                high = consumer.highwater(tp)
                if p not in found and high is not None and high <= resumes[p] - 1:
                    found[p] = None  # the record is past the end of the log
        facts = {}
        for p, tp in tps.items():
            high = consumer.highwater(tp)
            if high is None:
                raise TimeoutError(f"no fetch answer for {cfg.topic}/{p} in {timeout_s:.0f} s")
            facts[p] = PartitionFacts(int(starts[tp]), int(high), found.get(p))
        return tid, facts
    finally:
        consumer.close()


def judge(
    cfg: KafkaConfig, partition: int, resume: Resume, live_topic_id: str, facts: PartitionFacts
) -> tuple[str, str] | None:
    """(setting, reason) when ``resume`` must not be sought to as it is, else None."""
    n = resume.next_offset
    where = f"{cfg.topic}/{partition} at offset {n}"
    if resume.topic_id and live_topic_id and resume.topic_id != live_topic_id:
        return "on_topic_mismatch", (
            f"{where}: the checkpoint was written for topic id {resume.topic_id}, the "
            f"topic now has id {live_topic_id} (deleted and created again?)"
        )
    same_id = bool(resume.topic_id) and resume.topic_id == live_topic_id
    if n > facts.highwater:
        setting = "on_offset_out_of_range" if same_id else "on_topic_mismatch"
        return setting, (
            f"{where}: the partition ends at offset {facts.highwater}, before the records "
            "the checkpoint applied (the topic was re-created or truncated)"
        )
    seen = facts.record_before
    if not same_id and resume.last_record and seen is not None and seen != resume.last_record:
        return "on_topic_mismatch", (
            f"{where}: the record at offset {n - 1} is not the one the checkpoint "
            "applied (the topic was re-created)"
        )
    if n < facts.log_start:
        return "on_offset_out_of_range", (
            f"{where}: the log starts at offset {facts.log_start}; offsets {n}.."
            f"{facts.log_start - 1} were removed before they were applied"
        )
    return None


def decide(cfg: KafkaConfig, problem: tuple[str, str]) -> str:
    """The policy for ``problem`` ("earliest" | "latest"); raises PositionError for fail."""
    setting, reason = problem
    policy = getattr(cfg, setting)
    if policy not in POLICIES:
        raise PositionError(f"kafka.{setting} = {policy!r} is not one of {', '.join(POLICIES)}")
    if policy == "fail":
        raise PositionError(
            f"{reason}; refusing to seek there. Set kafka.{setting} = earliest or latest to "
            "keep the states and read from the partition's start or end, or move the "
            "checkpoints away to start fresh"
        )
    log.warning("%s; kafka.%s = %s: reading from the partition's %s", reason, setting,
                policy, "start" if policy == "earliest" else "end")  # fmt: skip
    return policy


def as_resume(value: Any) -> Resume:
    return value if isinstance(value, Resume) else Resume(int(value))
