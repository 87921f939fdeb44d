"""EventConsumers in one group on a real broker: partitions move between them (eagerly, or
cooperatively: only the moved ones), the sink callbacks run in order, every record reaches
exactly one sink, every member learns the same partition -> owner map, partitions restored
in the background are not fetched before they are restored, and a member carrying another
tag (model version) is refused."""

from __future__ import annotations

import threading
import time

import pytest

from streams.consumer import EventConsumer
from streams.group import GroupRefused, Member
from streams.producer import EventProducer
from tests.streams.sinks import RecordingSink, RestoringSink
from tests.streams.test_consumer import events_for, wait_until


@pytest.mark.parametrize("assignor", ["range", "cooperative-sticky"])
def test_rebalance_moves_partitions_and_delivers_each_record_once(kafka_config, assignor):
    cfg = kafka_config(partitions=4, assignor=assignor)
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

    assert sink_a.calls[0] == ("assigned", [0, 1, 2, 3])
    revoked_first = next(arg for kind, arg in sink_a.calls if kind == "revoked")
    assigned_b = [arg for kind, arg in sink_b.calls if kind == "assigned"]
    assert {e.partition for e in got_b} <= set().union(*assigned_b)
    kinds_a = [kind for kind, _ in sink_a.calls if kind in ("assigned", "revoked")]
    if assignor == "range":  # eager: everything revoked, then the new set assigned
        assert kinds_a[:3] == ["assigned", "revoked", "assigned"]
        assert revoked_first == [0, 1, 2, 3]
    else:  # cooperative: only what moves to B is revoked; A keeps consuming the rest
        assert len(revoked_first) == 2
        assert assigned_b[0] == revoked_first
        kept = sorted(set(range(4)) - set(revoked_first))
        assert kinds_a[:2] == ["assigned", "revoked"]
        assert all(kind != "assigned" for kind in kinds_a[2:-1]), "A was never given more"
        assert sink_a.calls[-1] == ("revoked", kept)
    # leaving the group hands back (and checkpoints) what each member holds last
    assert sink_b.calls[-1] == ("revoked", assigned_b[-1])
    # the store ends at the end of every partition
    ends: dict[int, int] = {}
    for e in got_a + got_b:
        ends[e.partition] = max(ends.get(e.partition, 0), e.offset + 1)
    assert {p: store[p] for p in ends} == ends


def test_members_share_the_owner_map_and_restore_in_the_background(kafka_config):
    """Each member publishes its address; after the rebalance both hold the same view of
    the generation (every partition's owner). Partitions answered RESTORING are not fetched
    before the sink says they are restored."""
    cfg = kafka_config(partitions=4)
    first = events_for(n_users=16, per_user=4)
    with EventProducer(cfg) as producer:
        producer.send(first, progress=False)
    store: dict[int, int] = {}
    sink_a, sink_b = RestoringSink(store, delay_s=0.8), RestoringSink(store, delay_s=0.8)
    a = EventConsumer(cfg, sink_a, client_id="a", member=Member("10.0.0.1:50051", "m1"))
    b = EventConsumer(cfg, sink_b, client_id="b", member=Member("10.0.0.2:50051", "m1"))
    threads = [threading.Thread(target=c.run, daemon=True) for c in (a, b)]
    threads[0].start()
    try:
        wait_until(lambda: len(sink_a.snapshot()) == len(first), what="member a alone")
        threads[1].start()
        wait_until(
            lambda: len(a.assignment) == 2 and len(b.assignment) == 2 and not b.restoring,
            what="both members to own two partitions, restored",
        )
        second = events_for(n_users=16, per_user=7)[len(first) :]
        with EventProducer(cfg) as producer:
            producer.send(second, progress=False)
        total = len(first) + len(second)
        wait_until(
            lambda: len(sink_a.snapshot()) + len(sink_b.snapshot()) >= total,
            what="all records over both members",
        )
        view_a, view_b = a.view, b.view
        assert view_a is not None and view_b is not None
        assert view_a.generation == view_b.generation
        assert view_a.owners == view_b.owners and view_a.partitions == 4
        assert {p for p, m in view_a.owners.items() if m == a.member} == set(a.assignment)
        assert {p for p, m in view_a.owners.items() if m == b.member} == set(b.assignment)
        assert view_a.tag == "m1" and not view_a.refused
        # exactly one member led the generation: the one kafka-python says computed it
        assert view_a.leads != view_b.leads
        assert view_a.leads == a._consumer._coordinator._is_leader  # type: ignore[union-attr]
        generations = [v.generation for v in sink_a.views]
        assert generations == sorted(generations)
    finally:
        a.stop()
        b.stop()
        for t in threads:
            t.join(timeout=15)
    keys = [(e.partition, e.offset) for e in sink_a.snapshot() + sink_b.snapshot()]
    assert len(keys) == len(set(keys)) == total, "a record was lost or delivered twice"
    for sink in (sink_a, sink_b):
        for at, parts in sink.batch_partitions:
            for p in parts:
                assert p in sink.restored_at and sink.restored_at[p] <= at, (
                    f"a batch of partition {p} arrived before its restore finished"
                )


