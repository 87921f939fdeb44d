"""Stream events into Kafka in time order (``recmem produce``, the demo, the benchmarks): a
dataset, the benchmark workload or an events file, all as an
:class:`recmem.event_columns.EventStream` and one record format (streams.codec)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from proto.recmem.v1 import event_pb2
from recmem.config import Config
from recmem.datasets import Dataset, load_dataset
from recmem.event_columns import EventStream, dataset_stream, read_event_file
from recmem.workload import workload_stream
from streams.admin import ensure_topics
from streams.codec import make_event
from streams.producer import EventProducer


def open_stream(spec: str, cfg: Config) -> EventStream:
    """The events named by ``spec`` (:data:`STREAM_SPECS`)."""
    if spec == "workload":
        return workload_stream(cfg.workload)
    if spec.startswith("npz:"):
        return read_event_file(Path(spec.partition(":")[2]).expanduser())
    return dataset_stream(load_dataset(spec, cfg.data))


def stream_events(stream: EventStream, chunk_events: int = 1 << 16) -> Iterator[event_pb2.Event]:
    """The stream's events as wire messages, in order."""
    for c in stream.chunks(chunk_events):
        yield from map(
            make_event,
            stream.user_ids[c.user].tolist(),
            stream.item_ids[c.item].tolist(),
            c.ts_ms.tolist(),
            c.action.tolist(),
            c.value.tolist(),
        )


def produce_stream(
    cfg: Config, stream: EventStream, topic: str, *, rate: float = 0.0, limit: int = 0
) -> int:
    """Send ``stream``'s events keyed by user (creating ``topic`` with kafka.partitions
    partitions when absent); returns the count."""
    ensure_topics(cfg.kafka, {topic: cfg.kafka.partitions})
    with EventProducer(cfg.kafka, topic) as producer:
        return producer.send(stream_events(stream), rate=rate, limit=limit, total=stream.n_events)


def produce_dataset(
    cfg: Config, data: Dataset, topic: str, *, rate: float = 0.0, limit: int = 0
) -> int:
    """Send ``data``'s events (already sorted by time) keyed by user; returns the count."""
    return produce_stream(cfg, dataset_stream(data), topic, rate=rate, limit=limit)
