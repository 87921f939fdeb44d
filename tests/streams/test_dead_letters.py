"""Bad records go to the dead-letter topic with their reason and source offset; none reaches
the sink, and the consumer keeps running (real tansu broker)."""

from __future__ import annotations

import hashlib
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, TopicPartition
from kafka.record.default_records import DefaultRecordBatchBuilder

from proto.recmem.v1 import event_pb2
from streams.codec import encode_event, make_event
from streams.consumer import EventConsumer
from streams.dead_letters import (
    DLQ_MAX_KEY_BYTES,
    DLQ_MAX_REQUEST_BYTES,
    DeadLetterError,
    dead_letter_record,
)
from streams.metrics import IngestMetrics
from streams.producer import EventProducer
from streams.validate import DeadLetter
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


def run_until(cfg, sink, done, timeout_s=20.0):
    """Run a consumer until ``done(sink)`` or the timeout; returns whether it got there alive
    (it did not die on a record) and what it raised."""
    consumer = EventConsumer(cfg, sink)
    failure = []

    def run():
        try:
            consumer.run()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not done(sink) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        reached = done(sink) and thread.is_alive()
    finally:
        consumer.stop()
        thread.join(timeout=15)
    return reached, failure


def big_producer(cfg):
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, max_request_size=8 << 20)


def test_an_oversized_value_is_dead_lettered_cut_not_refused(kafka_config):
    cfg = kafka_config(partitions=1)
    big = b"\xff" * (3 << 20)
    producer = big_producer(cfg)
    producer.send(cfg.topic, key=b"k", value=big).get(timeout=10)
    producer.close()
    sink = RecordingSink()
    reached, failure = run_until(cfg, sink, lambda s: s.owned.get(0) == 1)
    assert reached and not failure
    (rec,) = read_dlq(cfg, 1)
    headers = dict(rec.headers)
    assert headers["reason"] == b"undecodable"
    assert headers["value_truncated"] == str(len(big)).encode()
    assert headers["value_sha256"] == hashlib.sha256(big).hexdigest().encode()
    assert rec.key == b"k" and big.startswith(rec.value) and len(rec.value) > 1000_000


def test_an_oversized_user_id_goes_to_the_dlq_and_later_records_apply(kafka_config):
    """Defect 1 of issue 11: a ~600 KB user id (and key) made a dead letter of key and value
    cut to 512 KiB each, which the dead-letter producer refused, for good."""
    cfg = kafka_config(partitions=1)
    user = "u" * 600_000
    key, value = encode_event(make_event(user, "item", NOW_MS))
    producer = big_producer(cfg)
    producer.send(cfg.topic, key=key, value=value).get(timeout=10)
    producer.close()
    with EventProducer(cfg) as p:
        p.send([make_event("later", "item", NOW_MS + 1)], progress=False)
    sink = RecordingSink()
    reached, failure = run_until(cfg, sink, lambda s: bool(s.snapshot()))
    assert reached and not failure
    assert [(e.user_id, e.offset) for e in sink.snapshot()] == [("later", 1)]
    (rec,) = read_dlq(cfg, 1)
    headers = dict(rec.headers)
    assert headers["reason"] == b"field_too_long" and headers["source_offset"] == b"0"
    assert headers["key_truncated"] == str(len(key)).encode()
    assert headers["key_sha256"] == hashlib.sha256(key).hexdigest().encode()
    assert rec.key == key[:DLQ_MAX_KEY_BYTES] and rec.value == value  # the value kept whole


def test_a_dead_letter_the_broker_refuses_is_sent_as_headers_only(kafka_config, monkeypatch):
    import streams.consumer

    # a producer limit below the cut dead letter stands in for a topic with a smaller limit
    monkeypatch.setattr(streams.consumer, "DLQ_MAX_REQUEST_BYTES", 8192)
    cfg = kafka_config(partitions=1)
    big = b"\xff" * 100_000
    producer = big_producer(cfg)
    producer.send(cfg.topic, key=b"k", value=big).get(timeout=10)
    producer.close()
    reached, failure = run_until(cfg, RecordingSink(), lambda s: s.owned.get(0) == 1)
    assert reached and not failure
    (rec,) = read_dlq(cfg, 1)
    headers = dict(rec.headers)
    assert rec.key is None and rec.value == b""
    assert headers["reason"] == b"undecodable" and headers["source_offset"] == b"0"
    assert headers["value_sha256"] == hashlib.sha256(big).hexdigest().encode()
    assert headers["key_sha256"] == hashlib.sha256(b"k").hexdigest().encode()


def test_an_unwritable_dead_letter_stops_the_consumer_naming_the_record(kafka_config, monkeypatch):
    import streams.consumer

    monkeypatch.setattr(streams.consumer, "DLQ_MAX_REQUEST_BYTES", 64)  # not even headers fit
    cfg = kafka_config(partitions=1)
    with EventProducer(cfg) as p:
        p.send_raw(b"k", b"\xff\xff")
        p.flush()
    sink = RecordingSink()
    _, failure = run_until(cfg, sink, lambda s: False, timeout_s=10)
    assert sink.batches == 0 and not sink.store  # nothing of the batch applied or checkpointed
    (error,) = failure
    assert isinstance(error, DeadLetterError)
    assert f"record {cfg.topic}/0@0 (reason undecodable)" in str(error)


@settings(max_examples=200, deadline=None)
@given(
    key=st.none() | st.integers(0, 3 << 20).map(lambda n: b"k" * n),
    value=st.none() | st.integers(0, 3 << 20).map(lambda n: b"v" * n),
    message=st.text(max_size=3000),
)
def test_every_dead_letter_fits_the_producer_limit(key, value, message):
    dead = DeadLetter("undecodable", message, "events", 3, 7, key, value)
    k, v, headers = dead_letter_record(dead)
    size = DefaultRecordBatchBuilder.estimate_size_in_bytes(k, v, headers)
    assert size <= DLQ_MAX_REQUEST_BYTES
    assert k is not None or v is not None
    if len(key or b"") + len(value or b"") < 1000_000:
        assert (k, v) == (key, value if value is not None or key is not None else b"")
    cut = dict(headers)
    for part, original, written in (("key", key, k), ("value", value, v)):
        if original is not None and written != original:
            assert original.startswith(written)
            assert cut[f"{part}_truncated"] == str(len(original)).encode()
            assert cut[f"{part}_sha256"] == hashlib.sha256(original).hexdigest().encode()
