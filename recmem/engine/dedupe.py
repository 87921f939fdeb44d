"""The duplicate-event policy: an event whose key equals that of one of its user's last
``window`` accepted events is dropped before it reaches the memory, and counted.

The key is the producer's ``event_id`` when the event has one, else (item, ts_ms, action)
(the user is implicit: keys are kept per user). Duplicates come from delivery, not from
users: a producer that retries a send whose acknowledgement it lost, a source system
replaying a batch, a record produced twice. Kafka hands them over as different records at
different offsets, so the offsets cannot tell; an exact copy of a recent event can. The
window bounds memory (8 bytes per key) and says what "recent" means: a copy arriving after
``window`` newer events of the same user is applied again. A crash replay is not affected:
events after the restored checkpoint were never accepted by the restored state, and the
keys are part of that checkpoint (arrays ``seen.*``). Owned by the engine (one thread).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

PREFIX = "seen."


class SeenEvents:
    """Each user's last ``window`` accepted event keys (0: the policy is off)."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError("the duplicate window must be >= 0")
        self.window = window
        self._keys: dict[str, deque[int]] = {}
        self._sets: dict[str, set[int]] = {}
        """The same keys as sets, for the membership test."""
        self.dropped = 0
        """Duplicates dropped so far."""

    def keep(self, user_ids: Sequence[str], keys: np.ndarray) -> np.ndarray:
        """Indices of the events (``user_ids[i]``, ``keys[i]``: streams.batch.event_key) that
        are not duplicates (of the user's recent events or of an earlier one in the batch),
        in order; their keys become the users' recent keys."""
        if self.window == 0:
            return np.arange(len(user_ids))
        kept = []
        window = self.window
        keys_of, sets = self._keys, self._sets
        for i, (user, k) in enumerate(zip(user_ids, keys.tolist())):
            recent = keys_of.get(user)
            if recent is None:
                recent = keys_of[user] = deque()
                sets[user] = set()
            known = sets[user]
            if k in known:
                self.dropped += 1
                continue
            recent.append(k)
            known.add(k)
            if len(recent) > window:
                known.discard(recent.popleft())
            kept.append(i)
        return np.asarray(kept, dtype=np.int64)

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        if self.window == 0:
            return {}
        keys = [list(self._keys.get(u, ())) for u in user_ids]
        return {
            PREFIX + "lengths": np.array([len(k) for k in keys], dtype=np.int64),
            PREFIX + "keys": np.array([x for k in keys for x in k], dtype=np.int64),
        }

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        self.drop(user_ids)
        lengths = arrays.get(PREFIX + "lengths")
        if lengths is None or self.window == 0:
            return
        if len(lengths) != len(user_ids):
            raise ValueError(
                f"checkpoint has seen keys of {len(lengths)} users, {len(user_ids)} restored"
            )
        keys = arrays[PREFIX + "keys"]
        ends = np.cumsum(lengths)
        for user, s, e in zip(user_ids, ends - lengths, ends):
            if e > s:
                kept = [int(x) for x in keys[s:e]][-self.window :]
                self._keys[user] = deque(kept)
                self._sets[user] = set(kept)

    def drop(self, user_ids: Sequence[str]) -> None:
        for user in user_ids:
            self._keys.pop(user, None)
            self._sets.pop(user, None)
