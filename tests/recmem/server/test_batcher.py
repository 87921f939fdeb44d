"""MicroBatcher's adaptive window: a batch closes once the expected requests are in."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from recmem.server.batcher import MicroBatcher


def test_batch_closes_once_the_expected_requests_are_in() -> None:
    sizes: list[int] = []
    release = threading.Event()

    def handler(xs: Sequence[int]) -> list[int]:
        sizes.append(len(xs))
        if len(sizes) == 1:
            assert release.wait(10)  # hold the first batch while three more queue up
        return [x + 1 for x in xs]

    batcher: MicroBatcher[int, int] = MicroBatcher(
        handler, window_ms=60_000, max_batch=16, adaptive=True
    )
    try:
        first = batcher.submit(0)  # lone: runs at once
        while not sizes:
            threading.Event().wait(0.001)
        queued = [batcher.submit(i) for i in (1, 2, 3)]
        release.set()
        assert first.result(timeout=10) == 1
        # expected next: 1 (the last batch) + 3 (queued while it ran) = 4; three are in, so
        # the batch waits (a 60 s window) for the fourth and then runs at once
        last = batcher.submit(4)
        assert [f.result(timeout=10) for f in [*queued, last]] == [2, 3, 4, 5]
        assert sizes == [1, 4]
    finally:
        batcher.stop()


def test_fixed_window_is_waited_out_without_adaptive() -> None:
    sizes: list[int] = []
    batcher: MicroBatcher[int, int] = MicroBatcher(
        lambda xs: sizes.append(len(xs)) or list(xs), window_ms=200, max_batch=16
    )
    try:
        futs = [batcher.submit(i) for i in range(3)]
        assert [f.result(timeout=10) for f in futs] == [0, 1, 2]
        assert sizes == [3]
        assert batcher.busy_seconds >= 0.0
    finally:
        batcher.stop()


def test_prepare_runs_on_queued_requests_in_the_worker() -> None:
    threads: set[str] = set()

    def prepare(x: int) -> int:
        threads.add(threading.current_thread().name)
        if x == 3:
            raise ValueError("cannot prepare 3")
        return 10 * x

    batcher: MicroBatcher[int, int] = MicroBatcher(
        lambda xs: [x + 1 for x in xs], window_ms=0, max_batch=4, name="w", prepare=prepare
    )
    try:
        # prepared (x10) before the handler; a failing prepare leaves the request as it was
        assert [batcher.submit(x).result(timeout=10) for x in (1, 2, 3)] == [11, 21, 4]
        assert threads == {"w"}
    finally:
        batcher.stop()
