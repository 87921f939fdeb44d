"""The engine loop: the one thread that owns the engine (state store, latest events, NoteBank,
replay cache) and schedules both kinds of work on it, in the manner of vLLM's
``EngineCore.step``. Front ends reach it only through its inbox: the gRPC servicer submits
rank requests (``submit``; a RankBatch's requests at once, ``submit_many``), the Kafka
adapter submits ingest batches (``submit_apply``) and ingest-ordered tasks (``run_task``:
restoring, capturing and dropping partitions), and ``inspect`` reads one user.

The consistency invariant, stated once: every read and every change of engine state happens
on this thread, and the thread reads state (rank batches, inspections, checkpoint captures)
only between units of ingest work. A unit is one piece of an ingest batch (a set of users,
each with all of its events of the batch): its new states, its latest events and its notes
are installed together. So a rank request sees, for its user, the state, latest events and
notes after the same whole number of that user's events; a checkpoint capture runs in
ingest order after every earlier batch is fully installed and before any later one starts,
so a checkpoint holds exactly the effects of the offsets it records.

What runs where, so that rank calls do not wait for ingest: a piece's model step (the bulk
of ingest) runs on an executor thread on a private copy of the piece's states, which
nothing else reads or writes, while this thread goes on ranking on the installed states;
the loop installs the result when it comes back, then hands the executor the next piece.
(Writing a piece's notes while the executor computes the next one measured slower on the
2-core CPU: both are Python-heavy and take turns on the GIL.) Checkpoint captures copy
users in slices with rank batches in between, and the files are written by the Kafka
adapter's writer thread, not this one.

Rank requests are micro-batched: a batch takes what is queued, waits at most
``window_ms`` for more (``adaptive``: only under concurrency, and it closes once as many
requests are in as the previous batch had plus those queued while it ran), and holds at
most ``max_batch`` requests; one ``ranker.rank`` per batch. An exception in a rank batch
fails that batch's requests only; one in ingest work stops ingest (``failure``): the Kafka
adapter then stops without another checkpoint, and a restart replays from the last one.
"""

from __future__ import annotations

import inspect as _inspect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from models.memory.recurrent import process_flushes_denormals
from recmem.engine.engine import ApplyCounts, Engine, IngestPlan, Piece, UserInfo
from recmem.ranking import BatchRanker, RankQuery, RankResult
from streams.batch import EventBatch
from streams.validate import ValidEvent

log = logging.getLogger(__name__)

R = TypeVar("R")


class LoopStopped(RuntimeError):
    """The engine loop no longer accepts work (stopping, or ingest failed)."""


class DeviceOutOfMemory(RuntimeError):
    """A rank batch ran out of device memory twice: once, and again after the caching
    allocator gave its unused blocks back (``torch.cuda.empty_cache``)."""


