"""Bad records go to the dead-letter topic with their reason and source offset; none reaches
the sink, and the consumer keeps running (real tansu broker)."""

from __future__ import annotations

import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, TopicPartition

from proto.recmem.v1 import event_pb2
from streams.codec import encode_event, make_event
from streams.consumer import EventConsumer
from streams.metrics import IngestMetrics
from streams.producer import EventProducer
from tests.streams.sinks import RecordingSink

DAY_MS = 86_400_000
NOW_MS = int(time.time() * 1000)  # at import: "too new" draws keep a day past the window
WINDOW = {"max_past_ms": 3650 * DAY_MS, "max_future_ms": DAY_MS, "max_field_bytes": 64}
ids = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def garbage(draw):
    value = draw(st.binary(min_size=1, max_size=64))
    return (
        None,
        value,
        {"undecodable", "missing_user", "missing_item", "missing_ts", "key_mismatch"},
    )


@st.composite
def missing_field(draw):
    fields = {"user_id": draw(ids), "item_id": draw(ids), "ts_ms": NOW_MS}
    dropped = draw(st.sampled_from(sorted(fields)))
    del fields[dropped]
    key = fields.get("user_id", "someone").encode()
    reason = {"user_id": "missing_user", "item_id": "missing_item", "ts_ms": "missing_ts"}
    return key, event_pb2.Event(**fields).SerializeToString(), {reason[dropped]}


@st.composite
def wrong_type(draw):
    user = draw(ids)
    item = draw(ids).encode()
    # user_id (field 1) sent as a varint, or ts_ms (field 3) sent as a string
    if draw(st.booleans()):
        value = b"\x08" + varint(draw(st.integers(0, 2**40))) + b"\x12" + varint(len(item)) + item
        expect = {"missing_user", "undecodable"}
    else:
        text = draw(st.binary(max_size=12))
        body = event_pb2.Event(user_id=user, item_id=item.decode()).SerializeToString()
        value = body + b"\x1a" + varint(len(text)) + text
        expect = {"missing_ts", "undecodable"}
    return user.encode(), value, expect


@st.composite
def absurd_time(draw):
    user = draw(ids)
    ts = draw(
        st.integers(1, NOW_MS - WINDOW["max_past_ms"] - 1)
        | st.integers(NOW_MS + WINDOW["max_future_ms"] + DAY_MS, 2**62)
    )
    expect = {"ts_too_old"} if ts < NOW_MS else {"ts_too_new"}
    key, value = encode_event(make_event(user, "item", ts))
    return key, value, expect


@st.composite
def huge_string(draw):
    user = draw(ids)
    big = "x" * draw(st.integers(WINDOW["max_field_bytes"] + 1, 20_000))
    field = draw(st.sampled_from(["item", "session"]))
    event = make_event(user, big if field == "item" else "i", NOW_MS, session_id=big)
    key, value = encode_event(event)
    return key, value, {"field_too_long"}


@st.composite
def wrong_key(draw):
    user = draw(ids)
    key, value = encode_event(make_event(user, "i", NOW_MS))
    other = draw(st.none() | st.binary(max_size=8).filter(lambda k: k != key))
    return other, value, {"key_mismatch"}


bad_records = st.lists(
    garbage() | missing_field() | wrong_type() | absurd_time() | huge_string() | wrong_key(),
    min_size=5,
    max_size=30,
)


def read_dlq(cfg, n: int, timeout_s: float = 15.0):
    c = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, auto_offset_reset="earliest")
    c.assign([TopicPartition(cfg.dead_letter_topic, 0)])
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            out.extend(recs)
    # nothing beyond the n expected
    out.extend(r for recs in c.poll(timeout_ms=300).values() for r in recs)
    c.close()
    return out


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(bad=bad_records)
def test_bad_records_are_dead_lettered_and_the_consumer_keeps_going(kafka_config, bad):
    cfg = kafka_config(partitions=1, **WINDOW)
    with EventProducer(cfg) as producer:
        for key, value, _ in bad:
            producer.send_raw(key, value)
        producer.flush()
    sink = RecordingSink()
    metrics = IngestMetrics()
    consumer = EventConsumer(cfg, sink, metrics)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        # the batch of bad records advances the sink's offsets without any event
        deadline = time.monotonic() + 20
        while sink.owned.get(0) != len(bad) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.owned.get(0) == len(bad)
        assert sink.snapshot() == []
        assert thread.is_alive()

        # a good event sent afterwards still arrives
        good_key, good_value = encode_event(make_event("good-user", "good-item", NOW_MS, "click"))
        with EventProducer(cfg) as producer:
            producer.send_raw(good_key, good_value)
        while not sink.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = sink.snapshot()
        assert [(e.user_id, e.item_id, e.offset) for e in got] == [
            ("good-user", "good-item", len(bad))
        ]
    finally:
        consumer.stop()
        thread.join(timeout=15)
    assert not thread.is_alive()

    dlq = read_dlq(cfg, len(bad))
    assert len(dlq) == len(bad)
    for rec in dlq:
        headers = {k: v.decode() for k, v in rec.headers}
        offset = int(headers["source_offset"])
        key, value, expected = bad[offset]
        assert headers["reason"] in expected, (headers, expected)
        assert headers["source_topic"] == cfg.topic
        assert headers["source_partition"] == "0"
        assert headers["message"]
        assert rec.value == value and rec.key == key
    assert sorted(int(dict(r.headers)["source_offset"]) for r in dlq) == list(range(len(bad)))
    counted = {
        s.labels["reason"]: s.value
        for m in metrics.dead_letters.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert sum(counted.values()) == len(bad)


def test_an_oversized_record_is_dead_lettered_cut_not_refused(kafka_config):
    from kafka import KafkaProducer

    from streams.consumer import DLQ_MAX_VALUE_BYTES

    cfg = kafka_config(partitions=1)
    big = b"\xff" * (3 << 20)
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, max_request_size=8 << 20)
    producer.send(cfg.topic, key=b"k", value=big).get(timeout=10)
    producer.close()
    sink = RecordingSink()
    consumer = EventConsumer(cfg, sink)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while sink.owned.get(0) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.owned.get(0) == 1 and thread.is_alive()
    finally:
        consumer.stop()
        thread.join(timeout=15)
    (rec,) = read_dlq(cfg, 1)
    headers = dict(rec.headers)
    assert headers["reason"] == b"undecodable"
    assert headers["value_truncated"] == str(len(big)).encode()
    assert rec.value == big[:DLQ_MAX_VALUE_BYTES]
