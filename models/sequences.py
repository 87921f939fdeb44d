"""Event sequences of many users in one compressed (CSR) layout: the input of training,
evaluation and the engine's batch builder. Pure arrays; no files, no Kafka."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.actions import ACTIONS

__all__ = ["ACTIONS", "EventSeqs"]
# ACTIONS: the action vocabulary; index = position in the tuple, read from the wire
# format's Action enum (SPEC section 2 order).


@dataclass
class EventSeqs:
    """Events grouped by user, each user's events in global time order.

    User u's events are rows offsets[u] : offsets[u + 1] of the per-event arrays.
    items: encoded item index (see recmem.vocab.ItemVocab; OOV items map to hashed buckets
    at index >= n_items); actions: index into ACTIONS; ts_ms: event time in ms;
    part: 0 TRAIN, 1 VALID, 2 TEST (all 0 outside evaluation);
    global_idx: the event's index in the global (ts, user, item) order.
    """

    user_ids: list[str]
    offsets: np.ndarray
    items: np.ndarray
    actions: np.ndarray
    ts_ms: np.ndarray
    part: np.ndarray
    global_idx: np.ndarray

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    @property
    def n_events(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def user_of_event(self) -> np.ndarray:
        """[n_events] the user row of each event."""
        return np.repeat(np.arange(self.n_users), self.lengths())

    def position_in_user(self) -> np.ndarray:
        """[n_events] 1-based position of each event in its user's sequence."""
        starts = np.repeat(self.offsets[:-1], self.lengths())
        return np.arange(self.n_events) - starts + 1
