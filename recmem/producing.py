"""Stream a dataset's events into Kafka in time order (``recmem produce`` and the demo)."""

from __future__ import annotations

from recmem.config import Config
from recmem.datasets import Dataset
from streams.admin import ensure_topics
from streams.codec import make_event
from streams.producer import EventProducer


def produce_dataset(
    cfg: Config, data: Dataset, topic: str, *, rate: float = 0.0, limit: int = 0
) -> int:
    """Send ``data``'s events (already sorted by time) keyed by user; returns the count."""
    ensure_topics(cfg.kafka, {topic: cfg.kafka.partitions})
    rows = data.events.select(["user_id", "item_id", "ts_ms", "action", "value"]).iter_rows()
    events = (make_event(u, i, ts, a, v) for u, i, ts, a, v in rows)
    with EventProducer(cfg.kafka, topic) as producer:
        return producer.send(events, rate=rate, limit=limit, total=data.n_events)
