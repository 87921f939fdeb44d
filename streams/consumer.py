"""EventConsumer: a consumer-group member on the events topic, on kafka-python (the default
``kafka.client``), that turns records into validated micro-batches for a
:class:`~streams.sink.BatchSink`, and bad records into dead letters
(streams/consumer_base.py holds what every client shares).

One thread runs :meth:`EventConsumer.run`; :meth:`EventConsumer.stop` (from any thread or a
signal handler) makes it finish the current batch, checkpoint, commit and leave the group.
Auto-commit is off: offsets reach Kafka only after the sink has checkpointed them.

The member publishes a :class:`streams.group.Member` (its rank address, its model version)
and learns the group's partition -> owner map with every assignment (streams/group.py);
partitions the sink restores in the background stay paused until their restore is done.
"""

from __future__ import annotations

import logging
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
    RecordListTooLargeError,
)
from kafka.structs import OffsetAndMetadata

from streams.admin import client_settings
from streams.consumer_base import DLQ_FLUSH_TIMEOUT_S, BaseConsumer, RawRecord, Seek
from streams.dead_letters import DLQ_MAX_REQUEST_BYTES, DeadLetterRecord
from streams.group import GroupRefused, GroupView, make_assignor
from streams.validate import DeadLetter

log = logging.getLogger(__name__)


class _Listener(ConsumerRebalanceListener):
    """Forwards group rebalances to the sink and seeks to the sink's offsets.

    kafka-python calls these while the consumer thread is inside ``poll()`` or ``close()``."""

    def __init__(self, owner: EventConsumer) -> None:
        self.owner = owner

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.owner._on_revoked(sorted(tp.partition for tp in revoked), lost=False)

    def on_partitions_lost(self, lost: Any) -> None:
        self.owner._on_revoked(sorted(tp.partition for tp in lost), lost=True)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.owner._on_assigned(sorted(tp.partition for tp in assigned))


