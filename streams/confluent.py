"""ConfluentEventConsumer: the events consumer on librdkafka (confluent-kafka), chosen with
``kafka.client = "confluent"``; kafka-python (streams/consumer.py) stays the default.

It feeds the same :class:`~streams.sink.BatchSink` with the same semantics
(streams/consumer_base.py holds them once): auto-commit off and offsets committed only
after ``sink.checkpoint()``; rebalances mapped to ``on_assigned`` / ``on_revoked`` /
``on_lost``; each resume point checked against the broker (streams/positions.py) and set as
the partition's start offset; partitions the sink restores in the background assigned
paused and resumed at their restore point; bad records written to the dead-letter topic
(with a librdkafka producer) in the format of streams/dead_letters.py before the batch is
applied; :meth:`stop` drains, checkpoints, commits and closes.

What differs, because librdkafka cannot carry a custom assignor's user data:

- the member publishes nothing to the group and learns no partition -> owner map: the
  :class:`~streams.group.GroupView` handed to ``on_group`` holds the generation and this
  member's own partitions only (``complete=False``; handed again, smaller, before a
  revoke), so ``recmem serve`` fills in the other partitions' owners from their checkpoint
  claims (recmem/routing.py ``ClaimedOwners``), and members of another model version are
  not refused by the group (their checkpoint restore refuses them);
- the generation comes from librdkafka's serialised consumer-group metadata
  (:func:`generation_of`), so checkpoint fencing works as with kafka-python.

``kafka.assignor``: ``cooperative-sticky`` uses librdkafka's incremental assignment
(KIP-429, as kafka-python's), ``range`` / ``roundrobin`` the eager protocol. The resume
points are still probed with a short-lived kafka-python consumer outside the group
(streams/positions.py), once per assignment.
"""

from __future__ import annotations

import logging
import struct
from functools import partial

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from streams.admin import librdkafka_settings
from streams.consumer_base import DLQ_FLUSH_TIMEOUT_S, BaseConsumer, RawRecord, Seek
from streams.dead_letters import DLQ_MAX_REQUEST_BYTES, DeadLetterRecord
from streams.group import GroupView
from streams.validate import DeadLetter

log = logging.getLogger(__name__)

NO_GENERATION = -1
"""What :func:`generation_of` answers when the metadata is not in the known format."""
_CGMD_MAGIC = b"CGMDv2:"
"""librdkafka's consumer-group metadata format: this magic, the generation id (int32 in
host byte order), then group id, member id and group instance id."""
_TOO_LARGE = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)


def generation_of(metadata: object) -> int:
    """The group generation in ``Consumer.consumer_group_metadata()`` (serialised by
    librdkafka; NO_GENERATION when it is not in the format this reads)."""
    data = metadata if isinstance(metadata, bytes) else b""
    if not data.startswith(_CGMD_MAGIC) or len(data) < len(_CGMD_MAGIC) + 4:
        return NO_GENERATION
    return int(struct.unpack_from("=i", data, len(_CGMD_MAGIC))[0])


def _offset(where: Seek) -> int:
    if where == "earliest":
        return OFFSET_BEGINNING
    if where == "latest":
        return OFFSET_END
    return int(where)


