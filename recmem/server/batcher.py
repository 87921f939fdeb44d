"""Micro-batching of concurrent requests into one worker thread (the vLLM pattern: many
front-end threads, one engine step per batch).

A request waits at most ``window_ms`` after the first request of its batch arrived, and a
batch holds at most ``max_batch`` requests. With ``adaptive`` the window is only waited
when the previous batch had more than one request or more are already queued (a lone
request under light load runs at once), and a batch closes early once it holds as many
requests as are expected: the previous batch's requests plus those that queued while it
ran. Under closed-loop load (each client sends its next request when the previous one is
answered) that is the number of clients, so the window is not waited out once they are
all back, and the stragglers of one batch do not form a small batch of their own that
the others then wait for. The worker calls ``handler(items)`` once per batch; the handler
returns one result per item, in order. An exception in the handler fails every request of
that batch (never the worker).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()


class BatcherStopped(RuntimeError):
    """The batcher no longer accepts requests."""


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        handler: Callable[[Sequence[T]], Sequence[R]],
        window_ms: float,
        max_batch: int,
        name: str = "rank-batcher",
        adaptive: bool = False,
        prepare: Callable[[T], T] | None = None,
    ) -> None:
        """``prepare`` runs on each request as the worker takes it from the queue, so the
        work it does for the requests already in overlaps the wait for the rest of the
        batch (the Ranker reads tails and routes notes there). If it raises, the request
        goes into the batch as it was."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if window_ms < 0:
            raise ValueError("window_ms must be >= 0")
        self._handler = handler
        self._prepare = prepare
        self._window_s = window_ms / 1000.0
        self._max_batch = max_batch
        self._adaptive = adaptive
        self._last_size = 0
        self._expected = 1
        """Adaptive: requests expected in the next batch (the last batch + those queued
        while it ran)."""
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._accepting = True
        self.batches = 0
        """Batches run so far."""
        self.requests = 0
        """Requests run so far."""
        self.largest_batch = 0
        """Most requests seen in one batch."""
        self.busy_seconds = 0.0
        """Wall time spent in the handler so far."""
        self.collect_seconds = 0.0
        """Wall time from the first request of a batch to its close (the window and the
        ``prepare`` calls) so far; the rest of the worker's time it waits for a first one."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> Future[R]:
        """Queue one request; the future resolves when its batch has run."""
        fut: Future[R] = Future()
        with self._lock:
            if not self._accepting:
                raise BatcherStopped("the rank service is shutting down")
            self._queue.put((item, fut))
        return fut

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop accepting, finish the queued requests, join the worker."""
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
            self._queue.put(_STOP)
        self._thread.join(timeout)

    def _prepared(self, entry: tuple[T, Future[R]]) -> tuple[T, Future[R]]:
        item, fut = entry
        if self._prepare is None or fut.done():
            return entry
        try:
            return self._prepare(item), fut
        except Exception:  # noqa: BLE001 - the handler does the work itself then
            log.exception("preparing a queued request failed")
            return entry

    def _collect(self, first: object) -> tuple[list[tuple[T, Future[R]]], bool]:
        batch = [self._prepared(first)]  # type: ignore[arg-type]
        stop = False
        wait = self._window_s
        enough = self._max_batch
        if self._adaptive:
            if self._last_size <= 1 and self._queue.empty():
                wait = 0.0
            enough = min(self._expected, self._max_batch)
        deadline = time.monotonic() + wait
        while len(batch) < self._max_batch:
            # once the expected requests are in, take only what is already queued
            remaining = deadline - time.monotonic() if len(batch) < enough else 0.0
            try:
                nxt = (
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if nxt is _STOP:
                stop = True
                break
            batch.append(self._prepared(nxt))  # type: ignore[arg-type]
        return batch, stop

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            opened = time.perf_counter()
            batch, stop = self._collect(first)
            self.collect_seconds += time.perf_counter() - opened
            self._last_size = len(batch)
            live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            self.batches += 1
            self.requests += len(live)
            self.largest_batch = max(self.largest_batch, len(live))
            began = time.perf_counter()
            try:
                results = self._handler([item for item, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(
                        f"batch handler returned {len(results)} results for {len(live)} requests"
                    )
            except Exception as exc:  # noqa: BLE001 - one bad batch must not kill the worker
                log.exception("rank batch of %d failed", len(live))
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            finally:
                self.busy_seconds += time.perf_counter() - began
                self._expected = max(1, len(live) + self._queue.qsize())
            for (_, fut), res in zip(live, results):
                fut.set_result(res)
        # Drain anything queued before the stop marker was seen.
        while True:
            try:
                rest = self._queue.get_nowait()
            except queue.Empty:
                break
            if rest is not _STOP:
                _, fut = rest  # type: ignore[misc]
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(BatcherStopped("the rank service is shutting down"))
