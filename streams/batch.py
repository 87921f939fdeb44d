"""A micro-batch of validated events as columns (:class:`EventBatch`), and the duplicate key
of an event (:func:`event_key`).

The consumer hands its sink a list of :class:`~streams.validate.ValidEvent`. Consumer
processes (streams/processes.py) send their batches over a pipe as an EventBatch instead:
columns cross a process boundary cheaply, and the per-event Python that the engine would
otherwise run (building event objects, hashing duplicate keys) runs in the consumer's
process. The engine takes either form (``recmem.engine.Engine.plan``) and gives the same
result.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from streams.validate import ValidEvent

_FIELDS = tuple(f.name for f in fields(ValidEvent))
_ROW = operator.attrgetter(*_FIELDS)


def key_of(item_id: str, ts_ms: int, action: int, event_id: str | None) -> int:
    """A stable 63-bit duplicate key (the same in every process): the producer's event id
    when it set one, else (item, ts_ms, action); keys are kept per user."""
    text = f"id\x00{event_id}" if event_id else f"ev\x00{item_id}\x00{ts_ms}\x00{action}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def keys_of(
    item_id: Sequence[str],
    ts_ms: np.ndarray,
    action: np.ndarray,
    event_id: Sequence[str | None],
) -> np.ndarray:
    """:func:`key_of` of every event of the columns, as int64: the same texts hashed the
    same way, the digests read together by numpy instead of one ``int.from_bytes`` each
    (hashlib hashes one message per call, so that stays one call per event)."""
    n = len(item_id)
    if n == 0:
        return np.zeros(0, np.int64)
    blake2b = hashlib.blake2b
    texts = [
        f"id\x00{e}" if e else f"ev\x00{i}\x00{t}\x00{a}"
        for i, t, a, e in zip(item_id, ts_ms.tolist(), action.tolist(), event_id)
    ]
    digests = b"".join([blake2b(t.encode(), digest_size=8).digest() for t in texts])
    return (np.frombuffer(digests, "<u8") >> np.uint64(1)).astype(np.int64)


def event_key(e: ValidEvent) -> int:
    """:func:`key_of` of ``e``."""
    return key_of(e.item_id, e.ts_ms, e.action, e.event_id)


@dataclass(frozen=True)
class EventBatch:
    """Validated events as equal-length columns, in the consumer's order (partition order,
    each partition's events in offset order). ``key``: each event's :func:`event_key`."""

    user_id: list[str]
    item_id: list[str]
    ts_ms: np.ndarray
    """int64"""
    action: np.ndarray
    """int64, index into proto.actions.ACTIONS"""
    value: np.ndarray
    """float64"""
    session_id: list[str | None]
    partition: np.ndarray
    """int64"""
    offset: np.ndarray
    """int64"""
    event_id: list[str | None]
    key: np.ndarray
    """int64"""

    @classmethod
    def of(cls, events: Sequence[ValidEvent]) -> EventBatch:
        """The batch of ``events`` (their duplicate keys computed here)."""
        if not events:
            z = np.zeros(0, np.int64)
            return cls([], [], z, z, z.astype(np.float64), [], z, z, [], z)
        cols = list(map(list, zip(*map(_ROW, events))))
        user, item, ts, action, value, session, part, offset, event_id = cols
        keys = np.fromiter(map(key_of, item, ts, action, event_id), np.int64, len(events))
        return cls(
            user, item, np.asarray(ts, np.int64), np.asarray(action, np.int64),
            np.asarray(value, np.float64), session, np.asarray(part, np.int64),
            np.asarray(offset, np.int64), event_id, keys,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.user_id)

    def events(self) -> list[ValidEvent]:
        """The events as objects (for sinks that want them)."""
        return list(
            map(
                ValidEvent,
                self.user_id,
                self.item_id,
                self.ts_ms.tolist(),
                self.action.tolist(),
                self.value.tolist(),
                self.session_id,
                self.partition.tolist(),
                self.offset.tolist(),
                self.event_id,
            )
        )

    def take(self, rows: np.ndarray) -> EventBatch:
        """The events at ``rows`` (indices, in that order)."""
        idx = rows.tolist()

        def pick(xs: list) -> list:  # type: ignore[type-arg]
            return [xs[i] for i in idx]

        return EventBatch(
            pick(self.user_id), pick(self.item_id), self.ts_ms[rows], self.action[rows],
            self.value[rows], pick(self.session_id), self.partition[rows], self.offset[rows],
            pick(self.event_id), self.key[rows],
        )  # fmt: skip
