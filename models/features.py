"""Per-event side features of the recommender: action index and bucketised time gap.

Time-gap buckets (``n`` = cfg.model.n_time_buckets, at least 2):

- bucket 0: the user's first event (no previous event);
- buckets 1 .. n-1: log-spaced over the gap g (seconds, clipped at 0) since the user's
  previous event: ``1 + min(n - 2, floor((n - 1) * log1p(g) / log1p(MAX_GAP_S)))`` with
  MAX_GAP_S = 365 days. The lower edge of bucket 1 + i is ``expm1(i * log1p(MAX_GAP_S) /
  (n - 1))`` seconds (``time_gap_edges_s``); the last bucket is open-ended. For n = 16 the
  edges are about 0, 2.2 s, 9 s, 31 s, 1.6 min, 5 min, 17 min, 53 min, 2.8 h, 8.8 h,
  28 h, 3.7 d, 11.5 d, 36.5 d, 115 d. Events with the same timestamp (common in MovieLens) land in
  bucket 1.

The numpy and torch versions compute the same float64 expression and agree exactly.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from models.sequences import ACTIONS

MAX_GAP_S = 365.0 * 24 * 3600
"""Gaps of a year or more share the last bucket."""

N_ACTIONS = len(ACTIONS)


def _check(n_buckets: int) -> None:
    if n_buckets < 2:
        raise ValueError(f"n_time_buckets must be >= 2, got {n_buckets}")


def time_gap_edges_s(n_buckets: int) -> np.ndarray:
    """Lower edges (seconds) of buckets 1 .. n-1."""
    _check(n_buckets)
    i = np.arange(n_buckets - 1, dtype=np.float64)
    return np.expm1(i * math.log1p(MAX_GAP_S) / (n_buckets - 1))


def time_gap_buckets_np(ts_ms: np.ndarray, prev_ts_ms: np.ndarray, n_buckets: int) -> np.ndarray:
    """Bucket of each event's gap; ``prev_ts_ms < 0`` marks "no previous event" (bucket 0)."""
    _check(n_buckets)
    ts = np.asarray(ts_ms, dtype=np.int64)
    prev = np.asarray(prev_ts_ms, dtype=np.int64)
    gap_s = np.maximum(ts - prev, 0).astype(np.float64) / 1000.0
    b = np.floor((n_buckets - 1) * np.log1p(gap_s) / math.log1p(MAX_GAP_S)).astype(np.int64)
    b = 1 + np.minimum(b, n_buckets - 2)
    return np.where(prev < 0, 0, b)


def time_gap_buckets(ts_ms: torch.Tensor, prev_ts_ms: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Torch twin of ``time_gap_buckets_np`` (any shape, int64 in, int64 out)."""
    _check(n_buckets)
    gap_s = torch.clamp(ts_ms - prev_ts_ms, min=0).to(torch.float64) / 1000.0
    scaled = (n_buckets - 1) * torch.log1p(gap_s) / math.log1p(MAX_GAP_S)
    b = 1 + torch.clamp(torch.floor(scaled).to(torch.int64), max=n_buckets - 2)
    return torch.where(prev_ts_ms < 0, torch.zeros_like(b), b)


def previous_ts(ts_ms: torch.Tensor, last_ts: torch.Tensor) -> torch.Tensor:
    """[B, T] timestamp of each event's predecessor: ``last_ts`` (state, -1 if none) for the
    first column, the previous column otherwise."""
    return torch.cat([last_ts[:, None], ts_ms[:, :-1]], dim=1)


def seq_time_gap_buckets_np(ts_ms: np.ndarray, offsets: np.ndarray, n_buckets: int) -> np.ndarray:
    """Buckets for CSR event arrays (see models.sequences.EventSeqs): each user's first event
    gets bucket 0."""
    ts = np.asarray(ts_ms, dtype=np.int64)
    prev = np.concatenate([[-1], ts[:-1]]).astype(np.int64)
    starts = np.asarray(offsets[:-1])
    starts = starts[starts < len(ts)]
    prev[starts] = -1
    return time_gap_buckets_np(ts, prev, n_buckets)


def action_index(names: list[str]) -> np.ndarray:
    """Action names -> indices into ACTIONS; unknown names map to 'other'."""
    lookup = {a: i for i, a in enumerate(ACTIONS)}
    other = lookup["other"]
    return np.fromiter((lookup.get(n, other) for n in names), dtype=np.int64, count=len(names))
