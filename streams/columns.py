"""A poll's records straight to columns: :func:`decode_records` turns the records of one
poll into an :class:`~streams.batch.EventBatch` (duplicate keys hashed) and the dead
letters of the bad ones, without a :class:`~streams.validate.ValidEvent` per event.

:func:`decode_records_reference` is the plain form and the definition: every record through
:func:`~streams.validate.validate_record`, the valid ones into ``EventBatch.of``. The fast
form must give the same batch and the same dead letters, in the same order
(tests/streams/test_columns.py, on random and malformed records).

How the fast form gets there: the poll's values are parsed (upb, in C) and their fields read
with one ``map`` each; the checks then run on the whole poll at once with numpy (empty ids,
``ts_ms``, the action's range, a finite value, the time window, the key against the user
id). An optional id set to "" reads as "" like an unset one: presence is asked
(``HasField``) only of records longer than the shortest encoding of their values
(``_least_size``), which a record holding such an id always is. A record that any check
doubts (and every record whose value does not parse, or that has a long id, a session or
an event id set to the empty string) goes through
``validate_record`` itself, so a dead letter's reason and message are always the
reference's; a doubted record that passes there is kept with the reference's fields. Per
event this skips the ValidEvent (a frozen dataclass, slow to build), the per-record checks
and the second walk over the events in ``EventBatch.of``: validation, batch building and
keys 17.7 -> 11.4 CPU us/event on the 2-core VM (bench/experiments/README.md, "Member
consumer CPU", ``member_cpu_ab_r1.json``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from proto.actions import ACTIONS
from streams.batch import EventBatch, keys_of
from streams.codec import OTHER_INDEX, Event
from streams.validate import DeadLetter, Limits, ValidEvent, validate_record

RawRecord = tuple[int, bytes | None, bytes | None]
"""(offset, key, value) of one consumed record (as streams.consumer_base.RawRecord)."""

_FIELDS = operator.attrgetter(
    "user_id", "item_id", "ts_ms", "action", "value", "session_id", "event_id"
)
_EMPTY = Event()
"""Stands in for a value that does not parse (its row is doubted)."""


def decode_records_reference(
    topic: str,
    records: Mapping[int, Sequence[RawRecord]],
    now_ms: int,
    limits: Limits,
) -> tuple[EventBatch, list[DeadLetter]]:
    """The batch of a poll's valid records and the dead letters of the others, partitions
    in ascending order, each partition's records in the order given: one
    ``validate_record`` per record (the plain form of :func:`decode_records`)."""
    events: list[ValidEvent] = []
    dead: list[DeadLetter] = []
    for p in sorted(records):
        for offset, key, value in records[p]:
            out = validate_record(topic, p, offset, key, value, now_ms, limits)
            if isinstance(out, ValidEvent):
                events.append(out)
            else:
                dead.append(out)
    return EventBatch.of(events), dead


def decode_records(
    topic: str,
    records: Mapping[int, Sequence[RawRecord]],
    now_ms: int,
    limits: Limits,
) -> tuple[EventBatch, list[DeadLetter]]:
    """:func:`decode_records_reference`'s result, checked with numpy over the whole poll
    (module docstring). Never raises on bad input."""
    partitions: list[int] = []
    offsets: list[int] = []
    keys: list[bytes | None] = []
    wires: list[bytes | None] = []
    for p in sorted(records):
        part = records[p]
        if part:
            o, k, v = zip(*part)
            partitions += [p] * len(part)
            offsets += o
            keys += k
            wires += v
    n = len(wires)
    if n == 0:
        return EventBatch.of([]), []
    try:  # the whole poll in C when every value parses (the usual case)
        events = list(map(Event.FromString, wires))  # type: ignore[arg-type]  # None raises
        odd: list[int] = []
        """Rows the parse already doubts (no value, not an Event), and rows with an
        optional id set to "" (kept apart from an unset one by the reference)."""
    except (DecodeError, ValueError, TypeError):  # as validate_record
        events, odd = _parse_each(wires)
    cols = list(zip(*map(_FIELDS, events)))
    users: list[str] = list(cols[0])
    items: list[str] = list(cols[1])
    ts, actions, values = cols[2], cols[3], cols[4]
    ts_a = np.asarray(ts, np.int64)
    action_a = np.asarray(actions, np.int64)
    value_a = np.asarray(values, np.float64)
    # An unset optional id reads "", as one set to "" does (the reference keeps them
    # apart: None and ""). Presence is asked only of records longer than the shortest
    # encoding of the values they hold: one with an id set to "" holds that id's tag and
    # length besides, and any encoding of a value is at least as long as the shortest.
    user_bytes = list(map(str.encode, users))
    wire_len = np.fromiter((len(w) if w is not None else -1 for w in wires), np.int64, n)
    longer = wire_len > _least_size(user_bytes, items, cols[5], cols[6], ts_a, action_a, value_a)
    for col, name in ((5, "session_id"), (6, "event_id")):
        odd += [
            row
            for row in np.flatnonzero(longer).tolist()
            if not cols[col][row] and events[row].HasField(name)
        ]
    sessions: list[str | None] = [s or None for s in cols[5]]
    event_ids: list[str | None] = [e or None for e in cols[6]]
    doubt = np.zeros(n, bool)
    doubt[odd] = True
    doubt |= _doubted(users, user_bytes, items, sessions, event_ids, keys, ts_a, action_a, value_a,
                      now_ms, limits)  # fmt: skip
    # the wire's enum value -> index into ACTIONS (any other value is doubted)
    action_a = np.where(action_a == 0, OTHER_INDEX, action_a - 1)
    dead: list[DeadLetter] = []
    keep = ~doubt
    for row in np.flatnonzero(doubt).tolist():
        out = validate_record(
            topic, partitions[row], offsets[row], keys[row], wires[row], now_ms, limits
        )
        if isinstance(out, DeadLetter):
            dead.append(out)
            continue
        keep[row] = True
        users[row], items[row], sessions[row], event_ids[row] = (
            out.user_id, out.item_id, out.session_id, out.event_id,
        )  # fmt: skip
        ts_a[row], action_a[row], value_a[row] = out.ts_ms, out.action, out.value
    rows = np.flatnonzero(keep)
    if len(rows) < n:
        idx = rows.tolist()
        users = [users[i] for i in idx]
        items = [items[i] for i in idx]
        sessions = [sessions[i] for i in idx]
        event_ids = [event_ids[i] for i in idx]
        ts_a, action_a, value_a = ts_a[rows], action_a[rows], value_a[rows]
    part_a = np.asarray(partitions, np.int64)[rows]
    offset_a = np.asarray(offsets, np.int64)[rows]
    batch = EventBatch(
        users, items, ts_a, action_a, value_a, sessions, part_a, offset_a, event_ids,
        keys_of(items, ts_a, action_a, event_ids),
    )  # fmt: skip
    return batch, dead


def _parse_each(wires: list[bytes | None]) -> tuple[list[Any], list[int]]:
    """Each value parsed alone: the events (an empty Event where the value is missing or
    does not parse) and the rows of those."""
    events: list[Any] = []
    odd: list[int] = []
    for row, wire in enumerate(wires):
        try:
            if wire is None:
                raise TypeError("no value")
            events.append(Event.FromString(wire))
        except (DecodeError, ValueError, TypeError):  # as validate_record
            events.append(_EMPTY)
            odd.append(row)
    return events, odd


def _varint_size(x: np.ndarray) -> np.ndarray:
    """Bytes of the shortest varint of each int64 (a negative one takes 10)."""
    size = np.ones(len(x), np.int64)
    for k in range(1, 9):
        size += x >= (1 << (7 * k))
    size[x < 0] = 10
    return size


def _text_sizes(texts: Sequence[str]) -> np.ndarray:
    """UTF-8 bytes of each text."""
    return np.fromiter((len(t.encode()) if t else 0 for t in texts), np.int64, len(texts))


def _least_size(
    user_bytes: list[bytes],
    items: Sequence[str],
    sessions: Sequence[str],
    event_ids: Sequence[str],
    ts: np.ndarray,
    action: np.ndarray,
    value: np.ndarray,
) -> np.ndarray:
    """Bytes of the shortest wire form of each Event holding these values (fields left at
    their default are not sent; an optional id that reads "" is taken as unset)."""

    def text(size: np.ndarray) -> np.ndarray:
        return np.where(size > 0, 1 + _varint_size(size) + size, 0)

    n = len(user_bytes)
    total = text(np.fromiter(map(len, user_bytes), np.int64, n)) + text(_text_sizes(items))
    total += text(_text_sizes(sessions)) + text(_text_sizes(event_ids))
    total += np.where(ts != 0, 1 + _varint_size(ts), 0)
    total += np.where(action != 0, 1 + _varint_size(action), 0)
    total += np.where(value != 0, 5, 0)  # a float32; -0.0 counted as absent: never more
    return total


def _doubted(
    users: list[str],
    user_bytes: list[bytes],
    items: list[str],
    sessions: list[str | None],
    event_ids: list[str | None],
    keys: list[bytes | None],
    ts: np.ndarray,
    action: np.ndarray,
    value: np.ndarray,
    now_ms: int,
    limits: Limits,
) -> np.ndarray:
    """Rows that some rule of ``validate_record`` may reject (a superset: a long id is
    doubted by its characters, the reference counts its bytes)."""
    n = len(users)
    user_len = np.fromiter(map(len, users), np.int64, n)
    item_len = np.fromiter(map(len, items), np.int64, n)
    short = limits.max_field_bytes // 4  # at most short characters: at most limit bytes
    doubt = (user_len == 0) | (item_len == 0) | (ts <= 0)
    doubt |= (user_len > short) | (item_len > short)
    for ids in (sessions, event_ids):
        doubt |= np.fromiter((len(s) > short if s else False for s in ids), bool, n)
    doubt |= ~np.fromiter(map(operator.eq, user_bytes, keys), bool, n)
    doubt |= (action < 0) | (action > len(ACTIONS))
    doubt |= ~np.isfinite(value)
    doubt |= ts < limits.min_ts_ms
    if limits.max_past_ms > 0:
        doubt |= ts < now_ms - limits.max_past_ms
    if limits.max_future_ms > 0:
        doubt |= ts > now_ms + limits.max_future_ms
    return doubt
