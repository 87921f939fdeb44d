"""EventProducer: sends Event messages to a topic, keyed by user id, with an optional rate
limit and a progress bar. It encodes what it is given and knows nothing of datasets."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from types import TracebackType

from kafka import KafkaProducer
from tqdm import tqdm

from proto.recmem.v1 import event_pb2
from streams.admin import client_settings
from streams.codec import encode_event
from streams.config import KafkaConfig

log = logging.getLogger(__name__)


class EventProducer:
    """Encodes and sends events to ``topic`` (``cfg.topic`` when not given)."""

    def __init__(
        self,
        cfg: KafkaConfig,
        topic: str | None = None,
        *,
        client_id: str = "recmem-produce",
        linger_ms: int = 5,
    ) -> None:
        self.topic = topic or cfg.topic
        # idempotent: a batch retried after a lost acknowledgement is written once (the
        # broker dedupes on producer id and sequence number); the engine's duplicate policy
        # covers what reaches Kafka twice anyway (docs/ingest.md, Duplicate events)
        self._producer = KafkaProducer(
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            batch_size=256 * 1024,
            **client_settings(cfg),
        )

    def send_raw(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        """Send one record as given (tests use this to send malformed records)."""
        self._producer.send(self.topic, key=key, value=value, headers=headers or [])

    def send(
        self,
        events: Iterable[event_pb2.Event],
        *,
        rate: float = 0.0,
        limit: int = 0,
        total: int | None = None,
        progress: bool = True,
    ) -> int:
        """Send events in the given order; returns how many were sent (and flushed).

        ``rate``: at most this many events per second (0 = as fast as possible);
        ``limit``: stop after this many (0 = all); ``total``: the expected count, for the
        progress bar."""
        if rate < 0 or limit < 0:
            raise ValueError(f"rate and limit must be >= 0 (got rate={rate}, limit={limit})")
        if limit and total is not None:
            total = min(total, limit)
        elif limit:
            total = limit
        sent = 0
        start = time.monotonic()
        with tqdm(
            total=total, unit="ev", desc=f"produce {self.topic}", disable=not progress
        ) as bar:
            for event in events:
                if limit and sent >= limit:
                    break
                if rate > 0:
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
                key, value = encode_event(event)
                self._producer.send(self.topic, key=key, value=value)
                sent += 1
                bar.update(1)
            self._producer.flush()
        log.info("sent %d events to %s", sent, self.topic)
        return sent

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