def test_a_member_with_another_tag_is_refused(kafka_config):
    cfg = kafka_config(partitions=2)
    old, new = RecordingSink(), RecordingSink()
    a = EventConsumer(cfg, old, client_id="old", member=Member("h:1", "model-a"))
    b = EventConsumer(cfg, new, client_id="new", member=Member("h:2", "model-b"))
    ta = threading.Thread(target=a.run, daemon=True)
    ta.start()
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            b.run()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    try:
        wait_until(lambda: a.assignment == [0, 1], what="the first member to own both")
        tb = threading.Thread(target=run_b, daemon=True)
        tb.start()
        tb.join(timeout=30)
        assert not tb.is_alive()
        assert errors and isinstance(errors[0], GroupRefused)
        assert "'model-a'" in str(errors[0]) and "'model-b'" in str(errors[0])
        assert new.calls == [] or all(kind != "assigned" for kind, _ in new.calls)
        time.sleep(0.5)
        assert a.assignment == [0, 1]
    finally:
        a.stop()
        ta.join(timeout=15)


def test_static_membership_reaches_the_consumer(kafka_config):
    """``kafka.group_instance_id`` is handed to kafka-python (KIP-345). The embedded broker
    does not settle static groups (a static member's join takes 10 s or more there and the
    group keeps a departed member's assignment), so only the setting is checked here;
    docs/scaling.md says what was and was not tested."""
    cfg = kafka_config(partitions=1, group_instance_id="recmem-0")
    consumer = EventConsumer(cfg, RecordingSink())
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: consumer._consumer is not None, what="the consumer to start")
        kafka_consumer = consumer._consumer
        assert kafka_consumer is not None
        assert kafka_consumer.config["group_instance_id"] == "recmem-0"
        assert kafka_consumer.config["partition_assignment_strategy"][0].name == (
            "cooperative-sticky"
        )
    finally:
        consumer.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


class _Coordinator:
    def __init__(self, rejoin: bool) -> None:
        self.rejoin = rejoin
        self.joins: list[int] = []

    def need_rejoin(self) -> bool:
        return self.rejoin

    def ensure_active_group(self, timeout_ms: int) -> bool:
        self.joins.append(timeout_ms)
        return True


class _Client:
    def __init__(self, rejoin: bool) -> None:
        self._coordinator = _Coordinator(rejoin)


def test_a_member_finishes_a_due_join_before_it_leaves():
    """A member whose group rebalances joins (up to its session timeout) before it leaves:
    on tansu, a leader that leaves a rebalancing group stays its leader for good and the
    group never forms again (streams/broker.py). A settled member leaves at once."""
    from streams.config import KafkaConfig

    consumer = EventConsumer(KafkaConfig(session_timeout_ms=3000), RecordingSink())
    due, settled = _Client(rejoin=True), _Client(rejoin=False)
    consumer._join_before_leaving(due)  # type: ignore[arg-type]
    consumer._join_before_leaving(settled)  # type: ignore[arg-type]
    assert due._coordinator.joins == [3000]
    assert settled._coordinator.joins == []
