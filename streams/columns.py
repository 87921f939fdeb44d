"""A poll's records straight to columns: :func:`decode_records` turns the records of one
poll into an :class:`~streams.batch.EventBatch` (duplicate keys hashed) and the dead
letters of the bad ones, without a :class:`~streams.validate.ValidEvent` per event.

:func:`decode_records_reference` is the plain form and the definition: every record through
:func:`~streams.validate.validate_record`, the valid ones into ``EventBatch.of``. The fast
form must give the same batch and the same dead letters, in the same order
(tests/streams/test_columns.py, on random and malformed records).

How the fast form gets there: per record it only parses the value (upb, in C) and reads the
fields into lists; the checks then run on the whole poll at once with numpy (empty ids,
``ts_ms``, the action's range, a finite value, the time window, the key against the user
id). A record that any check doubts (and every record whose value does not parse, or that
has a long id, a session or an event id set to the empty string) goes through
``validate_record`` itself, so a dead letter's reason and message are always the
reference's; a doubted record that passes there is kept with the reference's fields. Per
event this skips the ValidEvent (a frozen dataclass: about 5 us to build on the 2-core VM),
the per-record checks and the second walk over the events in ``EventBatch.of``
(bench/experiments/README.md, "Member consumer CPU").
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from proto.actions import ACTIONS
from streams.batch import EventBatch, keys_of
from streams.codec import OTHER_INDEX, Event
from streams.validate import DeadLetter, Limits, ValidEvent, validate_record

RawRecord = tuple[int, bytes | None, bytes | None]
"""(offset, key, value) of one consumed record (as streams.consumer_base.RawRecord)."""

_SESSION_TAG = b"\x32"
"""The first byte of a set ``session_id`` (field 6, length-delimited) on the wire."""
_EVENT_ID_TAG = b"\x3a"
"""The first byte of a set ``event_id`` (field 7, length-delimited) on the wire."""


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
    parse = Event.FromString
    users: list[str] = []
    items: list[str] = []
    ts: list[int] = []
    actions: list[int] = []
    values: list[float] = []
    sessions: list[str | None] = []
    event_ids: list[str | None] = []
    partitions: list[int] = []
    offsets: list[int] = []
    keys: list[bytes | None] = []
    raw_values: list[bytes | None] = []
    odd: list[int] = []
    """Rows the per-record pass already doubts (no value, not parsed, an id set to "")."""
    for p in sorted(records):
        for offset, key, value in records[p]:
            row = len(users)
            partitions.append(p)
            offsets.append(offset)
            keys.append(key)
            raw_values.append(value)
            event = None
            wire = b"" if value is None else value
            if value is not None:
                try:
                    event = parse(value)
                except (DecodeError, ValueError, TypeError):  # as validate_record
                    event = None
            if event is None:
                odd.append(row)
                users.append("")
                items.append("")
                ts.append(0)
                actions.append(0)
                values.append(0.0)
                sessions.append(None)
                event_ids.append(None)
                continue
            users.append(event.user_id)
            items.append(event.item_id)
            ts.append(event.ts_ms)
            actions.append(event.action)
            values.append(event.value)
            # an unset optional reads "": only then can presence need asking (an id set
            # to "" still starts with its tag byte on the wire)
            session: str | None = event.session_id or None
            if session is None and _SESSION_TAG in wire and event.HasField("session_id"):
                odd.append(row)
            event_id: str | None = event.event_id or None
            if event_id is None and _EVENT_ID_TAG in wire and event.HasField("event_id"):
                odd.append(row)
            sessions.append(session)
            event_ids.append(event_id)
    n = len(users)
    if n == 0:
        return EventBatch.of([]), []
    ts_a = np.asarray(ts, np.int64)
    action_a = np.asarray(actions, np.int64)
    value_a = np.asarray(values, np.float64)
    doubt = np.zeros(n, bool)
    doubt[odd] = True
    doubt |= _doubted(users, items, sessions, event_ids, keys, ts_a, action_a, value_a,
                      now_ms, limits)  # fmt: skip
    # the wire's enum value -> index into ACTIONS (any other value is doubted)
    action_a = np.where(action_a == 0, OTHER_INDEX, action_a - 1)
    dead: list[DeadLetter] = []
    keep = ~doubt
    for row in np.flatnonzero(doubt).tolist():
        out = validate_record(
            topic, partitions[row], offsets[row], keys[row], raw_values[row], now_ms, limits
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


def _doubted(
    users: list[str],
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
    doubt |= ~np.fromiter(map(operator.eq, map(str.encode, users), keys), bool, n)
    doubt |= (action < 0) | (action > len(ACTIONS))
    doubt |= ~np.isfinite(value)
    doubt |= ts < limits.min_ts_ms
    if limits.max_past_ms > 0:
        doubt |= ts < now_ms - limits.max_past_ms
    if limits.max_future_ms > 0:
        doubt |= ts > now_ms + limits.max_future_ms
    return doubt
