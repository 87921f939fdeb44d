"""A BatchSink for tests: records every call; its 'checkpoint' is a dict shared by all sinks
of a test (standing in for durable checkpoint storage)."""

from __future__ import annotations

import threading

from streams.validate import ValidEvent


class RecordingSink:
    def __init__(self, store: dict[int, int] | None = None, checkpoint_every: int = 0) -> None:
        self.store = store if store is not None else {}
        self.checkpoint_every = checkpoint_every
        self.events: list[ValidEvent] = []
        self.calls: list[tuple[str, object]] = []
        self.owned: dict[int, int] = {}  # partition -> next offset applied
        self.batches = 0
        self.lock = threading.Lock()

    def on_assigned(self, partitions: list[int]) -> dict[int, int]:
        self.calls.append(("assigned", list(partitions)))
        for p in partitions:
            if p in self.store:
                self.owned[p] = self.store[p]
        return {p: self.store[p] for p in partitions if p in self.store}

    def on_revoked(self, partitions: list[int]) -> None:
        self.calls.append(("revoked", list(partitions)))
        for p in partitions:
            if p in self.owned:
                self.store[p] = self.owned.pop(p)

    def apply_batch(
        self, events: list[ValidEvent], next_offsets: dict[int, int], source: object = None
    ) -> None:
        with self.lock:
            self.events.extend(events)
            self.owned.update(next_offsets)
            self.batches += 1
        self.calls.append(("batch", (len(events), dict(next_offsets))))

    def checkpoint_due(self) -> bool:
        return self.checkpoint_every > 0 and self.batches >= self.checkpoint_every

    def checkpoint(self) -> dict[int, int]:
        self.calls.append(("checkpoint", dict(self.owned)))
        self.store.update(self.owned)
        self.batches = 0
        return dict(self.owned)

    def snapshot(self) -> list[ValidEvent]:
        with self.lock:
            return list(self.events)
