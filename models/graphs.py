"""The rank path's replay pass (``MemoryRecommender.replay_read``) under CUDA graphs.

A replay on a GPU is a few hundred small kernels (embedding, two layers of projections, the
one-chunk read-out algebra, feed-forward blocks) on a handful of users: the launches, not
the arithmetic, set its time. ``GraphedReplay`` captures the pass once per padded shape
(users rounded up to a power of two, events up to the next of ``EVENT_BUCKETS``) into a CUDA
graph over static input buffers; a call copies its inputs into the buffers of its shape,
replays the graph and copies the user vectors out. Padding rows have no events (they read
their zero state), padding events lie after each user's last one: neither changes a real
row's result (the pass is causal and per row), so the answer is the eager pass's up to
floating-point reassociation in the batched products.

Where graphs cannot run (CPU, the torchrec KJT lookup, more users or events than the largest
bucket) a call is the eager ``replay_read``. With ``capture=False`` the padded static-buffer
path runs eagerly: what the tests check on a machine without CUDA.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from models.memory.readout import READOUT_MAX_EVENTS
from models.state import MemoryState

log = logging.getLogger(__name__)

EVENT_BUCKETS = (8, 16, 24, 32, 48, 64)
"""Events per replay a graph is captured for (the longest must fit the one-chunk form)."""
assert EVENT_BUCKETS[-1] <= READOUT_MAX_EVENTS


def _bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= n), None)


def _powers_of_two(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= ``top``: the padded user counts."""
    sizes = [1]
    while sizes[-1] < top:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _capture(run: Any, dev: torch.device, pool: Any) -> tuple[Any, torch.Tensor]:
    """(graph, output) of ``run()`` captured in a CUDA graph on ``dev`` after two warm-up
    runs on a side stream (lazy inits, cuBLAS handles)."""
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (an ingest step) stay legal meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


class _Captured:
    """Static inputs, the graph (None when not capturing) and its output for one shape."""

    def __init__(self, model: Any, B: int, T: int, like: MemoryState, capture: bool,
                 pool: Any) -> None:  # fmt: skip
        dev = like.S.device
        z = torch.zeros
        self.items = z(B, T, dtype=torch.int64, device=dev)
        self.actions = z(B, T, dtype=torch.int64, device=dev)
        self.ts = z(B, T, dtype=torch.int64, device=dev)
        self.lengths = z(B, dtype=torch.int64, device=dev)
        self.state = like.map(lambda t: z(B, *t.shape[1:], dtype=t.dtype, device=dev))
        self.model = model
        self.graph: Any = None
        self.out = self.state.h
        if capture:
            self.graph, self.out = _capture(self._run, dev, pool)

    def _run(self) -> torch.Tensor:
        return self.model.replay_read(self.items, self.actions, self.ts, self.lengths, self.state)

    def __call__(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
    ) -> torch.Tensor:
        B, T = items.shape
        st = self.state
        for ev_buf, ev in ((self.items, items), (self.actions, actions), (self.ts, ts_ms)):
            ev_buf.zero_()
            ev_buf[:B, :T].copy_(ev)
        self.lengths.zero_()
        self.lengths[:B].copy_(lengths)
        pairs = ((st.S, state.S), (st.M, state.M), (st.h, state.h), (st.pos, state.pos))
        for buf, x in pairs:
            if buf is not None and x is not None:
                buf[B:].zero_()
                buf[:B].copy_(x)
        st.last_ts.fill_(-1)
        st.last_ts[:B].copy_(state.last_ts)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._run()
        return self.out[:B].clone()


class GraphedReplay:
    """``model.replay_read`` through CUDA graphs captured per padded shape (see above).

    ``batch_buckets``: the user counts graphs are captured for (default powers of two up to
    ``max_batch``). Graphs are captured on first use of a shape, or all at once by
    ``capture_all``. Calls are serialised (the graphs share one memory pool and buffers).
    """

    def __init__(
        self,
        model: Any,
        max_batch: int = 64,
        capture: bool | None = None,
        event_buckets: tuple[int, ...] = EVENT_BUCKETS,
    ) -> None:
        self.model = model
        self.batch_buckets = _powers_of_two(max_batch)
        self.event_buckets = tuple(event_buckets)
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._shapes: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._lock = threading.Lock()
        self.calls = {"graph": 0, "eager": 0}
        """Calls answered from a padded shape, and eagerly (a shape too large, or KJT)."""

    def usable(self, B: int, T: int) -> bool:
        """Whether a call of B users and T events goes through a padded shape."""
        return (
            not getattr(self.model, "use_kjt", False)
            and _bucket(B, self.batch_buckets) is not None
            and _bucket(T, self.event_buckets) is not None
        )

    def capture_all(self, like: MemoryState, max_events: int | None = None) -> int:
        """Capture every shape up to ``max_events`` events (default: all) for states shaped
        like ``like``; returns how many shapes exist."""
        top = max_events or self.event_buckets[-1]
        for B in self.batch_buckets:
            for T in self.event_buckets:
                if max(top, self.event_buckets[0]) >= T:
                    self._get(B, T, like)
        return len(self._shapes)

    def _get(self, B: int, T: int, like: MemoryState) -> _Captured:
        key = (B, T)
        got = self._shapes.get(key)
        if got is None:
            with torch.inference_mode():  # buffers and graphs live in inference mode
                got = _Captured(self.model, B, T, like, self.capture, self._pool)
            self._shapes[key] = got
            log.debug("replay shape B=%d T=%d ready (graph: %s)", B, T, self.capture)
        return got

    def __call__(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts_ms: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
    ) -> torch.Tensor:
        B, T = items.shape
        if T == 0 or not self.usable(B, T):
            self.calls["eager"] += 1
            return self.model.replay_read(items, actions, ts_ms, lengths, state)
        Bp = _bucket(B, self.batch_buckets)
        Tp = _bucket(T, self.event_buckets)
        assert Bp is not None and Tp is not None
        with self._lock, torch.inference_mode():
            self.calls["graph"] += 1
            return self._get(Bp, Tp, state)(items, actions, ts_ms, lengths, state)


