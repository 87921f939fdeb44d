"""Synthetic interaction logs with known structure (issue 3, "Synthetic data").

Each user has a few stable long-term interest categories. Their history is a sequence of
short sessions; a session's intent is one category, drawn from the user's long-term
interests with probability ``p_long_term`` and otherwise uniformly (a passing, recent
intent). Items of a session come from its category (power-law popularity inside the
category). With probability ``p_recall`` an event (past ``recall_gap`` events into the
user's history) is instead a RECALL: the user returns to an item it saw more than
``recall_gap`` events earlier.

The planted truth comes back with the data, aligned with the sorted events: ``is_recall``,
``long_term_session`` (the event's session intent was a long-term interest) and
``session_category``, plus ``user_interests`` [n_users, interests_per_user] (category
indices, user i = ``"u{i}"``). Generation works on chunks of users with numpy, so sizes up
to ~10M events fit in a few GB; the same seed gives the same data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import polars as pl

    from recmem.datasets import Dataset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyntheticSpec:
    n_users: int = 2000
    n_events: int = 200_000
    n_categories: int = 200
    items_per_category: int = 100
    interests_per_user: int = 5
    mean_session_len: float = 2.5
    p_long_term: float = 0.5
    p_recall: float = 0.05
    recall_gap: int = 50
    popularity_power: float = 2.0
    """Item rank inside a category = floor(items_per_category * U**power): higher power,
    more skew."""
    seed: int = 0
    chunk_events: int = 1_000_000


def _user_lengths(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    """Events per user: log-normal weights, at least 2 each, summing exactly to n_events."""
    if spec.n_events < 2 * spec.n_users:
        raise ValueError(f"synthetic: n_events {spec.n_events} < 2 x n_users {spec.n_users}")
    w = rng.lognormal(0.0, 1.0, size=spec.n_users)
    extra = rng.multinomial(spec.n_events - 2 * spec.n_users, w / w.sum())
    return (extra + 2).astype(np.int64)


def _chunk(
    spec: SyntheticSpec,
    rng: np.random.Generator,
    users: np.ndarray,
    lengths: np.ndarray,
    interests: np.ndarray,
) -> dict[str, np.ndarray]:
    n = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    user = np.repeat(users, lengths)
    pos = np.arange(n) - np.repeat(starts, lengths)
    new_session = (pos == 0) | (rng.random(n) < 1.0 / spec.mean_session_len)
    session = np.cumsum(new_session) - 1
    n_sessions = int(session[-1]) + 1 if n else 0
    s_user = user[new_session]
    s_long = rng.random(n_sessions) < spec.p_long_term
    s_pick = interests[s_user, rng.integers(0, spec.interests_per_user, n_sessions)]
    s_cat = np.where(s_long, s_pick, rng.integers(0, spec.n_categories, n_sessions))
    cat = s_cat[session]
    rank = np.floor(spec.items_per_category * rng.random(n) ** spec.popularity_power)
    item = cat * spec.items_per_category + rank.astype(np.int64)
    recall = (pos > spec.recall_gap) & (rng.random(n) < spec.p_recall)
    idx = np.flatnonzero(recall)
    # source: uniform over the user's events more than recall_gap events back
    src = np.repeat(starts, lengths)[idx] + rng.integers(0, pos[idx] - spec.recall_gap)
    for _ in range(16):  # a source may itself be a recall: follow the chain
        item[idx] = item[src]
    # time: users start at random points; sessions hours to days apart, events minutes
    gap_s = np.where(new_session, rng.exponential(2 * 86400.0, n), rng.exponential(120.0, n))
    t0 = rng.uniform(0.0, 180 * 86400.0, len(users))
    cum = np.cumsum(gap_s)
    cum -= np.repeat(cum[starts], lengths)
    ts_ms = (1_600_000_000_000 + 1000.0 * (np.repeat(t0, lengths) + cum)).astype(np.int64)
    return {
        "user": user,
        "item": item,
        "ts_ms": ts_ms,
        "category": item // spec.items_per_category,
        "is_recall": recall,
        "long_term_session": s_long[session],
        "session_category": cat,
    }


def generate_frame(spec: SyntheticSpec) -> tuple[pl.DataFrame, np.ndarray]:
    """Events with the planted columns (unsorted) and the users' interest categories."""
    import polars as pl
    from tqdm import tqdm

    rng = np.random.default_rng(spec.seed)
    lengths = _user_lengths(spec, rng)
    k = spec.interests_per_user
    if k > spec.n_categories:
        raise ValueError("synthetic: interests_per_user > n_categories")
    interests = np.argsort(rng.random((spec.n_users, spec.n_categories)), axis=1)[:, :k]
    bounds = np.searchsorted(np.cumsum(lengths), np.arange(0, spec.n_events, spec.chunk_events))
    bounds = np.unique(np.r_[bounds, spec.n_users])
    frames = []
    for a, b in tqdm(
        list(zip(bounds[:-1], bounds[1:], strict=True)), desc="synthetic", disable=len(bounds) < 4
    ):
        users = np.arange(a, b)
        c = _chunk(spec, np.random.default_rng([spec.seed, int(a)]), users, lengths[a:b], interests)
        frames.append(
            pl.DataFrame(
                {
                    "user_id": pl.Series(c["user"]).cast(pl.String),
                    "item_id": pl.Series(c["item"]).cast(pl.String),
                    "ts_ms": c["ts_ms"],
                    "category": pl.Series(c["category"]).cast(pl.String),
                    "is_recall": c["is_recall"],
                    "long_term_session": c["long_term_session"],
                    "session_category": c["session_category"].astype(np.int32),
                }
            ).with_columns(
                (pl.lit("u") + pl.col("user_id")).alias("user_id"),
                (pl.lit("i") + pl.col("item_id")).alias("item_id"),
                (pl.lit("c") + pl.col("category")).alias("category"),
                pl.lit("view").alias("action"),
                pl.lit(1.0, dtype=pl.Float32).alias("value"),
            )
        )
    return pl.concat(frames), interests


def generate(spec: SyntheticSpec) -> Dataset:
    """The synthetic :class:`recmem.datasets.Dataset`; ``planted`` holds the truth arrays
    aligned with the sorted events, plus ``user_interests``."""
    from recmem.datasets import Dataset, finish_events, has_repeats

    frame, interests = generate_frame(spec)
    frame = frame.sort(["ts_ms", "user_id", "item_id"], maintain_order=True)
    planted = {
        name: frame[name].to_numpy()
        for name in ("is_recall", "long_term_session", "session_category")
    }
    planted["user_interests"] = interests
    events = finish_events(frame)
    log.info(
        "synthetic: %d users, %d events, %.1f%% recalls",
        spec.n_users,
        events.height,
        100.0 * float(planted["is_recall"].mean()) if events.height else 0.0,
    )
    return Dataset("synthetic", events, None, has_repeats(events), planted=planted)
