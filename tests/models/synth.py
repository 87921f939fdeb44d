"""Small learnable event sequences for the model tests (each user walks a cycle of items
with a user-specific stride, so the next item is predictable from the history)."""

from __future__ import annotations

import numpy as np

from models.sequences import EventSeqs


def cyclic_seqs(
    n_users: int = 24, n_items: int = 30, max_len: int = 40, seed: int = 0
) -> EventSeqs:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, max_len + 1, size=n_users)
    items, actions, ts = [], [], []
    for u in range(n_users):
        stride = 1 + u % 3
        start = rng.integers(0, n_items)
        items.append((start + stride * np.arange(lengths[u])) % n_items)
        actions.append(rng.integers(0, 6, size=lengths[u]))
        ts.append(1_000_000 + np.cumsum(rng.integers(0, 5_000_000, size=lengths[u])))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    return EventSeqs(
        user_ids=[f"u{u}" for u in range(n_users)],
        offsets=offsets,
        items=np.concatenate(items).astype(np.int64),
        actions=np.concatenate(actions).astype(np.int64),
        ts_ms=np.concatenate(ts).astype(np.int64),
        part=np.zeros(n, dtype=np.int8),
        global_idx=np.arange(n, dtype=np.int64),
    )