class _CapturedReadout:
    """Static inputs, the graph (None when not capturing) and the output of the read-out
    (``model.read_user``) for B users."""

    def __init__(self, model: Any, B: int, like: MemoryState, capture: bool, pool: Any) -> None:
        dev = like.h.device
        self.state = like.map(lambda t: torch.zeros(B, *t.shape[1:], dtype=t.dtype, device=dev))
        self.request_ts = torch.zeros(B, dtype=torch.int64, device=dev)
        self.mem = torch.zeros_like(self.state.h)
        self.replayed = torch.zeros_like(self.state.h)
        self.replayed_ok = torch.zeros(B, dtype=torch.bool, device=dev)
        self.model = model
        self.graph: Any = None
        self.out = self.state.h
        if capture:
            self.graph, self.out = _capture(self._run, dev, pool)

    def _run(self) -> torch.Tensor:
        return self.model.read_user(
            self.state, self.request_ts, mem=self.mem, replayed=self.replayed,
            replayed_ok=self.replayed_ok,
        )  # fmt: skip

    def __call__(
        self,
        state: MemoryState,
        request_ts: torch.Tensor,
        mem: torch.Tensor,
        replayed: torch.Tensor,
        replayed_ok: torch.Tensor,
    ) -> torch.Tensor:
        B = state.h.shape[0]
        static = self.state.to_fields()
        for name, x in state.to_fields().items():
            buf = static[name]
            buf[B:].zero_()  # padding rows read a zero state (rows are independent)
            buf[:B].copy_(x)
        for buf, x in (
            (self.request_ts, request_ts), (self.mem, mem), (self.replayed, replayed),
            (self.replayed_ok, replayed_ok),
        ):  # fmt: skip
            buf[B:].zero_()
            buf[:B].copy_(x)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._run()
        return self.out[:B].clone()


class GraphedReadout:
    """``model.read_user`` (the head over the memory read-out, the window and the request
    time: a hundred small kernels for a batch of users) through CUDA graphs captured per
    padded user count (powers of two up to ``max_batch``), as :class:`GraphedReplay` does for
    the replay pass. Calls with more users, or with the torchrec KJT lookup, run eagerly;
    ``capture=False`` runs the padded static-buffer path eagerly (the tests' CPU check).
    Calls are serialised (one memory pool, shared buffers)."""

    def __init__(self, model: Any, max_batch: int = 64, capture: bool | None = None) -> None:
        self.model = model
        self.batch_buckets = _powers_of_two(max_batch)
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._shapes: dict[int, _CapturedReadout] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._lock = threading.Lock()
        self.calls = {"graph": 0, "eager": 0}

    def capture_all(self, like: MemoryState) -> int:
        """Capture every user count for states shaped like ``like``; returns how many."""
        for B in self.batch_buckets:
            self._get(B, like)
        return len(self._shapes)

    def _get(self, B: int, like: MemoryState) -> _CapturedReadout:
        got = self._shapes.get(B)
        if got is None:
            with torch.inference_mode():
                got = _CapturedReadout(self.model, B, like, self.capture, self._pool)
            self._shapes[B] = got
        return got

    def __call__(
        self,
        state: MemoryState,
        request_ts: torch.Tensor,
        mem: torch.Tensor,
        replayed: torch.Tensor,
        replayed_ok: torch.Tensor,
    ) -> torch.Tensor:
        B = state.h.shape[0]
        Bp = _bucket(B, self.batch_buckets)
        if Bp is None or getattr(self.model, "use_kjt", False):
            self.calls["eager"] += 1
            return self.model.read_user(
                state, request_ts, mem=mem, replayed=replayed, replayed_ok=replayed_ok
            )
        with self._lock, torch.inference_mode():
            self.calls["graph"] += 1
            return self._get(Bp, state)(state, request_ts, mem, replayed, replayed_ok)
