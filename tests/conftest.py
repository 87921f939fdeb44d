"""Shared fixtures. The Kafka fixtures run a real tansu broker on 127.0.0.1 (one per test
session, in-memory storage); each test gets its own topics and group, so tests never see
each other's records."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter (tests/models/test_memory_triton.py) only works when the
    # variable is set before anything imports triton; torchrec's import (any model built
    # with torchrec installed) pulls triton in, so set it before any test module runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile off for the suite (and the commands it starts): the engine's compiled CPU
# step (state.compile_step auto or on) would compile at every engine built with a new model
# shape, 15-30 s each on two cores; tests/models/test_memory_compiled.py turns it on itself.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from recmem.config import KafkaConfig
from streams.broker import EmbeddedBroker
from tests.kafka_env import kafka_settings


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A tansu broker on a free loopback port for the whole test session."""
    log_path = tmp_path_factory.mktemp("tansu") / "broker.log"
    with EmbeddedBroker(log_path=log_path) as broker:
        yield broker


@pytest.fixture(scope="session")
def s3_server() -> Iterator[object]:
    """An S3 emulator (moto_server) on a free loopback port for the whole test session;
    ``s3_server.bucket()`` makes a fresh bucket (tests/moto.py)."""
    from tests.moto import MotoServer

    with MotoServer() as server:
        yield server


KafkaConfigFactory = Callable[..., KafkaConfig]


@pytest.fixture
def kafka_config(kafka_broker: EmbeddedBroker) -> KafkaConfigFactory:
    """Factory: ``kafka_config(partitions=4, **overrides)`` -> a KafkaConfig on the session
    broker with a fresh input topic (created with ``partitions``), dead-letter topic and
    group, fast group timeouts (tansu makes a join wait half the session timeout), no time
    bounds and the metrics endpoint off."""

    def make(partitions: int = 4, **overrides: object) -> KafkaConfig:
        tag = uuid.uuid4().hex[:10]
        fields: dict[str, object] = {
            "group_id": f"group-{tag}",
            "session_timeout_ms": 3000,
            "heartbeat_interval_ms": 500,
        }
        return kafka_settings(
            kafka_broker.bootstrap, partitions, topic=f"events-{tag}", **{**fields, **overrides}
        )

    return make
