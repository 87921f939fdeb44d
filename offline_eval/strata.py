"""Strata of evaluation targets (SPEC section 7) and event-position buckets.

An item's category key is its whole category set (one key for 'Animation|Children's|Comedy').
For a target at event row r of a user, with the user's earlier events r' < r:
- RECENT: the target's key occurs among the user's last ``recent_window`` events before r;
- LONG_TERM: it does not occur there but occurs earlier;
- NEW: it never occurred before;
- REPEAT (only on datasets with repeats; overlaps the three above): the target item itself
  was last seen more than ``repeat_gap`` events before r (gap counted in the user's events:
  r - r_last > repeat_gap).

Everything is computed for all events at once with one sort per key (no per-target loop).
"""

from __future__ import annotations

import numpy as np

from models.sequences import EventSeqs

STRATA = ("recent", "long_term", "new", "repeat")
POSITION_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 10),
    (11, 50),
    (51, 200),
    (201, 500),
    (501, None),
)
"""Buckets of the target's 1-based position in its user's sequence (inclusive bounds)."""


def previous_same(user: np.ndarray, key: np.ndarray) -> np.ndarray:
    """[n] for each event row, the largest earlier row of the same user with the same key,
    or -1. Rows must be grouped by user in time order (EventSeqs layout)."""
    n = user.shape[0]
    rows = np.arange(n)
    order = np.lexsort((rows, key, user))
    prev = np.full(n, -1, dtype=np.int64)
    if n > 1:
        same = (user[order[1:]] == user[order[:-1]]) & (key[order[1:]] == key[order[:-1]])
        prev[order[1:][same]] = order[:-1][same]
    return prev


def gap_to_previous(seqs: EventSeqs, key: np.ndarray) -> np.ndarray:
    """[n_events] events between each row and the last earlier row of the same user with the
    same key (1 = the immediately preceding event), or -1 when there is none."""
    prev = previous_same(seqs.user_of_event(), key)
    return np.where(prev >= 0, np.arange(prev.shape[0]) - prev, -1)


def assign_strata(
    seqs: EventSeqs,
    event_cat: np.ndarray,
    rows: np.ndarray,
    *,
    recent_window: int = 20,
    repeat_gap: int = 50,
    with_repeat: bool = True,
) -> dict[str, np.ndarray]:
    """Boolean masks over ``rows`` (target event rows) for each stratum in STRATA.
    Without ``with_repeat`` the REPEAT mask is all False (datasets without repeats)."""
    cat_gap = gap_to_previous(seqs, event_cat)[rows]
    recent = (cat_gap >= 1) & (cat_gap <= recent_window)
    new = cat_gap < 0
    masks = {"recent": recent, "long_term": ~recent & ~new, "new": new}
    if with_repeat:
        item_gap = gap_to_previous(seqs, seqs.items)[rows]
        masks["repeat"] = item_gap > repeat_gap
    else:
        masks["repeat"] = np.zeros(rows.shape[0], dtype=bool)
    return masks


def position_bucket_labels() -> list[str]:
    return [f"{lo}-{hi}" if hi is not None else f"{lo}+" for lo, hi in POSITION_BUCKETS]


def position_buckets(positions: np.ndarray) -> np.ndarray:
    """[n] index into POSITION_BUCKETS of each 1-based position."""
    uppers = np.array([lo for lo, _ in POSITION_BUCKETS[1:]])
    return np.searchsorted(uppers, positions, side="right")
