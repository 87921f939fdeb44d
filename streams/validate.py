"""Validation of consumed records: each becomes a ValidEvent or a DeadLetter, never an error.

Rules (SPEC section 2, issue 4), checked in this order; the first failure is the reason:

- ``empty_value``: the record has no value (a tombstone);
- ``undecodable``: the value is not a ``recmem.v1.Event`` (bad bytes, invalid UTF-8 in a
  string field);
- ``missing_user`` / ``missing_item`` / ``missing_ts``: an empty id, or ``ts_ms`` unset (0)
  or negative;
- ``field_too_long``: user, item, session or event id longer than ``max_field_bytes`` (UTF-8);
- ``key_mismatch``: the Kafka key is not the user id in UTF-8. The key decides the partition
  and the partition decides which consumer owns the user's state, so an event keyed otherwise
  (or not keyed) could be applied out of order or by two owners: it is rejected, not repaired;
- ``bad_action``: an Action enum value this version does not know;
- ``bad_value``: ``value`` is NaN or infinite;
- ``ts_in_seconds``: ``ts_ms`` before ``min_ts_ms``, and ``ts_ms * 1000`` would pass the
  time bounds: a producer sending seconds since the epoch;
- ``ts_too_old`` / ``ts_too_new``: ``ts_ms`` before ``min_ts_ms`` or ``now - max_past_ms``, or
  after ``now + max_future_ms`` (0 disables each bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from streams.codec import action_from_wire, decode_event
from streams.config import KafkaConfig

REASONS: tuple[str, ...] = (
    "empty_value",
    "undecodable",
    "missing_user",
    "missing_item",
    "missing_ts",
    "field_too_long",
    "key_mismatch",
    "bad_action",
    "bad_value",
    "ts_in_seconds",
    "ts_too_old",
    "ts_too_new",
)
"""Every dead-letter reason code."""


@dataclass(frozen=True, slots=True)
class ValidEvent:
    """A validated event and where it came from. ``action`` indexes proto.actions.ACTIONS."""

    user_id: str
    item_id: str
    ts_ms: int
    action: int
    value: float
    session_id: str | None
    partition: int
    offset: int
    event_id: str | None = None
    """The producer's id of the event, when it set one (the duplicate policy's key)."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A rejected record: why (a code from REASONS and a message) and the original bytes."""

    reason: str
    message: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True, slots=True)
class Limits:
    """The configured bounds a record must respect."""

    max_past_ms: int = 0
    max_future_ms: int = 0
    max_field_bytes: int = 256
    min_ts_ms: int = 0

    @classmethod
    def from_config(cls, cfg: KafkaConfig) -> Limits:
        return cls(cfg.max_past_ms, cfg.max_future_ms, cfg.max_field_bytes, cfg.min_ts_ms)

    def _in_window(self, ts_ms: int, now_ms: int) -> bool:
        return (
            ts_ms >= self.min_ts_ms
            and (self.max_past_ms <= 0 or ts_ms >= now_ms - self.max_past_ms)
            and (self.max_future_ms <= 0 or ts_ms <= now_ms + self.max_future_ms)
        )

    def ts_problem(self, ts_ms: int, now_ms: int) -> tuple[str, str] | None:
        """(reason, message) when ``ts_ms`` is outside the configured time bounds, else None
        (the Kafka consumer and the rank service's context events both apply this)."""
        if self._in_window(ts_ms, now_ms):
            return None
        if ts_ms < self.min_ts_ms:
            if self._in_window(ts_ms * 1000, now_ms):
                return "ts_in_seconds", (
                    f"ts_ms {ts_ms} is before kafka.min_ts_ms ({self.min_ts_ms}) and looks like "
                    "seconds since the epoch: ts_ms counts milliseconds"
                )
            return "ts_too_old", f"ts_ms {ts_ms} is before kafka.min_ts_ms ({self.min_ts_ms})"
        if ts_ms < now_ms:
            return "ts_too_old", f"ts_ms {ts_ms} is more than {self.max_past_ms} ms before now"
        return "ts_too_new", f"ts_ms {ts_ms} is more than {self.max_future_ms} ms after now"


def validate_record(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    now_ms: int,
    limits: Limits,
) -> ValidEvent | DeadLetter:
    """Decode and check one record. Never raises on bad input. The checks run in a fixed
    order and the first that fails names the dead letter's reason. Called once per
    consumed record on the consumer's thread (per-record Python: kept lean)."""
    if value is None:
        return DeadLetter(
            "empty_value", "record has no value", topic, partition, offset, key, value
        )
    try:
        event = decode_event(value)
    except (DecodeError, ValueError, TypeError) as e:
        return DeadLetter(
            "undecodable", f"not a recmem.v1.Event: {e}", topic, partition, offset, key, value
        )
    user_id, item_id, ts_ms = event.user_id, event.item_id, event.ts_ms
    problem: tuple[str, str] | None = None
    if not user_id:
        problem = "missing_user", "user_id is empty"
    elif not item_id:
        problem = "missing_item", "item_id is empty"
    elif ts_ms <= 0:
        problem = "missing_ts", f"ts_ms is unset or negative ({ts_ms})"
    if problem is not None:
        return DeadLetter(*problem, topic, partition, offset, key, value)
    session_id = event.session_id if event.HasField("session_id") else None
    event_id = event.event_id if event.HasField("event_id") else None
    user_bytes = user_id.encode()
    limit = limits.max_field_bytes
    # a text of at most limit // 4 characters is at most limit bytes in UTF-8: no encode
    short = limit // 4
    for name, text in (
        ("user_id", user_id),
        ("item_id", item_id),
        ("session_id", session_id),
        ("event_id", event_id),
    ):
        if text is not None and len(text) > short:
            size = len(user_bytes) if name == "user_id" else len(text.encode())
            if size > limit:
                return DeadLetter(
                    "field_too_long", f"{name} is {size} bytes (limit {limit})",
                    topic, partition, offset, key, value,
                )  # fmt: skip
    if key != user_bytes:
        shown = "no key" if key is None else f"key {key[:64]!r}"
        return DeadLetter(
            "key_mismatch", f"{shown} is not the user id {user_bytes[:64]!r}",
            topic, partition, offset, key, value,
        )  # fmt: skip
    action = action_from_wire(event.action)
    if action is None:
        problem = "bad_action", f"unknown action enum value {event.action}"
        return DeadLetter(*problem, topic, partition, offset, key, value)
    if not math.isfinite(event.value):
        problem = "bad_value", f"value is {event.value}"
    else:
        problem = limits.ts_problem(ts_ms, now_ms)
    if problem is not None:
        return DeadLetter(*problem, topic, partition, offset, key, value)
    return ValidEvent(
        user_id, item_id, int(ts_ms), action, float(event.value), session_id, partition,
        offset, event_id,
    )  # fmt: skip
