"""Two EventConsumers in one group on a real broker: partitions move between them, the sink
callbacks run in order, and every record reaches exactly one sink."""

from __future__ import annotations

import threading

from streams.consumer import EventConsumer
from streams.producer import EventProducer
from tests.streams.sinks import RecordingSink
from tests.streams.test_consumer import events_for, wait_until


def test_rebalance_moves_partitions_and_delivers_each_record_once(kafka_config):
    cfg = kafka_config(partitions=4)
    store: dict[int, int] = {}  # the checkpoint both members share
    first = events_for(n_users=16, per_user=5)
    with EventProducer(cfg) as producer:
        producer.send(first, progress=False)

    sink_a, sink_b = RecordingSink(store, checkpoint_every=2), RecordingSink(store)
    a = EventConsumer(cfg, sink_a, client_id="member-a")
    b = EventConsumer(cfg, sink_b, client_id="member-b")
    ta = threading.Thread(target=a.run, daemon=True)
    ta.start()
    try:
        wait_until(lambda: len(sink_a.snapshot()) == len(first), what="member a alone")
        assert a.assignment == [0, 1, 2, 3]

        tb = threading.Thread(target=b.run, daemon=True)
        tb.start()
        wait_until(
            lambda: a.assignment and b.assignment and len(a.assignment + b.assignment) == 4,
            what="the group to rebalance over both members",
        )
        assert sorted(a.assignment + b.assignment) == [0, 1, 2, 3]

        second = events_for(n_users=16, per_user=9)[len(first) :]
        with EventProducer(cfg) as producer:
            producer.send(second, progress=False)
        total = len(first) + len(second)
        wait_until(
            lambda: len(sink_a.snapshot()) + len(sink_b.snapshot()) >= total,
            what="all records over both members",
        )
    finally:
        a.stop()
        b.stop()
        ta.join(timeout=15)
        tb.join(timeout=15)
    assert not ta.is_alive() and not tb.is_alive()

    got_a, got_b = sink_a.snapshot(), sink_b.snapshot()
    keys = [(e.partition, e.offset) for e in got_a + got_b]
    assert len(keys) == len(set(keys)) == total, "a record was lost or delivered twice"
    assert {e.partition for e in got_b}, "no partition moved to the second member"
    # a user's events all went to one member after the move, each in order
    for sink in (sink_a, sink_b):
        for p in {e.partition for e in sink.snapshot()}:
            offs = [e.offset for e in sink.snapshot() if e.partition == p]
            assert offs == sorted(offs)

    kinds_a = [kind for kind, _ in sink_a.calls if kind in ("assigned", "revoked")]
    assert kinds_a[:3] == ["assigned", "revoked", "assigned"]
    assert sink_a.calls[0] == ("assigned", [0, 1, 2, 3])
    revoked_first = next(arg for kind, arg in sink_a.calls if kind == "revoked")
    assert revoked_first == [0, 1, 2, 3]
    assigned_b = [arg for kind, arg in sink_b.calls if kind == "assigned"]
    assert {e.partition for e in got_b} <= set().union(*assigned_b)
    # leaving the group hands back (and checkpoints) what each member holds last
    assert sink_b.calls[-1] == ("revoked", assigned_b[-1])
    # the store ends at the end of every partition
    ends: dict[int, int] = {}
    for e in got_a + got_b:
        ends[e.partition] = max(ends.get(e.partition, 0), e.offset + 1)
    assert {p: store[p] for p in ends} == ends