def _retry_out_of_memory(what: str, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``; on a device out-of-memory error, the allocator's cached blocks given
    back and ``fn(*args)`` once more (the work reads the model and private copies only, so
    a retry is safe). The second failure raises ``DeviceOutOfMemory``."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError as first:
        log.warning("%s ran out of device memory; retrying with the cache emptied", what)
        torch.cuda.empty_cache()
        try:
            return fn(*args)
        except torch.OutOfMemoryError as second:
            raise DeviceOutOfMemory(f"{what} ran out of device memory: {second}") from first


class PartitionUnavailable(LookupError):
    """The request's partition is not served by this engine now: still restoring, or no
    longer (or not yet) owned here. Never answered from an empty state."""

    def __init__(self, partition: int) -> None:
        super().__init__(f"partition {partition} is not served here now (restoring or moving)")
        self.partition = partition


@dataclass
class _Apply:
    events: Sequence[ValidEvent] | EventBatch
    future: Future[ApplyCounts]
    plan: IngestPlan | None = None
    dispatched: int = 0
    """Pieces handed to the executor so far."""
    open: int = 0
    """Pieces dispatched whose notes are not written yet."""


@dataclass
class _Task:
    fn: Callable[[Engine], Any]
    future: Future[Any]
    gen: Generator[Any, Any, Any] | None = None


@dataclass
class _Done:
    piece: Piece
    owner: _Apply
    error: BaseException | None = None


class _RankGroup:
    """Rank requests submitted together (``submit_many``): one future for all of them,
    resolved once each has its result or its exception, in submission order."""

    def __init__(self, n: int) -> None:
        self.future: Future[list[RankResult | BaseException]] = Future()
        self.outcomes: list[RankResult | BaseException | None] = [None] * n
        self.left = n
        self.running: bool | None = None
        """None until a member first runs; then False if the future was cancelled first."""

    def start(self) -> bool:
        if self.running is None:
            self.running = self.future.set_running_or_notify_cancel()
        return self.running

    def answer(self, index: int, outcome: RankResult | BaseException) -> None:
        self.outcomes[index] = outcome
        self.left -= 1
        if not self.left:
            self.future.set_result(self.outcomes)  # type: ignore[arg-type]


class _Member:
    """One request of a ``_RankGroup`` where the loop keeps a request's future: it starts,
    answers and fails as a future would, into its group."""

    __slots__ = ("group", "index")

    def __init__(self, group: _RankGroup, index: int) -> None:
        self.group = group
        self.index = index

    def set_running_or_notify_cancel(self) -> bool:
        return self.group.start()

    def set_result(self, result: RankResult) -> None:
        self.group.answer(self.index, result)

    def set_exception(self, error: BaseException) -> None:
        self.group.answer(self.index, error)


@dataclass
class LoopCounts:
    """Rank micro-batches: batches and requests run, the largest batch, wall time spent
    ranking and collecting batches (the window)."""

    batches: int = 0
    requests: int = 0
    largest_batch: int = 0
    busy_seconds: float = 0.0
    collect_seconds: float = 0.0


class EngineLoop:
    """The owner thread of ``engine`` (None: a rank-only loop, e.g. a baseline ranker) and
    of ``ranker``'s micro-batches. ``max_pending`` ingest batches may be queued or in
    flight; ``submit_apply`` blocks beyond that (the Kafka adapter's back-pressure)."""

    def __init__(
        self,
        ranker: BatchRanker,
        engine: Engine | None = None,
        *,
        window_ms: float = 4.0,
        max_batch: int = 64,
        adaptive: bool = True,
        max_pending: int = 2,
        name: str = "engine-loop",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if window_ms < 0:
            raise ValueError("window_ms must be >= 0")
        self.ranker = ranker
        self.engine = engine
        self._window_s = window_ms / 1000.0
        self._max_batch = max_batch
        self._adaptive = adaptive
        self._last_size = 0
        self._expected = 1
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        """Front ends put, only this thread gets. A SimpleQueue, not a Queue, whose put and
        timed get run Python code under a condition on every rank request's hop (8
        closed-loop callers of a 0.5 ms rank: p50 0.84 ms with a Queue, 0.77 with this;
        bench/experiments/loop_handoff.py)."""
        self._ranks: deque[tuple[RankQuery, Future[RankResult] | _Member, int | None]]
        self._ranks = deque()
        self._reads: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._ingest: deque[_Apply | _Task] = deque()
        self._applying: deque[_Apply] = deque()
        """Batches with pieces dispatched or not yet fully installed, oldest first."""
        self._task: _Task | None = None
        self._inflight: Piece | None = None
        self._done: _Done | None = None
        self._slots = threading.Semaphore(max_pending)
        self._lock = threading.Lock()
        self._accepting = True
        self._stopping = False
        self.failure: BaseException | None = None
        """The error that stopped ingest work (None while it runs)."""
        self.counts = LoopCounts()
        self._observers: list[Callable[[int], None]] = []
        self._exec_q: queue.Queue[tuple[Piece, _Apply] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._executor = threading.Thread(target=self._execute, name=f"{name}-exec", daemon=True)

    def start(self) -> EngineLoop:
        self._executor.start()
        self._thread.start()
        return self

    # ---- front-end API (any thread) ----------------------------------------------------

    def add_batch_observer(self, fn: Callable[[int], None]) -> None:
        """``fn(size)`` after every rank micro-batch (metrics)."""
        self._observers.append(fn)

    def _put(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            if not self._accepting:
                raise LoopStopped("the engine is shutting down")
            self._inbox.put(item)

    def submit(self, query: RankQuery, partition: int | None = None) -> Future[RankResult]:
        """Queue one rank request; the future resolves when its micro-batch has run. With
        ``partition`` (the user's Kafka partition) it fails with PartitionUnavailable
        unless that partition is serving when the micro-batch runs: checked on this
        thread, in order with restores and drops, so a rank call never sees a partition
        half restored or already dropped."""
        fut: Future[RankResult] = Future()
        self._put(("rank", query, fut, partition))
        return fut

    def submit_many(
        self, queries: Sequence[RankQuery], partitions: Sequence[int | None]
    ) -> Future[list[RankResult | BaseException]]:
        """Queue several rank requests at once (a RankBatch): each is ranked as ``submit``
        ranks it (``partitions[i]`` checked the same way), and the one future resolves,
        once all are answered, with each request's result or its exception, in order."""
        if len(queries) != len(partitions):
            raise ValueError("one partition per query")
        group = _RankGroup(len(queries))
        if not queries:
            group.future.set_result([])
            return group.future
        members = [(q, _Member(group, i), p) for i, (q, p) in enumerate(zip(queries, partitions))]
        self._put(("ranks", members))
        return group.future

    def read(self, fn: Callable[[], R]) -> Future[R]:
        """Run ``fn`` on the loop between two units of work (a consistent point)."""
        fut: Future[R] = Future()
        self._put(("read", fn, fut))
        return fut

    def inspect(
        self, user_id: str, timeout: float | None = 30.0, partition: int | None = None
    ) -> UserInfo | None:
        """InspectUser's answer (None: unknown user, or no engine); ``partition`` as in
        ``submit``."""
        engine = self.engine
        if engine is None:
            return None

        def read() -> UserInfo | None:
            if partition is not None and partition not in engine.serving:
                raise PartitionUnavailable(partition)
            return engine.inspect(user_id)

        return self.read(read).result(timeout)

    def submit_apply(self, events: Sequence[ValidEvent] | EventBatch) -> Future[ApplyCounts]:
        """Queue one ingest batch (in order with the other ingest work). Blocks while
        ``max_pending`` batches are queued or in flight; raises LoopStopped once ingest
        failed or the loop stops."""
        if self.engine is None:
            raise LoopStopped("this loop has no engine")
        while not self._slots.acquire(timeout=0.2):
            self._check_ingest()
        try:
            self._check_ingest()
            fut: Future[ApplyCounts] = Future()
            self._put(("apply", _Apply(events, fut)))
        except BaseException:
            self._slots.release()
            raise
        return fut

    def apply(
        self, events: Sequence[ValidEvent] | EventBatch, timeout: float | None = None
    ) -> ApplyCounts:
        """``submit_apply`` and wait until the batch is installed."""
        return self.submit_apply(events).result(timeout)

    def run_task(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run ``fn(engine)`` in ingest order: after every batch submitted before it is
        installed, before any later one starts. A generator function runs one slice per
        loop iteration (rank batches in between) and its return value is the result."""
        if self.engine is None:
            raise LoopStopped("this loop has no engine")
        self._check_ingest()
        fut: Future[Any] = Future()
        self._put(("task", _Task(fn, fut)))
        return fut

    def call(self, fn: Callable[[Engine], R], timeout: float | None = None) -> R:
        """``run_task`` and wait for its result."""
        return self.run_task(fn).result(timeout)  # type: ignore[no-any-return]

    def _check_ingest(self) -> None:
        if self.failure is not None:
            raise LoopStopped(f"ingest stopped after an error: {self.failure!r}") from self.failure
        if not self._accepting:
            raise LoopStopped("the engine is shutting down")

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop accepting work, finish what is queued (rank requests are answered, ingest
        work still queued fails with LoopStopped), join the threads."""
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
            self._inbox.put(("stop",))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # the loop has told the executor to end: wait for it,
            # so that no thread of ours runs torch code while the interpreter finalises
            self._executor.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop ----------------------------------------------------------------------

    def _execute(self) -> None:
        """The executor: model steps of ingest pieces on their private copies."""
        if process_flushes_denormals():
            torch.set_flush_denormal(True)  # before this thread's first parallel operation
        while True:
            item = self._exec_q.get()
            if item is None:
                return
            piece, owner = item
            try:
                assert self.engine is not None
                _retry_out_of_memory("an ingest step", self.engine.compute, piece)
                self._inbox.put(("done", _Done(piece, owner)))
            except BaseException as e:  # noqa: BLE001 - reported on the loop thread
                self._inbox.put(("done", _Done(piece, owner, e)))

    def _run(self) -> None:
        if process_flushes_denormals():
            torch.set_flush_denormal(True)
        try:
            while True:
                self._take(block=not self._runnable())
                if self._done is not None:
                    self._install()
                self._run_reads()
                if self._ranks:
                    self._rank_step()
                self._ingest_step()
                if self._stopping and not self._busy():
                    break
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself
            log.exception("the engine loop failed")
            self.failure = self.failure or e
        finally:
            self._exec_q.put(None)
            self._shut_down()

    def _busy(self) -> bool:
        """Work the loop still finishes before it stops: queued rank requests and reads,
        and ingest work already started."""
        return bool(
            self._ranks or self._reads or self._inflight or self._done or self._applying
            or self._task
        )  # fmt: skip

    def _runnable(self) -> bool:
        if self._ranks or self._reads or self._done is not None or self._stopping:
            return True
        if self.failure is not None or self._inflight is not None:
            return False
        return bool(self._task or self._ingest or self._dispatchable())

    def _dispatchable(self) -> bool:
        a = self._applying[-1] if self._applying else None
        return a is not None and a.plan is not None and a.dispatched < len(a.plan.pieces)

    def _take(self, block: bool, timeout: float | None = None) -> bool:
        """Move what is in the inbox to the loop's queues; wait for one item if ``block``.
        This thread is the inbox's only reader, so an inbox that is not empty still holds
        its items at the next get."""
        inbox = self._inbox
        if not block and inbox.empty():
            return False
        try:
            item = inbox.get(timeout=timeout) if block else inbox.get_nowait()
        except queue.Empty:
            return False
        self._sort(item)
        while not inbox.empty():
            self._sort(inbox.get_nowait())
        return True

    def _sort(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "rank":
            self._ranks.append((item[1], item[2], item[3]))
        elif kind == "ranks":
            self._ranks.extend(item[1])
        elif kind == "read":
            self._reads.append((item[1], item[2]))
        elif kind in ("apply", "task"):
            if self.failure is not None or self._stopping:
                self._refuse(item[1])
            else:
                self._ingest.append(item[1])
        elif kind == "done":
            self._done = item[1]
        elif kind == "stop":
            self._stopping = True
            while self._ingest:
                self._refuse(self._ingest.popleft())

    def _refuse(self, work: _Apply | _Task) -> None:
        err = LoopStopped(
            "the engine is shutting down"
            if self.failure is None
            else f"ingest stopped after an error: {self.failure!r}"
        )
        if work.future.set_running_or_notify_cancel():
            work.future.set_exception(err)
        if isinstance(work, _Apply):
            self._slots.release()

    def _run_reads(self) -> None:
        while self._reads:
            fn, fut = self._reads.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)

    # ---- rank --------------------------------------------------------------------------

    def _rank_step(self) -> None:
        opened = time.perf_counter()
        batch = [self._ranks.popleft()]
        wait, enough = self._window_s, self._max_batch
        if self._adaptive:
            if self._last_size <= 1 and not self._ranks:
                wait = 0.0
            enough = min(self._expected, self._max_batch)
        deadline = time.monotonic() + wait
        while len(batch) < self._max_batch:
            if self._ranks:
                batch.append(self._ranks.popleft())
                continue
            # once the expected requests are in, take only what is already queued
            remaining = deadline - time.monotonic() if len(batch) < enough else 0.0
            if not self._take(block=remaining > 0, timeout=max(remaining, 0.0)):
                break
        self.counts.collect_seconds += time.perf_counter() - opened
        self._last_size = len(batch)
        live = []
        serving = self.engine.serving if self.engine is not None else None
        for q, fut, partition in batch:
            if not fut.set_running_or_notify_cancel():
                continue
            if partition is not None and serving is not None and partition not in serving:
                fut.set_exception(PartitionUnavailable(partition))
                continue
            live.append((q, fut))
        outcome: Sequence[RankResult] | Exception = []
        if live:
            began = time.perf_counter()
            try:
                outcome = _retry_out_of_memory(
                    "a rank batch", self.ranker.rank, [q for q, _ in live]
                )
                if len(outcome) != len(live):
                    raise RuntimeError(
                        f"rank returned {len(outcome)} results for {len(live)} requests"
                    )
            except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the loop
                log.exception("rank batch of %d failed", len(live))
                outcome = exc
            c = self.counts
            c.busy_seconds += time.perf_counter() - began
            c.batches += 1
            c.requests += len(live)
            c.largest_batch = max(c.largest_batch, len(live))
        # Count what queued while the batch ran before its callers get their answers: a
        # caller's next request, sent on its answer, did not queue meanwhile, and counting
        # it would make the next batch wait out the window for more requests than there are
        # callers.
        self._take(block=False)
        self._expected = max(1, len(live) + len(self._ranks))
        for i, (_, fut) in enumerate(live):
            if isinstance(outcome, Exception):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome[i])
        if live:
            for fn in self._observers:
                fn(len(live))

    # ---- ingest ------------------------------------------------------------------------

    def _ingest_step(self) -> None:
        """Start the next unit of ingest work when nothing is in flight: the next piece of
        a batch, else the next batch, else (once every batch before it is installed) a
        slice of the next task."""
        if self.failure is not None or self._inflight is not None or self._done is not None:
            return
        if self._dispatch_piece():
            return
        if self._applying:
            return  # pieces still being installed
        if self._task is None and self._ingest and isinstance(self._ingest[0], _Task):
            task = self._ingest.popleft()
            assert isinstance(task, _Task)
            if not task.future.set_running_or_notify_cancel():
                return
            self._task = task
        if self._task is not None:
            self._task_slice()

    def _dispatch_piece(self) -> bool:
        """Hand the next piece to the executor (planning the next batch when the current
        one has none left); False when there is none."""
        assert self.engine is not None or not (self._applying or self._ingest)
        if self._task is not None:
            return False
        current = self._applying[-1] if self._applying else None
        if (
            current is None
            or current.plan is None
            or current.dispatched == len(current.plan.pieces)
        ):
            if not self._ingest or not isinstance(self._ingest[0], _Apply):
                return False
            work = self._ingest.popleft()
            assert isinstance(work, _Apply) and self.engine is not None
            current = work
            if not current.future.set_running_or_notify_cancel():
                self._slots.release()
                return False
            try:
                current.plan = self.engine.plan(current.events)
            except BaseException as e:  # noqa: BLE001 - stops ingest
                self._fail_ingest(e, current)
                return False
            self._applying.append(current)
            if not current.plan.pieces:
                self._finish(current)
                return False
        assert self.engine is not None and current.plan is not None
        rows = current.plan.pieces[current.dispatched]
        try:
            piece = self.engine.begin(current.plan, rows)
        except BaseException as e:  # noqa: BLE001
            self._fail_ingest(e, current)
            return False
        current.dispatched += 1
        current.open += 1
        self._inflight = piece
        self._exec_q.put((piece, current))
        return True

    def _install(self) -> None:
        """Install the piece the executor finished: its states and latest events, then hand
        the executor the next piece, then its notes. The NoteBank's write path so runs while
        the executor computes the next piece (nothing in ``plan``, ``begin`` or ``compute``
        reads the NoteBank), and nothing else on the loop runs between the two, so ranks,
        reads and tasks see states, latest events and notes move together as before."""
        done, self._done = self._done, None
        assert done is not None
        self._inflight = None
        if self.failure is not None:
            return  # ingest stopped while this piece ran (e.g. an earlier piece's notes)
        if done.error is not None:
            self._fail_ingest(done.error, done.owner)
            return
        assert self.engine is not None
        try:
            self.engine.commit(done.piece)
            self._dispatch_piece()
            self.engine.commit_notes(done.piece)
        except BaseException as e:  # noqa: BLE001
            self._fail_ingest(e, done.owner)
            return
        done.owner.open -= 1
        while self._applying:
            first = self._applying[0]
            assert first.plan is not None
            if first.open or first.dispatched < len(first.plan.pieces):
                break
            self._finish(first)

    def _finish(self, work: _Apply) -> None:
        assert work.plan is not None and self.engine is not None
        if self._applying and self._applying[0] is work:
            self._applying.popleft()
        elif work in self._applying:
            self._applying.remove(work)
        self.engine.totals.batches += 1
        work.future.set_result(work.plan.counts)
        self._slots.release()

    def _task_slice(self) -> None:
        task = self._task
        assert task is not None and self.engine is not None
        try:
            if task.gen is None:
                out = task.fn(self.engine)
                if not _inspect.isgenerator(out):
                    self._task = None
                    task.future.set_result(out)
                    return
                task.gen = out
            assert task.gen is not None
            next(task.gen)
        except StopIteration as stop:
            self._task = None
            task.future.set_result(stop.value)
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            self._task = None
            task.future.set_exception(e)

    def _fail_ingest(self, error: BaseException, work: _Apply | None) -> None:
        log.error("ingest work failed: %r", error)
        self.failure = error
        failed = list(self._applying)
        if work is not None and work not in failed:
            failed.append(work)
        self._applying.clear()
        for w in failed:
            if not w.future.done():
                w.future.set_exception(error)
            self._slots.release()
        while self._ingest:
            self._refuse(self._ingest.popleft())
        if self._task is not None:
            self._task.future.set_exception(LoopStopped(f"ingest stopped: {error!r}"))
            self._task = None

    def _shut_down(self) -> None:
        err = LoopStopped("the engine is shutting down")
        with self._lock:
            self._accepting = False
        self._take(block=False)
        for _, fut, _ in self._ranks:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        self._ranks.clear()
        for _, rfut in self._reads:
            if rfut.set_running_or_notify_cancel():
                rfut.set_exception(err)
        self._reads.clear()
        while self._ingest:
            self._refuse(self._ingest.popleft())
