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


class RestoringSink(RecordingSink):
    """Restores each assigned partition in the background: ``on_assigned`` answers
    RESTORING, a timer marks the partition restored ``delay_s`` later and ``restored()``
    hands out its resume point. Keeps every group view it is shown."""

    def __init__(self, store: dict[int, int] | None = None, delay_s: float = 0.5) -> None:
        super().__init__(store)
        self.delay_s = delay_s
        self.views: list[object] = []
        self.ready: dict[int, int] = {}
        self.restored_at: dict[int, float] = {}
        self.batch_partitions: list[tuple[float, set[int]]] = []

    def on_group(self, view: object) -> None:
        self.views.append(view)

    def on_assigned(self, partitions: list[int]):  # type: ignore[override]
        from streams.sink import RESTORING

        self.calls.append(("assigned", list(partitions)))

        def done(p: int) -> None:
            with self.lock:
                self.ready[p] = self.store.get(p, 0)

        for p in partitions:
            t = threading.Timer(self.delay_s, done, args=(p,))
            t.daemon = True
            t.start()
        return dict.fromkeys(partitions, RESTORING)

    def restored(self) -> dict[int, int]:
        import time

        with self.lock:
            out, self.ready = self.ready, {}
        for p, offset in out.items():
            self.owned[p] = offset
            self.restored_at[p] = time.monotonic()
        return out

    def apply_batch(self, events, next_offsets, source=None):  # type: ignore[override]
        import time

        self.batch_partitions.append((time.monotonic(), set(next_offsets)))
        super().apply_batch(events, next_offsets, source)
