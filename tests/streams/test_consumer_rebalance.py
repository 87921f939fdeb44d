"""What the consumer does at a rebalance, without a broker: partitions restored in the
background are checked (the positions probe) when they resume, not when they are assigned,
and a pending (re)join is awaited in one wait of up to the session timeout (kafka-python
drops a join that completes between two short polls: a whole extra rebalance round)."""

from __future__ import annotations

from typing import Any

import pytest

import streams.consumer_base as consumer_base
from streams.config import KafkaConfig
from streams.consumer import EventConsumer
from streams.consumer_base import BaseConsumer, Seek
from streams.positions import PartitionFacts
from tests.streams.sinks import RestoringSink


class ScriptedConsumer(BaseConsumer):
    """A BaseConsumer whose client only records what it is asked to do."""

    client_name = "scripted"

    def __init__(self, cfg: KafkaConfig, sink: Any) -> None:
        super().__init__(cfg, sink)
        self.started: list[tuple[dict[int, Seek], list[int], list[int]]] = []
        self.resumed: list[dict[int, Seek]] = []

    def _open(self) -> None:
        pass

    def _poll(self) -> dict:
        return {}

    def _close(self) -> None:
        pass

    def _open_now(self) -> bool:
        return True

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        pass

    def _lag(self, partitions: list[int]) -> dict[int, int]:
        return {}

    def _send_and_flush(self, records: list) -> list:
        return []

    def _too_large(self, error: BaseException) -> bool:
        return False

    def _start(self, seeks: dict[int, Seek], committed: list[int], paused: list[int]) -> None:
        self.started.append((seeks, committed, paused))

    def _resume(self, seeks: dict[int, Seek]) -> None:
        self.resumed.append(seeks)


def test_restoring_partitions_are_probed_when_they_resume_not_when_assigned(monkeypatch):
    probed: list[dict[int, int]] = []

    def fake_probe(cfg: KafkaConfig, resumes: dict[int, int]):
        probed.append(dict(resumes))
        return "", {p: PartitionFacts(0, 100, None) for p in resumes}

    monkeypatch.setattr(consumer_base, "probe", fake_probe)
    sink = RestoringSink(store={0: 0, 1: 0}, delay_s=3600)
    consumer = ScriptedConsumer(KafkaConfig(), sink)

    consumer._on_assigned([0, 1])

    assert probed == []  # nothing resumes yet: no probe client held up the callback
    assert consumer.started == [({}, [], [0, 1])]
    assert consumer.restoring == [0, 1]

    sink.ready = {0: 0}  # partition 0's restore finished: read from its start
    consumer._resume_restored()

    assert probed == [{}]
    assert consumer.resumed == [{0: "earliest"}]
    assert consumer.restoring == [1]


class Coordinator:
    def __init__(self, rejoins: int) -> None:
        self.rejoins = rejoins
        self.waits: list[int] = []

    def need_rejoin(self) -> bool:
        return self.rejoins > 0

    def ensure_active_group(self, timeout_ms: int) -> bool:
        self.waits.append(timeout_ms)
        self.rejoins -= 1
        return True


class Client:
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.polls: list[int] = []

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        self.polls.append(timeout_ms)
        return {}


@pytest.mark.parametrize("rejoins", [0, 1])
def test_a_pending_rejoin_is_awaited_in_one_wait_of_the_session_timeout(rejoins):
    cfg = KafkaConfig(max_wait_ms=100, session_timeout_ms=3000)
    consumer = EventConsumer(cfg, RestoringSink())
    coordinator = Coordinator(rejoins)
    client = Client(coordinator)
    consumer._consumer = client  # type: ignore[assignment]

    for _ in range(3):
        assert consumer._poll() == {}

    assert coordinator.waits == [3000] * rejoins
    assert client.polls == [100, 100, 100]
