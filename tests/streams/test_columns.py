"""The fast poll decoding (streams.columns.decode_records) against its plain reference on
random polls of good and malformed records, and the batched duplicate keys against
key_of."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.recmem.v1 import event_pb2
from streams.batch import EventBatch, key_of, keys_of
from streams.codec import make_event
from streams.columns import _least_size, decode_records, decode_records_reference
from streams.validate import Limits

NOW = 1_700_000_000_000
TOPIC = "events"

ids = st.one_of(
    st.sampled_from(["u1", "u2", "i7", "", "é" * 3, "x" * 9, "ü" * 5, "2:2"]),
    st.text(max_size=12),
)
optional_ids = st.one_of(st.none(), ids)
timestamps = st.one_of(
    st.sampled_from([0, -5, NOW, NOW - 1, NOW + 1, NOW // 1000, NOW - 10**9, NOW + 10**9]),
    st.sampled_from([NOW - 10**8 - 1, NOW - 10**8, NOW - 86_400_001, NOW + 60_001]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
floats = st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, 0.0, 1.5]))


@st.composite
def event_values(draw: st.DrawFn) -> tuple[bytes | None, bytes | None]:
    """(key, value) of one record: an Event with any fields (some unset, some set to ""),
    keyed by its user or otherwise, or bytes that are not an Event."""
    kind = draw(st.sampled_from(["event", "event", "event", "garbage", "none", "cut"]))
    if kind == "none":
        return draw(st.one_of(st.none(), st.binary(max_size=4))), None
    if kind == "garbage":
        return b"u1", draw(st.binary(max_size=24))
    # a good event, then (often) one field drawn from anything, so that each rule is
    # the only one a record breaks as well as one of several
    fields = {
        "user_id": draw(st.sampled_from(["u1", "u2", "ü"])),
        "item_id": draw(st.sampled_from(["i1", "i2"])),
        "ts_ms": NOW + draw(st.integers(min_value=-1000, max_value=1000)),
        "action": draw(st.integers(min_value=0, max_value=6)),
        "value": draw(st.floats(width=32, allow_nan=False, allow_infinity=False)),
    }
    wild = {
        "user_id": ids,
        "item_id": ids,
        "ts_ms": timestamps,
        "action": st.integers(min_value=-3, max_value=9),
        "value": floats,
    }
    for name in draw(st.lists(st.sampled_from(sorted(wild)), max_size=2)):
        fields[name] = draw(wild[name])
    e = event_pb2.Event(**fields)
    for name in ("session_id", "event_id"):
        text = draw(optional_ids)
        if text is not None:
            setattr(e, name, text)
    value = e.SerializeToString()
    if kind == "cut" and value:
        value = value[: draw(st.integers(min_value=0, max_value=len(value) - 1))]
    key = draw(
        st.sampled_from(["user", "user", "user", "other", "none"]).map(
            lambda k: e.user_id.encode() if k == "user" else (None if k == "none" else b"zz")
        )
    )
    return key, value


limits_st = st.builds(
    Limits,
    max_past_ms=st.sampled_from([0, 86_400_000]),
    max_future_ms=st.sampled_from([0, 60_000]),
    max_field_bytes=st.sampled_from([4, 8, 256]),
    min_ts_ms=st.sampled_from([0, NOW - 10**8]),
)


@st.composite
def polls(draw: st.DrawFn) -> dict[int, list[tuple[int, bytes | None, bytes | None]]]:
    out = {}
    for p in draw(st.lists(st.integers(min_value=0, max_value=5), unique=True, max_size=3)):
        records = draw(st.lists(event_values(), max_size=12))
        start = draw(st.integers(min_value=0, max_value=1000))
        out[p] = [(start + i, k, v) for i, (k, v) in enumerate(records)]
    return out


def assert_same_batch(a: EventBatch, b: EventBatch) -> None:
    for name in ("user_id", "item_id", "session_id", "event_id"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("ts_ms", "action", "value", "partition", "offset", "key"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@settings(max_examples=300, deadline=None)
@given(polls(), limits_st)
def test_decode_records_matches_the_reference(records, limits) -> None:
    fast, fast_dead = decode_records(TOPIC, records, NOW, limits)
    ref, ref_dead = decode_records_reference(TOPIC, records, NOW, limits)
    assert_same_batch(fast, ref)
    assert fast_dead == ref_dead
    assert len(fast) + len(fast_dead) == sum(map(len, records.values()))


def test_every_bad_record_becomes_its_dead_letter_in_order() -> None:
    good = make_event("u1", "i1", NOW, "click", 1.0, event_id="e1")
    empty_session = event_pb2.Event(user_id="u2", item_id="i", ts_ms=NOW, session_id="")
    records = {
        2: [
            (5, b"u1", good.SerializeToString()),
            (6, b"u1", None),
            (7, b"u1", b"\xff\xff"),
            (8, b"u2", empty_session.SerializeToString()),
            (9, b"nope", good.SerializeToString()),
        ],
        0: [(3, b"u1", make_event("u1", "i2", NOW + 10**9, 0).SerializeToString())],
    }
    limits = Limits(max_future_ms=60_000)
    batch, dead = decode_records(TOPIC, records, NOW, limits)
    assert [(d.partition, d.offset, d.reason) for d in dead] == [
        (0, 3, "ts_too_new"),
        (2, 6, "empty_value"),
        (2, 7, "undecodable"),
        (2, 9, "key_mismatch"),
    ]
    assert batch.offset.tolist() == [5, 8] and batch.session_id == [None, ""]
    assert batch.event_id == ["e1", None]
    assert_same_batch(batch, decode_records_reference(TOPIC, records, NOW, limits)[0])


def test_an_empty_poll_is_an_empty_batch() -> None:
    batch, dead = decode_records(TOPIC, {0: []}, NOW, Limits())
    assert len(batch) == 0 and dead == [] and batch.key.dtype == np.int64


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(ids, timestamps, st.integers(0, 5), optional_ids), max_size=20))
def test_keys_of_is_key_of_per_event(rows) -> None:
    items = [r[0] for r in rows]
    ts = np.array([r[1] for r in rows], np.int64)
    action = np.array([r[2] for r in rows], np.int64)
    event_id = [r[3] for r in rows]
    want = [key_of(i, t, a, e) for i, t, a, e in zip(items, ts.tolist(), action.tolist(), event_id)]
    got = keys_of(items, ts, action, event_id)
    assert got.dtype == np.int64 and got.tolist() == want


ALL_BOUNDS = Limits(max_past_ms=86_400_000, max_future_ms=60_000, max_field_bytes=8,
                    min_ts_ms=NOW - 10**8)  # fmt: skip
ONE_BAD_FIELD = [
    ("action", 7), ("action", -1), ("action", 6), ("action", 0),
    ("value", math.nan), ("value", math.inf), ("value", -math.inf),
    ("ts_ms", 0), ("ts_ms", -1), ("ts_ms", NOW // 1000), ("ts_ms", NOW - 10**8 - 1),
    ("ts_ms", NOW - 10**8), ("ts_ms", NOW - 86_400_001), ("ts_ms", NOW + 60_001),
    ("ts_ms", NOW + 60_000), ("user_id", ""), ("user_id", "u" * 9), ("user_id", "é" * 4),
    ("user_id", "é" * 5), ("item_id", ""), ("item_id", "i" * 9), ("session_id", ""),
    ("session_id", "s" * 9), ("session_id", "s"), ("event_id", ""), ("event_id", "e" * 9),
    ("event_id", "e"),
]  # fmt: skip


def test_each_rule_alone_gives_the_references_result() -> None:
    """One record per bad (or borderline) field, the rest good, under every bound at once,
    under none and under ``min_ts_ms`` alone: the fast form decides each as the reference does."""
    for limits in (ALL_BOUNDS, Limits(max_field_bytes=8), Limits(min_ts_ms=NOW - 10**8)):
        for name, bad in ONE_BAD_FIELD:
            e = event_pb2.Event(user_id="u1", item_id="i1", ts_ms=NOW, action=2, value=1.0)
            setattr(e, name, bad)
            records = {1: [(4, e.user_id.encode(), e.SerializeToString())]}
            fast, fast_dead = decode_records(TOPIC, records, NOW, limits)
            ref, ref_dead = decode_records_reference(TOPIC, records, NOW, limits)
            assert fast_dead == ref_dead, (name, bad)
            assert_same_batch(fast, ref)


def test_ids_set_to_empty_in_any_encoding_are_kept_apart_from_unset_ones() -> None:
    """An id set to "" reads as "" like an unset one; the fast form finds it however the
    producer encoded it (an overlong tag or length, a repeated field, unknown fields)."""
    base = event_pb2.Event(user_id="u1", item_id="i1", ts_ms=NOW).SerializeToString()
    wires = [
        base,
        base + b"\x32\x00",  # session_id = ""
        base + b"\xb2\x00\x00",  # session_id = "" behind an overlong tag
        base + b"\x3a\x80\x00",  # event_id = "" with an overlong length
        base + b"\x3a\x01e\x3a\x00",  # event_id "e", then "" (the last one wins)
        base + b"\x40\x01",  # an unknown field 8
        base + b"\x0a\x02u1",  # user_id again: longer, same values
    ]
    records = {0: [(i, b"u1", w) for i, w in enumerate(wires)]}
    fast, fast_dead = decode_records(TOPIC, records, NOW, Limits())
    ref, ref_dead = decode_records_reference(TOPIC, records, NOW, Limits())
    assert fast_dead == ref_dead == []
    assert fast.session_id == [None, "", "", None, None, None, None]
    assert fast.event_id == [None, None, None, "", "", None, None]
    assert_same_batch(fast, ref)


@settings(max_examples=200, deadline=None)
@given(ids, ids, optional_ids, optional_ids, timestamps, st.integers(-(2**31), 2**31 - 1), floats)
def test_least_size_is_the_length_of_the_shortest_encoding(
    user, item, session, event_id, ts, action, value
) -> None:
    """upb writes the shortest encoding: its length is _least_size exactly, but for a
    -0.0 value (a larger figure could hide an id set to "")."""
    e = event_pb2.Event(user_id=user, item_id=item, ts_ms=ts, action=action, value=value)  # type: ignore[arg-type]
    for name, text in (("session_id", session), ("event_id", event_id)):
        if text:  # set to "" is the case _least_size leaves out
            setattr(e, name, text)
    size = _least_size(
        [e.user_id.encode()], [e.item_id], [e.session_id], [e.event_id],
        np.array([e.ts_ms], np.int64), np.array([e.action], np.int64),
        np.array([e.value], np.float64),
    )  # fmt: skip
    # -0.0 is sent and counted as absent (fewer bytes than sent are safe, more are not)
    negative_zero = 5 if e.value == 0 and math.copysign(1.0, e.value) < 0 else 0
    assert size.tolist() == [len(e.SerializeToString()) - negative_zero]
