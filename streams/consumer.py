"""EventConsumer: a consumer-group member on the events topic that turns records into
validated micro-batches for a :class:`~streams.sink.BatchSink`, and bad records into
dead letters.

One thread runs :meth:`EventConsumer.run`; :meth:`EventConsumer.stop` (from any thread or a
signal handler) makes it finish the current batch, checkpoint, commit and leave the group.
Auto-commit is off: offsets reach Kafka only after the sink has checkpointed them.

The member publishes a :class:`streams.group.Member` (its rank address, its model version)
and learns the group's partition -> owner map with every assignment (streams/group.py);
partitions the sink restores in the background stay paused until their restore is done.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
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
from streams.config import KafkaConfig
from streams.dead_letters import (
    DLQ_MAX_REQUEST_BYTES,
    DeadLetterError,
    DeadLetterRecord,
    dead_letter_record,
    minimal_dead_letter,
)
from streams.group import GroupRefused, GroupView, Member, make_assignor
from streams.metrics import IngestMetrics
from streams.positions import PositionError, as_resume, decide, fingerprint, judge, probe
from streams.sink import RESTORING, BatchSink, SourceMarks
from streams.validate import DeadLetter, Limits, ValidEvent, validate_record

log = logging.getLogger(__name__)

LAG_INTERVAL_S = 1.0
"""How often consumer lag is recomputed."""
DLQ_FLUSH_TIMEOUT_S = 30.0
"""Longest wait for dead letters to be acknowledged before the batch is given up."""


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


class EventConsumer:
    """Consumes ``cfg.topic`` in group ``cfg.group_id`` and feeds ``sink``.

    ``metrics``: where figures go (a fresh :class:`IngestMetrics` when None); its HTTP
    endpoint is started on ``cfg.metrics_port`` unless that is 0. ``clock`` gives the
    current time in seconds (the validation time window is measured against it).
    ``member``: what this member publishes to the group (its rank address and model
    version; members whose version is not the group's get no partitions and ``run``
    raises :class:`streams.group.GroupRefused`).
    """

    def __init__(
        self,
        cfg: KafkaConfig,
        sink: BatchSink,
        metrics: IngestMetrics | None = None,
        *,
        client_id: str = "recmem-ingest",
        clock: Callable[[], float] = time.time,
        member: Member | None = None,
    ) -> None:
        self.cfg = cfg
        self.member = member or Member()
        self.sink = sink
        self.metrics = metrics if metrics is not None else IngestMetrics()
        self.client_id = client_id
        self.clock = clock
        self.limits = Limits.from_config(cfg)
        self._stop = threading.Event()
        self._failed = False
        self._sink_lock = threading.RLock()
        self._assigned: list[int] = []
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._last_lag = 0.0
        self._own_endpoint = False
        self._topic_id = ""
        """The broker's id of the topic (from the last assignment's check; "" unknown)."""
        self._position_error: PositionError | None = None
        self._restoring: set[int] = set()
        """Assigned partitions the sink restores in the background (paused until done)."""
        self.view: GroupView | None = None
        """The group as of the latest assignment (generation, partition owners)."""
        self._refused: GroupRefused | None = None

    # ----------------------------------------------------------------- control
    def stop(self) -> None:
        """Ask :meth:`run` to finish the current batch, checkpoint, commit and return."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def assignment(self) -> list[int]:
        """Partitions this consumer owns now."""
        return list(self._assigned)

    @property
    def restoring(self) -> list[int]:
        """Owned partitions the sink is still restoring (paused)."""
        return sorted(self._restoring)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call :meth:`stop` (main thread only)."""

        def handle(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: finishing the current batch, then stopping", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    # --------------------------------------------------------------------- run
    def run(self) -> None:
        """Consume until :meth:`stop`; then checkpoint, commit and leave the group.

        An error from the sink or from the dead-letter producer ends the loop without a
        checkpoint (state may be half-applied); the exception propagates, and a restart
        replays from the last checkpoint."""
        cfg = self.cfg
        settings = client_settings(cfg)
        # the endpoint is ours to stop only if this run started it
        self._own_endpoint = self.metrics.port == 0 and cfg.metrics_port > 0
        try:
            self.metrics.serve(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
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
                partition_assignment_strategy=[
                    make_assignor(cfg.assignor, self.member, self._on_view)
                ],
                group_instance_id=cfg.group_instance_id or None,
                **settings,
            )
            self._consumer.subscribe([cfg.topic], listener=_Listener(self))
            log.info("consuming %s as group %s (%s)", cfg.topic, cfg.group_id, cfg.assignor)
            while not self._stop.is_set():
                records = self._poll()
                if self._refused is not None:
                    raise self._refused
                if records:
                    self._process(records)
                if self._restoring:
                    self._resume_restored()
                with self._sink_lock:
                    due = bool(self._assigned) and self.sink.checkpoint_due()
                if due:
                    self._checkpoint_and_commit()
                self._update_lag()
            self._checkpoint_and_commit()
        except BaseException:
            self._failed = True
            raise
        finally:
            self._close()

    def _poll(self) -> dict[TopicPartition, list[Any]]:
        """One poll; an offset the log no longer holds goes through
        ``kafka.on_offset_out_of_range``; a resume point refused in the rebalance callback
        is raised as itself (kafka-python wraps it)."""
        assert self._consumer is not None
        cfg = self.cfg
        try:
            return self._consumer.poll(timeout_ms=cfg.max_wait_ms, max_records=cfg.max_poll_records)
        except NoOffsetForPartitionError as e:
            # a partition the sink left out with no committed offset either: the earliest
            for tp in e.args[0] if e.args else ():
                self._consumer.seek_to_beginning(tp)
            return {}
        except OffsetOutOfRangeError as e:
            gone = e.args[0] if e.args and isinstance(e.args[0], dict) else {}
            for tp, offset in gone.items():
                reason = (
                    f"{tp.topic}/{tp.partition}: offset {offset} is no longer in the log "
                    "(retention removed records before they were applied)"
                )
                policy = decide(cfg, ("on_offset_out_of_range", reason))
                if policy == "earliest":
                    self._consumer.seek_to_beginning(tp)
                else:
                    self._consumer.seek_to_end(tp)
            return {}
        except KafkaError as e:
            if self._position_error is not None:
                raise self._position_error from None
            cause = e.__cause__
            if cause is not None and not isinstance(cause, KafkaError):
                raise cause from None  # the sink's own error from a rebalance callback
            raise

    def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        producer, self._producer = self._producer, None
        if consumer is not None:
            try:
                consumer.close(autocommit=False, timeout_ms=5000)
            except KafkaError as e:
                log.warning("closing the consumer: %s", e)
        if producer is not None:
            producer.close(timeout=5)
        if self._own_endpoint:
            self.metrics.close()
        self._assigned = []
        self.metrics.assigned.set(0)
        log.info("consumer of %s stopped", self.cfg.topic)

    # ------------------------------------------------------------------ batches
    def _process(self, records: dict[TopicPartition, list[Any]]) -> None:
        start = time.perf_counter()
        now_ms = int(self.clock() * 1000)
        events: list[ValidEvent] = []
        dead: list[DeadLetter] = []
        next_offsets: dict[int, int] = {}
        n = 0
        last_records: dict[int, str] = {}
        for tp in sorted(records, key=lambda t: t.partition):
            batch = records[tp]
            if not batch:
                continue
            last_records[tp.partition] = fingerprint(batch[-1].key, batch[-1].value)
            for rec in batch:
                out = validate_record(
                    tp.topic, tp.partition, rec.offset, rec.key, rec.value, now_ms, self.limits
                )
                if isinstance(out, ValidEvent):
                    events.append(out)
                else:
                    dead.append(out)
            n += len(batch)
            next_offsets[tp.partition] = batch[-1].offset + 1
        if dead:
            self._send_dead_letters(dead)
        with self._sink_lock:
            self.sink.apply_batch(events, next_offsets, SourceMarks(self._topic_id, last_records))
        self.metrics.records.inc(n)
        self.metrics.events.inc(len(events))
        self.metrics.batch_seconds.observe(time.perf_counter() - start)

    def _send_dead_letters(self, dead: list[DeadLetter]) -> None:
        """Send and flush; a dead letter the broker refuses as too large is sent again as
        headers only. Raises DeadLetterError, naming the first record, when the dead-letter
        topic did not take them all."""
        for d in dead:
            log.debug(
                "dead letter %s at %s/%d@%d: %s",
                d.reason,
                d.topic,
                d.partition,
                d.offset,
                d.message,
            )
        failed = self._send_and_flush([(d, dead_letter_record(d)) for d in dead])
        too_large = (MessageSizeTooLargeError, RecordListTooLargeError)
        retry = [d for d, e in failed if isinstance(e, too_large)]
        if retry:
            log.warning(
                "%d dead letters refused as too large by %s; written again as headers only",
                len(retry),
                self.cfg.dead_letter_topic,
            )
            failed = [(d, e) for d, e in failed if not isinstance(e, too_large)]
            failed += self._send_and_flush([(d, minimal_dead_letter(d)) for d in retry])
        if failed:
            d, e = failed[0]
            raise DeadLetterError(
                f"{len(failed)} of {len(dead)} dead letters were not written to "
                f"{self.cfg.dead_letter_topic}; the first is record {d.topic}/{d.partition}"
                f"@{d.offset} (reason {d.reason}): {e!r}"
            )
        for d in dead:
            self.metrics.dead_letters.labels(reason=d.reason).inc()
        log.info("%d records sent to %s", len(dead), self.cfg.dead_letter_topic)

    def _send_and_flush(
        self,
        records: list[tuple[DeadLetter, DeadLetterRecord]],
    ) -> list[tuple[DeadLetter, BaseException]]:
        """Send each dead letter, flush, and return those that failed with their error."""
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

    def _checkpoint_and_commit(self) -> None:
        if not self._assigned or self._consumer is None:
            return
        start = time.perf_counter()
        with self._sink_lock:
            offsets = self.sink.checkpoint()
        self._commit(offsets)
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - start)

    def _commit(self, offsets: dict[int, int]) -> None:
        owned = set(self._assigned)
        to_commit = {
            TopicPartition(self.cfg.topic, p): OffsetAndMetadata(off, "", -1)
            for p, off in offsets.items()
            if p in owned
        }
        if not to_commit or self._consumer is None:
            return
        try:
            self._consumer.commit(to_commit)
        except KafkaError as e:  # the sink's checkpoint is the truth; this is monitoring
            log.warning("committing offsets to the group failed: %s", e)

    def _update_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag < LAG_INTERVAL_S or self._consumer is None:
            return
        self._last_lag = now
        for p in self._assigned:
            if p in self._restoring:
                continue
            tp = TopicPartition(self.cfg.topic, p)
            try:
                high = self._consumer.highwater(tp)  # known once a fetch for tp returned
                pos = self._consumer.position(tp, timeout_ms=100) if high is not None else None
            except KafkaError:
                continue
            if high is not None and pos is not None:
                self.metrics.lag.labels(partition=str(p)).set(max(0, high - pos))

    # --------------------------------------------------------------- rebalance
    def _on_view(self, view: GroupView) -> None:
        """The leader's assignment of a new generation (before its revoke and assign
        callbacks)."""
        self.view = view
        if view.refused:
            self._refused = GroupRefused(
                f"group {self.cfg.group_id} serves {view.tag!r} and this member carries "
                f"{self.member.tag!r}: it was given no partitions. Run each model version "
                "in a group of its own (kafka.group_id, e.g. 'recmem-{model_version}'; "
                "docs/scaling.md, Rolling out a model)"
            )
            return
        on_group = getattr(self.sink, "on_group", None)
        if on_group is not None and not self._failed:
            with self._sink_lock:
                on_group(view)

    def _on_revoked(self, partitions: list[int], lost: bool) -> None:
        for p in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(str(p))
        self._restoring -= set(partitions)
        self._assigned = [p for p in self._assigned if p not in partitions]
        self.metrics.assigned.set(len(self._assigned))
        if not partitions or self._failed:
            return
        log.info("partitions %s %s", partitions, "lost" if lost else "revoked")
        with self._sink_lock:
            on_lost = getattr(self.sink, "on_lost", None)
            if lost and on_lost is not None:
                on_lost(partitions)
            else:
                self.sink.on_revoked(partitions)

    def _on_assigned(self, partitions: list[int]) -> None:
        self._assigned = sorted(set(self._assigned) | set(partitions))
        self.metrics.assigned.set(len(self._assigned))
        if not partitions or self._failed or self._refused is not None:
            return
        with self._sink_lock:
            answers = self.sink.on_assigned(partitions)
        assert self._consumer is not None
        later = sorted(p for p, r in answers.items() if r is RESTORING and p in partitions)
        if later:
            # not fetched until restored; the placeholder position is never read
            tps = [TopicPartition(self.cfg.topic, p) for p in later]
            self._consumer.pause(*tps)
            for tp in tps:
                self._consumer.seek(tp, 0)
            self._restoring |= set(later)
            log.info("partitions %s assigned; restoring in the background", later)
        now = [p for p in partitions if p not in later]
        resumes = {p: as_resume(r) for p, r in answers.items() if p in now}
        try:
            seeks = self._checked_seeks(now, resumes)
        except PositionError as e:
            self._position_error = e  # kafka-python wraps what a listener raises
            raise
        self._seek(seeks)
        if now:
            log.info("partitions %s assigned; resuming from %s", now, seeks)

    def _resume_restored(self) -> None:
        """Seek and resume the partitions whose background restore finished."""
        restored = getattr(self.sink, "restored", None)
        if restored is None or self._consumer is None:
            return
        with self._sink_lock:
            done = {p: as_resume(r) for p, r in restored().items() if p in self._restoring}
        if not done:
            return
        seeks = self._checked_seeks(sorted(done), done)
        self._seek(seeks)
        self._consumer.resume(*(TopicPartition(self.cfg.topic, p) for p in done))
        self._restoring -= set(done)
        log.info("partitions %s restored; resuming from %s", sorted(done), seeks)

    def _seek(self, seeks: dict[int, int | str]) -> None:
        assert self._consumer is not None
        for p, where in sorted(seeks.items()):
            tp = TopicPartition(self.cfg.topic, p)
            if where == "earliest":
                self._consumer.seek_to_beginning(tp)
            elif where == "latest":
                self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, int(where))

    def _checked_seeks(self, partitions: list[int], resumes: dict) -> dict[int, int | str]:
        """Partition -> offset, "earliest" or "latest": each checkpoint's resume point after
        the checks of streams/positions.py (and their policies); partitions without one
        resume from the group's committed offset, else the earliest."""
        cfg = self.cfg
        assert self._consumer is not None
        wanted = {p: r.next_offset for p, r in resumes.items() if p in partitions}
        self._topic_id, facts = probe(cfg, {p: n for p, n in wanted.items() if n > 0})
        seeks: dict[int, int | str] = {}
        for p in partitions:
            if p not in wanted:
                continue  # the group's committed offset, else the earliest (see _poll)
            if wanted[p] == 0:
                seeks[p] = "earliest"
                continue
            problem = judge(cfg, p, resumes[p], self._topic_id, facts[p])
            seeks[p] = wanted[p] if problem is None else decide(cfg, problem)
        return seeks