class ConfluentEventConsumer(BaseConsumer):
    """Consumes ``cfg.topic`` in group ``cfg.group_id`` and feeds ``sink`` (librdkafka;
    arguments: :class:`~streams.consumer_base.BaseConsumer`; ``member`` is not published)."""

    client_name = "confluent"
    _consumer: Consumer | None = None
    _producer: Producer | None = None
    _generation = NO_GENERATION
    """The generation of the latest assignment (what a revoke's view carries)."""

    # ------------------------------------------------------------ the client
    def _open(self) -> None:
        cfg = self.cfg
        settings = librdkafka_settings(cfg)
        self._producer = Producer(
            {
                **settings,
                "client.id": f"{self.client_id}-dlq",
                "acks": "all",
                "linger.ms": 0,
                "message.max.bytes": DLQ_MAX_REQUEST_BYTES,
            }
        )
        props = {
            **settings,
            "client.id": self.client_id,
            "group.id": cfg.group_id,
            "enable.auto.commit": False,
            # never reset silently: out-of-range offsets go through the policy
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": max(1, min(cfg.max_wait_ms, 500)),
            "session.timeout.ms": cfg.session_timeout_ms,
            "heartbeat.interval.ms": cfg.heartbeat_interval_ms,
            "partition.assignment.strategy": cfg.assignor,
        }
        if cfg.group_instance_id:
            props["group.instance.id"] = cfg.group_instance_id
        self._consumer = Consumer(props)
        # librdkafka calls these on this thread, inside consume() and close()
        self._consumer.subscribe(
            [cfg.topic],
            on_assign=self._assign_cb,
            on_revoke=self._revoke_cb,
            on_lost=self._lost_cb,
        )

    def _open_now(self) -> bool:
        return self._consumer is not None

    def _poll(self) -> dict[int, list[RawRecord]]:
        assert self._consumer is not None
        cfg = self.cfg
        # what is there now, else wait for the first record (kafka-python's poll does the
        # same); consume() with a timeout would wait for a full batch, also at the end
        messages = self._consumer.consume(cfg.max_poll_records, 0)
        if not messages:
            first = self._consumer.poll(cfg.max_wait_ms / 1000)
            if first is None:
                return {}
            messages = [first]
            if cfg.max_poll_records > 1:
                messages += self._consumer.consume(cfg.max_poll_records - 1, 0)
        out: dict[int, list[RawRecord]] = {}
        for m in messages:
            error = m.error()
            if error is not None:
                self._on_error(m, error)
                continue
            p, offset = m.partition(), m.offset()
            assert p is not None and offset is not None  # set on every record
            out.setdefault(p, []).append((offset, m.key(), m.value()))
        return out

    def _on_error(self, message: Message, error: KafkaError) -> None:
        """An offset the log no longer holds goes through ``kafka.on_offset_out_of_range``;
        a fatal error ends the run; others are logged (librdkafka retries them)."""
        assert self._consumer is not None
        code = error.code()
        if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
            p, offset = message.partition(), message.offset()
            assert p is not None  # an error about a partition names it
            where = self._out_of_range(p, offset if offset is not None and offset >= 0 else None)
            self._consumer.seek(TopicPartition(self.cfg.topic, p, _offset(where)))
            return
        if error.fatal():
            raise KafkaException(error)
        log.warning("consumer error on %s: %s", self.cfg.topic, error)

    def _close(self) -> None:
        consumer = self._consumer
        producer, self._producer = self._producer, None
        if consumer is not None:
            # close() runs the rebalance callbacks still pending (the revoke callback
            # checkpoints the partitions; an assignment that arrived since the last poll is
            # made, then revoked), and they use self._consumer: it goes only after close
            try:
                consumer.close()
            except (KafkaException, RuntimeError) as e:
                log.warning("closing the consumer: %s", e)
            finally:
                self._consumer = None
        if producer is not None:
            left = producer.flush(5)
            if left:
                log.warning("%d dead-letter records unsent at close", left)

    def _start(self, seeks: dict[int, Seek], committed: list[int], paused: list[int]) -> None:
        # inside the assign callback: the assignment is made here, with its start offsets
        assert self._consumer is not None
        topic = self.cfg.topic
        starts = [TopicPartition(topic, p, _offset(w)) for p, w in sorted(seeks.items())]
        if committed:
            stored = self._consumer.committed([TopicPartition(topic, p) for p in committed], 10)
            starts += [
                TopicPartition(
                    topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                )
                for tp in stored
            ]
        # not fetched until restored; the placeholder start is replaced by _resume's seek
        held = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in paused]
        if self.cfg.assignor == "cooperative-sticky":
            self._consumer.incremental_assign(starts + held)
        else:
            self._consumer.assign(starts + held)
        if held:
            self._consumer.pause(held)

    def _resume(self, seeks: dict[int, Seek]) -> None:
        assert self._consumer is not None
        tps = [TopicPartition(self.cfg.topic, p, _offset(w)) for p, w in sorted(seeks.items())]
        for tp in tps:
            self._consumer.seek(tp)
        self._consumer.resume(tps)

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        assert self._consumer is not None
        tps = [TopicPartition(self.cfg.topic, p, off) for p, off in sorted(offsets.items())]
        try:
            done = self._consumer.commit(offsets=tps, asynchronous=False) or []
        except KafkaException as e:  # the sink's checkpoint is the truth; this is monitoring
            log.warning("committing offsets to the group failed: %s", e)
            return
        for tp in done:
            if tp.error is not None:
                log.warning("committing %s/%d failed: %s", tp.topic, tp.partition, tp.error)

    def _lag(self, partitions: list[int]) -> dict[int, int]:
        assert self._consumer is not None
        tps = [TopicPartition(self.cfg.topic, p) for p in partitions]
        if not tps:
            return {}
        out = {}
        for tp in self._consumer.position(tps):
            # the highwater of the last fetch response (tansu's ListOffsets latest is wrong)
            _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0 and tp.offset >= 0:
                out[tp.partition] = high - tp.offset
        return out

    def _send_and_flush(
        self, records: list[tuple[DeadLetter, DeadLetterRecord]]
    ) -> list[tuple[DeadLetter, BaseException]]:
        assert self._producer is not None
        failed: list[tuple[DeadLetter, BaseException]] = []
        acked: set[int] = set()

        def delivered(d: DeadLetter, error: KafkaError | None, _msg: Message) -> None:
            acked.add(id(d))
            if error is not None:
                failed.append((d, KafkaException(error)))

        sent = []
        for d, (key, value, headers) in records:
            wire_headers: list[tuple[str, str | bytes | None]] = list(headers)
            try:
                self._producer.produce(
                    self.cfg.dead_letter_topic,
                    value=value,
                    key=key,
                    headers=wire_headers,
                    on_delivery=partial(delivered, d),
                )
            except (KafkaException, BufferError) as e:  # refused before sending
                failed.append((d, e))
            else:
                sent.append(d)
        self._producer.flush(DLQ_FLUSH_TIMEOUT_S)
        failed += [
            (d, TimeoutError("not acknowledged in time")) for d in sent if id(d) not in acked
        ]
        return failed

    def _too_large(self, error: BaseException) -> bool:
        if not isinstance(error, KafkaException) or not error.args:
            return False
        inner = error.args[0]
        return isinstance(inner, KafkaError) and inner.code() in _TOO_LARGE

    # --------------------------------------------------------------- rebalance
    def _assign_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gained = sorted(tp.partition for tp in partitions)
        owned = set(self._assigned) | set(gained)
        self._generation = generation_of(consumer.consumer_group_metadata())
        self._on_view(
            GroupView(
                generation=self._generation,
                partitions=0,
                owners=dict.fromkeys(sorted(owned), self.member),
                complete=False,
            )
        )
        self._on_assigned(gained)

    def _revoke_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._revoked(consumer, sorted(tp.partition for tp in partitions), lost=False)

    def _lost_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._revoked(consumer, sorted(tp.partition for tp in partitions), lost=True)

    def _revoked(self, consumer: Consumer, gone: list[int], lost: bool) -> None:
        """The view first (this member's own partitions less those going: it no longer
        answers for them), then the sink's revoke."""
        owned = sorted(set(self._assigned) - set(gone))
        self._on_view(
            GroupView(
                # the generation these partitions were held in (a lost member's metadata
                # may already say -1): the same generation, a smaller own share
                generation=self._generation,
                partitions=0,
                owners=dict.fromkeys(owned, self.member),
                complete=False,
            )
        )
        self._on_revoked(gone, lost=lost)
