"""The benchmark workload (issue 14): many users with Zipf activity and Zipf item
popularity, one stream in time order, generated chunk by chunk with numpy.

What the settings (``[workload]``, recmem/config.py) produce:

- activity: every user has one event, and the other ``events - users`` are shared out
  multinomially, the user of activity rank r getting weight ``r**-user_zipf`` (ranks are a
  random permutation of the users, so heavy users are spread over ids and partitions). The
  top fraction f of users therefore hold ``(fN + (E - N) H(fN, s) / H(N, s)) / E`` of the
  events in expectation, H the generalised harmonic number (:func:`expected_top_share`).
- order: each event of a user falls into one of ``ceil(events / BLOCK_EVENTS)`` consecutive
  time blocks, uniformly and independently (drawn block after block as a binomial share of
  the user's remaining events), and a block's events are shuffled: the stream is a uniform
  random merge of the users' histories, each spread over the whole span.
- time: strictly increasing timestamps from :data:`START_MS`, geometric gaps (whole ms, at
  least 1) of mean ``mean_gap_ms``.
- items: drawn per event, the item of popularity rank r (a random permutation of the
  catalog) with probability proportional to ``r**-item_zipf``.
- every event is a ``view`` of value 1; user k is ``u{k}``, item j is ``i{j}``.

Memory: a few arrays of ``users`` and ``items`` entries and one block of events at a time,
never all the events. The output depends on the settings only; the chunk size a caller asks
for just cuts the same stream differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from proto.actions import ACTIONS
from recmem.config import WorkloadConfig
from recmem.config_checks import out_of_range
from recmem.event_columns import EventColumns, EventStream, rechunk

BLOCK_EVENTS = 1 << 16
"""Events per time block (in expectation): part of what the seed means, so fixed."""
START_MS = 1_704_067_200_000
"""The first event's time: 2024-01-01 00:00 UTC."""
VIEW = ACTIONS.index("view")


def check_workload(spec: WorkloadConfig) -> None:
    """Raise ValueError naming every setting out of its range (recmem/config_checks.py)."""
    found = [
        msg
        for f in dataclasses.fields(spec)
        if (msg := out_of_range(f"workload.{f.name}", getattr(spec, f.name))) is not None
    ]
    if not found and spec.events < spec.users:
        found.append(
            f"workload.events = {spec.events} < workload.users = {spec.users}: every user "
            "has at least one event"
        )
    if found:
        raise ValueError("; ".join(found))


def rank_weights(n: int, s: float) -> np.ndarray:
    """``r**-s`` for ranks r = 1..n (float64)."""
    return np.arange(1, n + 1, dtype=np.float64) ** -s


def expected_top_share(spec: WorkloadConfig, fraction: float = 0.01) -> float:
    """The expected share of all events held by the most active ``fraction`` of users
    (at least one user)."""
    check_workload(spec)
    k = max(1, int(fraction * spec.users))
    w = rank_weights(spec.users, spec.user_zipf)
    extra = (spec.events - spec.users) * float(w[:k].sum() / w.sum())
    return (k + extra) / spec.events


def top_share(counts: np.ndarray, fraction: float = 0.01) -> float:
    """The share of ``counts.sum()`` held by the largest ``fraction`` of the entries."""
    k = max(1, int(fraction * len(counts)))
    return float(np.partition(counts, len(counts) - k)[-k:].sum() / counts.sum())


def user_event_counts(spec: WorkloadConfig) -> np.ndarray:
    """Events per user (index = user code), summing to ``spec.events``."""
    check_workload(spec)
    rng = np.random.default_rng([spec.seed, 0])
    rank = rng.permutation(spec.users)  # user u has activity rank rank[u] + 1
    w = rank_weights(spec.users, spec.user_zipf)[rank]
    return 1 + rng.multinomial(spec.events - spec.users, w / w.sum())


def _blocks(spec: WorkloadConfig) -> Iterator[EventColumns]:
    remaining = user_event_counts(spec)
    item_of_rank = np.random.default_rng([spec.seed, 2]).permutation(spec.items)
    item_cdf = np.cumsum(rank_weights(spec.items, spec.item_zipf))
    item_cdf /= item_cdf[-1]
    n_blocks = -(-spec.events // BLOCK_EVENTS)
    last_ts = START_MS
    for b in range(n_blocks):
        rng = np.random.default_rng([spec.seed, 1, b])
        active = np.flatnonzero(remaining)
        left = remaining[active]
        share = left if b == n_blocks - 1 else rng.binomial(left, 1.0 / (n_blocks - b))
        remaining[active] = left - share
        user = rng.permutation(np.repeat(active, share))
        n = len(user)
        rank = np.searchsorted(item_cdf, rng.random(n), side="right")
        item = item_of_rank[np.minimum(rank, spec.items - 1)]
        ts_ms = last_ts + np.cumsum(rng.geometric(1.0 / spec.mean_gap_ms, n))
        if n:
            last_ts = int(ts_ms[-1])
        yield EventColumns(
            user=user,
            item=item,
            ts_ms=ts_ms,
            action=np.full(n, VIEW, dtype=np.int8),
            value=np.ones(n, dtype=np.float32),
        )


def workload_chunks(
    spec: WorkloadConfig, chunk_events: int = BLOCK_EVENTS
) -> Iterator[EventColumns]:
    """The workload's events in time order, ``chunk_events`` at a time."""
    check_workload(spec)
    return rechunk(_blocks(spec), chunk_events)


def workload_stream(spec: WorkloadConfig) -> EventStream:
    """The workload as an :class:`EventStream` (id tables built here; events generated on
    each pass)."""
    check_workload(spec)
    spec = dataclasses.replace(spec)  # later edits of the caller's settings change nothing
    user_ids = np.array([f"u{k}" for k in range(spec.users)])
    item_ids = np.array([f"i{k}" for k in range(spec.items)])
    meta = {
        "source": "workload",
        "workload": dataclasses.asdict(spec),
        "block_events": BLOCK_EVENTS,
        "start_ms": START_MS,
    }
    return EventStream(
        "workload",
        user_ids,
        item_ids,
        spec.events,
        lambda size: workload_chunks(spec, size),
        meta,
    )
