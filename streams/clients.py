"""The consumer ``kafka.client`` names: kafka-python's :class:`~streams.consumer.EventConsumer`
(the default) or librdkafka's :class:`~streams.confluent.ConfluentEventConsumer`. Each is
imported only when chosen, so confluent-kafka is loaded only by those who ask for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streams.config import KafkaConfig
from streams.consumer_base import BaseConsumer
from streams.processes import ConsumerProcesses
from streams.sink import BatchSink

CLIENTS = ("kafka-python", "confluent")
"""``kafka.client`` choices."""


def consumer_class(client: str) -> Callable[..., BaseConsumer]:
    if client == "kafka-python":
        from streams.consumer import EventConsumer

        return EventConsumer
    if client == "confluent":
        from streams.confluent import ConfluentEventConsumer

        return ConfluentEventConsumer
    raise ValueError(f"kafka.client {client!r} is not one of {', '.join(CLIENTS)}")


def make_consumer(
    cfg: KafkaConfig, sink: BatchSink, **kwargs: Any
) -> BaseConsumer | ConsumerProcesses:
    """The consumer of ``cfg.client`` over ``sink`` (keyword arguments: BaseConsumer's),
    in this process; with ``cfg.consumer_processes`` > 0 that many of them in child
    processes (streams/processes.py), which take ``metrics``, ``client_id`` and ``member``."""
    consumer_class(cfg.client)  # an unknown client fails here, not in the children
    if cfg.consumer_processes > 0:
        return ConsumerProcesses(cfg, sink, cfg.consumer_processes, **kwargs)
    return consumer_class(cfg.client)(cfg, sink, **kwargs)
