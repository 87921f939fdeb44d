"""EventConsumer: a consumer-group member on the events topic that turns records into
validated micro-batches for a :class:`~streams.sink.BatchSink`, and bad records into
dead letters.

One thread runs :meth:`EventConsumer.run`; :meth:`EventConsumer.stop` (from any thread or a
signal handler) makes it finish the current batch, checkpoint, commit and leave the group.
Auto-commit is off: offsets reach Kafka only after the sink has checkpointed them.
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
from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
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
from streams.metrics import IngestMetrics
from streams.sink import BatchSink
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
    """

    def __init__(
        self,
        cfg: KafkaConfig,
        sink: BatchSink,
        metrics: IngestMetrics | None = None,
        *,
        client_id: str = "recmem-ingest",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
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
                auto_offset_reset="earliest",
                max_poll_records=cfg.max_poll_records,
                fetch_max_wait_ms=max(1, min(cfg.max_wait_ms, 500)),
                session_timeout_ms=cfg.session_timeout_ms,
                heartbeat_interval_ms=cfg.heartbeat_interval_ms,
                **settings,
            )
            self._consumer.subscribe([cfg.topic], listener=_Listener(self))
            log.info("consuming %s as group %s", cfg.topic, cfg.group_id)
            while not self._stop.is_set():
                records = self._consumer.poll(
                    timeout_ms=cfg.max_wait_ms, max_records=cfg.max_poll_records
                )
                if records:
                    self._process(records)
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
        for tp in sorted(records, key=lambda t: t.partition):
            batch = records[tp]
            if not batch:
                continue
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
            self.sink.apply_batch(events, next_offsets)
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
            tp = TopicPartition(self.cfg.topic, p)
            try:
                high = self._consumer.highwater(tp)  # known once a fetch for tp returned
                pos = self._consumer.position(tp, timeout_ms=100) if high is not None else None
            except KafkaError:
                continue
            if high is not None and pos is not None:
                self.metrics.lag.labels(partition=str(p)).set(max(0, high - pos))

    # --------------------------------------------------------------- rebalance
    def _on_revoked(self, partitions: list[int], lost: bool) -> None:
        for p in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(str(p))
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
        if not partitions or self._failed:
            return
        with self._sink_lock:
            offsets = self.sink.on_assigned(partitions)
        assert self._consumer is not None
        for p, off in sorted(offsets.items()):
            if p in partitions:
                self._consumer.seek(TopicPartition(self.cfg.topic, p), off)
        log.info("partitions %s assigned; resuming from %s", partitions, offsets)
