"""RankRequest -> RankQuery, or an InvalidRequest naming the problem (the servicer turns it
into INVALID_ARGUMENT). Every limit comes from the ``server`` configuration section; ids
and context event times are bounded as the Kafka consumer bounds them (``kafka.max_field_bytes``,
``kafka.min_ts_ms``, ``kafka.max_past_ms``, ``kafka.max_future_ms``: ``events``)."""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from proto.recmem.v1 import rank_pb2
from recmem.queries import RankQuery, UserEvents
from recmem.vocab import ItemVocab
from streams.codec import action_from_wire
from streams.validate import Limits as EventLimits

_SHOW = 5
"""How many offending ids an error message lists."""


class InvalidRequest(ValueError):
    """A malformed request; the message says what is wrong."""


@dataclass(frozen=True)
class Limits:
    max_k: int
    max_candidates: int
    max_context_events: int
    max_batch_requests: int
    max_replay_notes: int
    default_replay_notes: int
    events: EventLimits


def _check_id(value: str, what: str, limits: Limits) -> None:
    if not value:
        raise InvalidRequest(f"{what} is empty")
    if len(value.encode("utf-8")) > limits.events.max_field_bytes:
        raise InvalidRequest(f"{what} is longer than {limits.events.max_field_bytes} bytes")


def _action_index(action: int, where: str) -> int:
    index = action_from_wire(action)
    if index is None:
        raise InvalidRequest(f"{where}: unknown action value {action}")
    return index


def _context(req: rank_pb2.RankRequest, vocab: ItemVocab, limits: Limits) -> UserEvents:
    n = len(req.context)
    if n > limits.max_context_events:
        raise InvalidRequest(
            f"context has {n} events, the limit is {limits.max_context_events} "
            "(server.max_context_events)"
        )
    if n == 0:
        return UserEvents.empty()
    now = int(time.time() * 1000)
    items = np.empty(n, np.int64)
    actions = np.empty(n, np.int64)
    ts = np.empty(n, np.int64)
    prev = -1
    for i, ev in enumerate(req.context):
        where = f"context[{i}]"
        if ev.user_id and ev.user_id != req.user_id:
            raise InvalidRequest(f"{where}: user_id {ev.user_id!r} differs from the request's")
        _check_id(ev.item_id, f"{where}.item_id", limits)
        max_bytes = limits.events.max_field_bytes
        if ev.HasField("session_id") and len(ev.session_id.encode()) > max_bytes:
            raise InvalidRequest(f"{where}: session_id is longer than {max_bytes} bytes")
        if ev.ts_ms <= 0:
            raise InvalidRequest(f"{where}: ts_ms is missing or not positive")
        time_problem = limits.events.ts_problem(ev.ts_ms, now)
        if time_problem is not None:
            raise InvalidRequest(f"{where}: {time_problem[1]}")
        if ev.ts_ms < prev:
            raise InvalidRequest(f"{where}: context events must be oldest first")
        if not math.isfinite(ev.value):
            raise InvalidRequest(f"{where}: value is not a finite number")
        prev = ev.ts_ms
        items[i] = vocab.encode_one(ev.item_id)
        actions[i] = _action_index(ev.action, where)
        ts[i] = ev.ts_ms
    return UserEvents(items, actions, ts)


def _candidates(req: rank_pb2.RankRequest, vocab: ItemVocab, limits: Limits) -> np.ndarray | None:
    ids = req.candidate_item_ids
    if not ids:
        return None
    if len(ids) > limits.max_candidates:
        raise InvalidRequest(
            f"{len(ids)} candidate_item_ids, the limit is {limits.max_candidates} "
            "(server.max_candidates)"
        )
    idx = np.fromiter((vocab.index.get(i, -1) for i in ids), dtype=np.int64, count=len(ids))
    if (idx < 0).any():
        unknown = [ids[j] for j in np.nonzero(idx < 0)[0][:_SHOW]]
        n_bad = int((idx < 0).sum())
        raise InvalidRequest(
            f"{n_bad} candidate_item_ids are not in the model's catalog, e.g. {unknown}"
        )
    if len(np.unique(idx)) != len(idx):
        raise InvalidRequest("candidate_item_ids contains duplicates")
    return idx


def to_query(req: rank_pb2.RankRequest, vocab: ItemVocab, limits: Limits) -> RankQuery:
    """Validate one RankRequest; raises InvalidRequest with a message."""
    return _query(req, vocab, limits, lambda: _candidates(req, vocab, limits))


def _query(
    req: rank_pb2.RankRequest,
    vocab: ItemVocab,
    limits: Limits,
    candidates: Callable[[], np.ndarray | None],
) -> RankQuery:
    """``to_query`` with the candidates' check and encoding given (called in its place in
    the order of the checks, so that a request with several problems names the same one)."""
    _check_id(req.user_id, "user_id", limits)
    if req.k <= 0:
        raise InvalidRequest(f"k must be positive, got {req.k}")
    if req.k > limits.max_k:
        raise InvalidRequest(f"k = {req.k} exceeds the limit {limits.max_k} (server.max_k)")
    notes = 0
    if req.replay.enabled:
        if req.replay.notes < 0:
            raise InvalidRequest(f"replay.notes must be >= 0, got {req.replay.notes}")
        if req.replay.notes > limits.max_replay_notes:
            raise InvalidRequest(
                f"replay.notes = {req.replay.notes} exceeds the limit "
                f"{limits.max_replay_notes} (server.max_replay_notes)"
            )
        notes = req.replay.notes or limits.default_replay_notes
    if req.request_ts_ms < 0:
        raise InvalidRequest(f"request_ts_ms must be >= 0 (0 = now), got {req.request_ts_ms}")
    return RankQuery(
        user_id=req.user_id,
        request_ts_ms=req.request_ts_ms,
        k=req.k,
        candidates=candidates(),
        replay_notes=notes,
        context=_context(req, vocab, limits),
    )


def _given(candidates: np.ndarray | None) -> np.ndarray | None:
    return candidates


def to_queries(
    reqs: Sequence[rank_pb2.RankRequest], vocab: ItemVocab, limits: Limits
) -> list[RankQuery | InvalidRequest]:
    """What ``to_query`` gives for each request (its query, or its InvalidRequest), with
    the candidates of all requests looked up and checked for duplicates at once. A request
    whose candidates fail a check goes through ``to_query`` itself for its message."""
    ids = [list(r.candidate_item_ids) for r in reqs]
    sizes = np.fromiter(map(len, ids), np.int64, count=len(ids))
    flat = list(itertools.chain.from_iterable(ids))
    idx = np.fromiter(map(vocab.index.get, flat, itertools.repeat(-1)), np.int64, len(flat))
    ends = np.cumsum(sizes)
    starts = ends - sizes
    row = np.repeat(np.arange(len(reqs)), sizes)
    bad = sizes > limits.max_candidates
    bad[row[idx < 0]] = True
    # duplicates: equal (row, index) pairs sit side by side once sorted
    span = vocab.n_items + 1
    keyed = np.sort(row * span + idx + 1)
    bad[keyed[1:][keyed[1:] == keyed[:-1]] // span] = True
    out: list[RankQuery | InvalidRequest] = []
    for i, req in enumerate(reqs):
        try:
            if bad[i]:
                out.append(to_query(req, vocab, limits))
            else:
                mine = idx[starts[i] : ends[i]] if sizes[i] else None
                out.append(_query(req, vocab, limits, functools.partial(_given, mine)))
        except InvalidRequest as e:
            out.append(e)
    return out
