"""What a dead letter holds: the rejected record's key and value, cut when needed so that
the dead-letter producer and a default broker always accept it, and headers saying why and
where it came from. ``streams.consumer.EventConsumer`` writes them."""

from __future__ import annotations

import hashlib

from streams.validate import DeadLetter

Headers = list[tuple[str, bytes]]
DeadLetterRecord = tuple[bytes | None, bytes | None, Headers]
"""(key, value, headers) as handed to the producer."""

DLQ_MAX_REQUEST_BYTES = 1024 * 1024
"""The dead-letter producer's ``max_request_size`` (kafka-python's default, and within a
default broker's ``message.max.bytes``)."""
DLQ_RECORD_BUDGET = DLQ_MAX_REQUEST_BYTES - 16 * 1024
"""Most bytes of key, value and headers one dead letter may hold (the rest is room for the
record and batch framing), so that no input can make a dead letter the producer refuses."""
DLQ_MAX_KEY_BYTES = 1024
"""An oversized dead letter's key is cut to this (the value is kept before the key)."""


class DeadLetterError(RuntimeError):
    """Dead letters the dead-letter topic did not take; the message names the record."""


def _nbytes(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)


def dead_letter_record(dead: DeadLetter, budget: int = DLQ_RECORD_BUDGET) -> DeadLetterRecord:
    """The key, value and headers a dead letter is written with.

    Headers say why and where the original came from: ``reason``, ``message`` (at most
    1 KiB), ``source_topic``, ``source_partition``, ``source_offset``. The original key and
    value are kept as they are when they fit ``budget`` together; otherwise the key is cut
    to DLQ_MAX_KEY_BYTES, then the value to what is left, and each part that was cut gets
    ``<part>_truncated`` (its original length) and ``<part>_sha256`` (of the original)."""
    headers = _source_headers(dead)
    key = dead.key
    # kafka-python refuses a record with neither key nor value: an empty value stands in
    value = dead.value if dead.value is not None or key is not None else b""
    if key is not None and len(key) > DLQ_MAX_KEY_BYTES and _nbytes(key, value, headers) > budget:
        headers += _cut_headers("key", key)
        key = key[:DLQ_MAX_KEY_BYTES]
    if value is not None and _nbytes(key, value, headers) > budget:
        headers += _cut_headers("value", value)
        value = value[: max(0, budget - _nbytes(key, b"", headers))]
    return key, value, headers


def minimal_dead_letter(dead: DeadLetter) -> DeadLetterRecord:
    """Headers only, with the lengths and hashes of the original key and value: what is
    written when the broker refuses even the cut dead letter (a smaller topic size limit)."""
    headers = _source_headers(dead)
    for part, original in (("key", dead.key), ("value", dead.value)):
        if original:
            headers += _cut_headers(part, original)
    return None, b"", headers


def _source_headers(dead: DeadLetter) -> Headers:
    return [
        ("reason", dead.reason.encode()),
        ("message", dead.message.encode()[:1024]),
        ("source_topic", dead.topic.encode()),
        ("source_partition", str(dead.partition).encode()),
        ("source_offset", str(dead.offset).encode()),
    ]


def _cut_headers(part: str, original: bytes) -> Headers:
    digest = hashlib.sha256(original).hexdigest().encode()
    return [(f"{part}_truncated", str(len(original)).encode()), (f"{part}_sha256", digest)]