class EventConsumer(BaseConsumer):
    """Consumes ``cfg.topic`` in group ``cfg.group_id`` and feeds ``sink`` (kafka-python;
    arguments: :class:`~streams.consumer_base.BaseConsumer`).

    ``member``: what this member publishes to the group (its rank address and model
    version; members whose version is not the group's get no partitions and ``run``
    raises :class:`streams.group.GroupRefused`).
    """

    client_name = "kafka-python"
    _consumer: KafkaConsumer | None = None
    _producer: KafkaProducer | None = None
    _refused: GroupRefused | None = None

    # ------------------------------------------------------------ the client
    def _open(self) -> None:
        cfg = self.cfg
        settings = client_settings(cfg)
        self._producer = KafkaProducer(
            client_id=f"{self.client_id}-dlq",
            acks="all",
            linger_ms=0,
            max_request_size=DLQ_MAX_REQUEST_BYTES,
            **settings,
        )
        self._consumer = KafkaConsumer(
            client_id=self.client_id,
            group_id=cfg.group_id,
            enable_auto_commit=False,
            # never reset silently: out-of-range offsets go through the policy
            auto_offset_reset="none",
            max_poll_records=cfg.max_poll_records,
            fetch_max_wait_ms=max(1, min(cfg.max_wait_ms, 500)),
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            partition_assignment_strategy=[make_assignor(cfg.assignor, self.member, self._on_view)],
            group_instance_id=cfg.group_instance_id or None,
            **settings,
        )
        self._consumer.subscribe([cfg.topic], listener=_Listener(self))

    def _open_now(self) -> bool:
        return self._consumer is not None

    def _poll(self) -> dict[int, list[RawRecord]]:
        """One poll; an offset the log no longer holds goes through
        ``kafka.on_offset_out_of_range``; a resume point refused in the rebalance callback
        is raised as itself (kafka-python wraps it); a refusal by the group is raised."""
        assert self._consumer is not None
        cfg = self.cfg
        try:
            self._finish_rebalance()
            got = self._consumer.poll(timeout_ms=cfg.max_wait_ms, max_records=cfg.max_poll_records)
        except NoOffsetForPartitionError as e:
            # a partition the sink left out with no committed offset either: the earliest
            for tp in e.args[0] if e.args else ():
                self._consumer.seek_to_beginning(tp)
            return {}
        except OffsetOutOfRangeError as e:
            gone = e.args[0] if e.args and isinstance(e.args[0], dict) else {}
            for tp, offset in gone.items():
                self._seek({tp.partition: self._out_of_range(tp.partition, offset)})
            return {}
        except KafkaError as e:
            if self._position_error is not None:
                raise self._position_error from None
            cause = e.__cause__
            if cause is not None and not isinstance(cause, KafkaError):
                raise cause from None  # the sink's own error from a rebalance callback
            raise
        if self._refused is not None:
            raise self._refused
        return {
            tp.partition: [(r.offset, r.key, r.value) for r in records]
            for tp, records in got.items()
        }

    def _finish_rebalance(self) -> None:
        """While the member has to (re)join its group, wait for the join and sync to finish
        (up to ``session_timeout_ms``) instead of in ``max_wait_ms`` slices.

        kafka-python 3.0.12 runs JoinGroup + SyncGroup as one task that a poll awaits; a
        task that completes while no poll awaits it (between two polls, or just after a
        poll's timeout) is dropped and the member sends a new JoinGroup: a whole extra
        rebalance round. With short polls that happens often, and on brokers that answer
        JoinGroup in whole seconds (tansu) almost every time, since the answer lands on a
        poll boundary. One long wait per join leaves no such boundary."""
        assert self._consumer is not None
        coordinator = getattr(self._consumer, "_coordinator", None)
        if coordinator is None or not coordinator.need_rejoin():
            return
        on_rebalancing = getattr(self.sink, "on_rebalancing", None)
        if on_rebalancing is not None and not self._failed:
            with self._sink_lock:
                on_rebalancing()
        wait_ms = max(self.cfg.max_wait_ms, self.cfg.session_timeout_ms)
        if not coordinator.ensure_active_group(timeout_ms=wait_ms):
            log.info("still joining group %s after %d ms", self.cfg.group_id, wait_ms)

    def _close(self) -> None:
        consumer = self._consumer
        producer, self._producer = self._producer, None
        if consumer is not None and not self._failed:
            self._join_before_leaving(consumer)
        if consumer is not None:
            try:  # a rebalance callback run by close() may still use self._consumer
                consumer.close(autocommit=False, timeout_ms=5000)
            except KafkaError as e:
                log.warning("closing the consumer: %s", e)
            finally:
                self._consumer = None
        if producer is not None:
            producer.close(timeout=5)

    def _join_before_leaving(self, consumer: KafkaConsumer) -> None:
        """A member whose group is rebalancing (a join due, or sent and not answered yet)
        finishes the join, up to ``session_timeout_ms``, before it leaves. On tansu a member
        that leaves after its JoinGroup made it the leader of the rebalancing group stays
        the group's leader for good, and every member that joins later waits for its
        assignment forever (streams/broker.py); a member that leaves a settled group hands
        the role on."""
        coordinator = getattr(consumer, "_coordinator", None)
        if coordinator is None or not coordinator.need_rejoin():
            return
        try:
            if not coordinator.ensure_active_group(timeout_ms=self.cfg.session_timeout_ms):
                log.info("leaving group %s before its rebalance finished", self.cfg.group_id)
        except KafkaError as e:
            log.warning("finishing the rebalance before leaving: %s", e)

    def _start(self, seeks: dict[int, Seek], committed: list[int], paused: list[int]) -> None:
        # kafka-python has assigned them already; ``committed`` ones need nothing (the
        # group's offset, else NoOffsetForPartitionError in _poll: the earliest)
        assert self._consumer is not None
        if paused:
            # not fetched until restored; the placeholder position is never read
            tps = [TopicPartition(self.cfg.topic, p) for p in paused]
            self._consumer.pause(*tps)
            for tp in tps:
                self._consumer.seek(tp, 0)
        self._seek(seeks)

    def _resume(self, seeks: dict[int, Seek]) -> None:
        assert self._consumer is not None
        self._seek(seeks)
        self._consumer.resume(*(TopicPartition(self.cfg.topic, p) for p in seeks))

    def _seek(self, seeks: dict[int, Seek]) -> None:
        assert self._consumer is not None
        for p, where in sorted(seeks.items()):
            tp = TopicPartition(self.cfg.topic, p)
            if where == "earliest":
                self._consumer.seek_to_beginning(tp)
            elif where == "latest":
                self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, int(where))

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        assert self._consumer is not None
        to_commit = {
            TopicPartition(self.cfg.topic, p): OffsetAndMetadata(off, "", -1)
            for p, off in offsets.items()
        }
        try:
            self._consumer.commit(to_commit)
        except KafkaError as e:  # the sink's checkpoint is the truth; this is monitoring
            log.warning("committing offsets to the group failed: %s", e)

    def _lag(self, partitions: list[int]) -> dict[int, int]:
        assert self._consumer is not None
        out = {}
        for p in partitions:
            tp = TopicPartition(self.cfg.topic, p)
            try:
                high = self._consumer.highwater(tp)  # known once a fetch for tp returned
                pos = self._consumer.position(tp, timeout_ms=100) if high is not None else None
            except KafkaError:
                continue
            if high is not None and pos is not None:
                out[p] = high - pos
        return out

    def _send_and_flush(
        self, records: list[tuple[DeadLetter, DeadLetterRecord]]
    ) -> list[tuple[DeadLetter, BaseException]]:
        assert self._producer is not None
        sent, failed = [], []
        for d, (key, value, headers) in records:
            try:
                fut = self._producer.send(
                    self.cfg.dead_letter_topic, key=key, value=value, headers=headers
                )
            except KafkaError as e:  # refused before sending (e.g. by the size check)
                failed.append((d, e))
            else:
                sent.append((d, fut))
        self._producer.flush(timeout=DLQ_FLUSH_TIMEOUT_S)
        for d, fut in sent:
            if not fut.succeeded():
                failed.append((d, fut.exception or TimeoutError("not acknowledged in time")))
        return failed

    def _too_large(self, error: BaseException) -> bool:
        return isinstance(error, MessageSizeTooLargeError | RecordListTooLargeError)

    # --------------------------------------------------------------- rebalance
    def _on_view(self, view: GroupView) -> None:
        """The leader's assignment of a new generation (before its revoke and assign
        callbacks)."""
        if view.refused:
            self.view = view
            self._refused = GroupRefused(
                f"group {self.cfg.group_id} serves {view.tag!r} and this member carries "
                f"{self.member.tag!r}: it was given no partitions. Run each model version "
                "in a group of its own (kafka.group_id, e.g. 'recmem-{model_version}'; "
                "docs/scaling.md, Rolling out a model)"
            )
            return
        super()._on_view(view)

    def _refusing(self) -> bool:
        return self._refused is not None
