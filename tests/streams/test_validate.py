from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto.recmem.v1 import event_pb2
from streams.codec import encode_event, make_event
from streams.validate import REASONS, DeadLetter, Limits, ValidEvent, validate_record

NOW = 1_700_000_000_000
LIMITS = Limits(max_past_ms=86_400_000, max_future_ms=60_000, max_field_bytes=32)


def check(key, value, limits=LIMITS):
    return validate_record("events", 3, 17, key, value, NOW, limits)


def test_valid_event_carries_its_source():
    key, value = encode_event(make_event("u", "i", NOW, "cart", 2.0, "s1"))
    out = check(key, value)
    assert out == ValidEvent("u", "i", NOW, 2, 2.0, "s1", 3, 17)


def raw(**fields):
    return event_pb2.Event(**fields).SerializeToString()


GOOD = {"user_id": "u", "item_id": "i", "ts_ms": NOW}


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (b"u", None, "empty_value"),
        (b"u", b"\xff\xff\xff\xff", "undecodable"),
        (b"u", b"\x0a\x02\xc3\x28\x12\x01i\x18\x01", "undecodable"),  # invalid UTF-8 user_id
        (b"", raw(item_id="i", ts_ms=NOW), "missing_user"),
        (b"u", raw(user_id="u", ts_ms=NOW), "missing_item"),
        (b"u", raw(user_id="u", item_id="i"), "missing_ts"),
        (b"u", raw(**{**GOOD, "ts_ms": -5}), "missing_ts"),
        (b"u", raw(**{**GOOD, "item_id": "x" * 33}), "field_too_long"),
        (b"u", raw(**{**GOOD, "session_id": "é" * 17}), "field_too_long"),
        (b"v", raw(**GOOD), "key_mismatch"),
        (None, raw(**GOOD), "key_mismatch"),
        (b"u", raw(**GOOD, action=9), "bad_action"),  # type: ignore[arg-type]
        (b"u", raw(**GOOD, value=math.nan), "bad_value"),
        (b"u", raw(**{**GOOD, "ts_ms": NOW - 86_400_001}), "ts_too_old"),
        (b"u", raw(**{**GOOD, "ts_ms": NOW + 60_001}), "ts_too_new"),
    ],
)
def test_each_rule_names_its_reason(key, value, reason):
    out = check(key, value)
    assert isinstance(out, DeadLetter)
    assert out.reason == reason and out.reason in REASONS
    assert (out.topic, out.partition, out.offset, out.key, out.value) == (
        "events",
        3,
        17,
        key,
        value,
    )
    assert out.message


@pytest.mark.parametrize("field", ["user_id", "item_id", "session_id", "event_id"])
@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("\U0001f600" * 8, True),  # 8 characters of 4 bytes: exactly the 32-byte limit
        ("\U0001f600" * 8 + "x", False),  # 33 bytes
        ("x" * 32, True),
        ("\u00e9" * 16 + "x", False),  # 17 characters, 33 bytes
    ],
)
def test_the_field_limit_counts_utf8_bytes_at_the_boundary(field, text, ok):
    """validate_record skips encoding texts short enough to fit in any encoding; around
    the limit it must still count bytes, not characters."""
    fields = {**GOOD, field: text}
    key = fields["user_id"].encode()
    out = check(key, raw(**fields))
    if ok:
        assert isinstance(out, ValidEvent) and getattr(out, field) == text
    else:
        assert isinstance(out, DeadLetter) and out.reason == "field_too_long"
        assert out.message == f"{field} is 33 bytes (limit 32)"


MIN_TS = 631_152_000_000  # 1990-01-01, the default kafka.min_ts_ms


@pytest.mark.parametrize(
    ("ts", "reason", "fragment"),
    [
        (1, "ts_too_old", "before kafka.min_ts_ms"),  # 1 ms after 1970
        (NOW // 1000, "ts_in_seconds", "looks like seconds"),  # a producer sending seconds
        (MIN_TS // 1000 - 1, "ts_too_old", "before kafka.min_ts_ms"),  # x1000: still too old
        (MIN_TS - 1, "ts_too_old", "before kafka.min_ts_ms"),
    ],
)
def test_min_ts_catches_ancient_times_and_seconds(ts, reason, fragment):
    limits = Limits(max_future_ms=60_000, min_ts_ms=MIN_TS)
    out = check(b"u", raw(**{**GOOD, "ts_ms": ts}), limits)
    assert isinstance(out, DeadLetter) and out.reason == reason and out.reason in REASONS
    assert fragment in out.message
    for ok in (MIN_TS, 874_724_710_000, NOW):  # the bound itself, MovieLens-100K's first event
        assert isinstance(check(b"u", raw(**{**GOOD, "ts_ms": ok}), limits), ValidEvent)


def test_seconds_too_far_ahead_as_ms_are_not_called_seconds():
    limits = Limits(max_future_ms=60_000, min_ts_ms=MIN_TS)
    out = check(b"u", raw(**{**GOOD, "ts_ms": NOW // 1000 + 86_400}), limits)  # a day ahead
    assert isinstance(out, DeadLetter) and out.reason == "ts_too_old"


def test_zero_disables_the_time_window():
    limits = Limits(max_past_ms=0, max_future_ms=0)
    for ts in (1, NOW * 100):
        assert isinstance(check(b"u", raw(**{**GOOD, "ts_ms": ts}), limits), ValidEvent)


@given(key=st.none() | st.binary(max_size=64), value=st.none() | st.binary(max_size=256))
def test_never_raises_on_arbitrary_bytes(key, value):
    assert isinstance(check(key, value), ValidEvent | DeadLetter)
