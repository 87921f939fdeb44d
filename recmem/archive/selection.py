"""NoteBank write-side math (SPEC section 5), pure functions on numpy arrays.

A closed chunk of n events with per-channel keys k [n, C_ch, K] gives each event a
distinctiveness d[t, c] = 1 - cos(k[t, c], mean of the chunk's keys of channel c); the sum
over channels scores the event; sliding windows of w events pick where spans go; each span
is grown around its window's most distinctive event. Nothing here knows about users,
FAISS or persistence.
"""

from __future__ import annotations

import numpy as np

NORM_EPS = 1e-12


def address_coords(key_dim: int, address_dim: int, seed: int) -> np.ndarray:
    """P: a fixed random selection of ``address_dim`` of the ``key_dim`` coordinates (sorted
    int64 indices). The same (key_dim, address_dim, seed) always gives the same P."""
    if not 1 <= address_dim <= key_dim:
        raise ValueError(f"address_dim must be in 1..key_dim={key_dim}, got {address_dim}")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(key_dim, size=address_dim, replace=False)).astype(np.int64)


def l2_normalise(x: np.ndarray) -> np.ndarray:
    """Unit vectors along the last axis (computed in x's own dtype, returned as float32);
    all-zero vectors stay zero. Zero rows are never divided: in float16 (the pending
    chunk's storage) NORM_EPS rounds to 0, and a zero row's 0 / 0 raised a RuntimeWarning."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    keep = norm > NORM_EPS
    out = np.divide(x, norm, out=np.zeros_like(x), where=keep)
    return out.astype(np.float32)


def distinctiveness(k: np.ndarray) -> np.ndarray:
    """d[t, c] = 1 - cos(k[t, c], mean over t of the unit keys of channel c), k [n, C_ch, K]
    (or [m, n, C_ch, K]: m chunks at once -> [m, n, C_ch]).

    An all-zero key carries no evidence and gets d = 0 (not 1), so it never attracts a span.
    """
    if k.ndim not in (3, 4):
        raise ValueError(f"keys must be [n, channels, K] or [m, n, channels, K], got {k.shape}")
    k32 = k.astype(np.float32, copy=False)  # float16 arithmetic is slow on CPUs
    unit = l2_normalise(k32)
    centre = l2_normalise(unit.mean(axis=-3))
    cos = np.einsum("...tck,...ck->...tc", unit, centre)
    zero = np.linalg.norm(k32, axis=-1) <= NORM_EPS
    return np.where(zero, 0.0, 1.0 - cos).astype(np.float32)


def session_ids(ts_ms: np.ndarray, gap_ms: float) -> np.ndarray:
    """Session index of each event: a new session starts after a gap > gap_ms (0 disables)."""
    n = len(ts_ms)
    if n == 0 or gap_ms <= 0:
        return np.zeros(n, dtype=np.int64)
    breaks = np.diff(ts_ms.astype(np.float64)) > float(gap_ms)
    return np.concatenate([[0], np.cumsum(breaks)]).astype(np.int64)


def _check_span_args(window: int, n_spans: int, max_span: int) -> None:
    if window < 1 or n_spans < 1 or max_span < 1:
        raise ValueError("window, n_spans and max_span must all be >= 1")


def select_spans(
    scores: np.ndarray,
    ts_ms: np.ndarray,
    *,
    window: int,
    n_spans: int,
    max_span: int,
    gap_ms: float,
) -> list[tuple[int, int]]:
    """Up to ``n_spans`` non-overlapping spans [start, end) of at most ``max_span`` events.

    Repeat: take the free window (w consecutive events, none already in a span) with the
    highest summed score (the earliest on ties); seed the span at that window's most
    distinctive event; grow it one event at a time towards the neighbour with the higher
    score (left on ties) while it is shorter than ``max_span``, the neighbour is free and in
    the seed's session. Stops early when no free window is left. Returned sorted by start.
    """
    n = len(scores)
    if len(ts_ms) != n:
        raise ValueError(f"scores ({n}) and ts_ms ({len(ts_ms)}) differ in length")
    _check_span_args(window, n_spans, max_span)
    if n == 0:
        return []
    s = scores.astype(np.float64)
    w = min(window, n)
    session = session_ids(ts_ms, gap_ms)
    taken = np.zeros(n, dtype=bool)
    window_sum = np.convolve(s, np.ones(w), mode="valid")
    spans: list[tuple[int, int]] = []
    for _ in range(n_spans):
        busy = np.convolve(taken.astype(np.int64), np.ones(w, dtype=np.int64), mode="valid")
        free = np.flatnonzero(busy == 0)
        if len(free) == 0:
            break
        j = int(free[np.argmax(window_sum[free])])
        seed = j + int(np.argmax(s[j : j + w]))
        start, end = seed, seed + 1

        def ok(t: int, sess: int = int(session[seed])) -> bool:
            return 0 <= t < n and not taken[t] and session[t] == sess

        while end - start < max_span:
            left, right = start - 1, end
            can_l, can_r = ok(left), ok(right)
            if not (can_l or can_r):
                break
            if can_l and (not can_r or s[left] >= s[right]):
                start = left
            else:
                end = right + 1
        taken[start:end] = True
        spans.append((start, end))
    return sorted(spans)


def most_distinctive(d: np.ndarray, start: int, end: int) -> np.ndarray:
    """t*[c]: the chunk index of channel c's most distinctive event in [start, end)
    (the earliest on ties), d [n, C_ch]."""
    return start + np.argmax(d[start:end], axis=0).astype(np.int64)


def span_addresses(d: np.ndarray, u: np.ndarray, start: int, end: int) -> np.ndarray:
    """The note's addresses [C_ch, d_rho]: rho_c = P q at t*[c], L2-normalised. ``u`` holds
    the already-projected queries P q of the chunk, [n, C_ch, d_rho]."""
    t_star = most_distinctive(d, start, end)
    rho = u[t_star, np.arange(u.shape[1])]
    return l2_normalise(rho)


def select_spans_many(
    scores: np.ndarray,
    ts_ms: np.ndarray,
    *,
    window: int,
    n_spans: int,
    max_span: int,
    gap_ms: float,
) -> list[list[tuple[int, int]]]:
    """``select_spans`` for m chunks of n events at once, scores and ts_ms [m, n]: the
    window sums and sessions of every chunk in one pass, then the greedy choice per chunk
    on plain lists (a chunk is a few dozen events: numpy's per-call cost would dominate).
    The same spans as ``select_spans`` on each row (tests/recmem/test_archive_selection.py)."""
    m, n = scores.shape
    if ts_ms.shape != scores.shape:
        raise ValueError(f"scores {scores.shape} and ts_ms {ts_ms.shape} differ in shape")
    _check_span_args(window, n_spans, max_span)
    if n == 0:
        return [[] for _ in range(m)]
    s = scores.astype(np.float64)
    w = min(window, n)
    sums = np.lib.stride_tricks.sliding_window_view(s, w, axis=1).sum(axis=-1).tolist()
    if gap_ms > 0:
        breaks = np.diff(ts_ms.astype(np.float64), axis=1) > float(gap_ms)
        session = np.concatenate([np.zeros((m, 1), np.int64), np.cumsum(breaks, 1)], 1).tolist()
    else:
        session = [[0] * n] * m
    out = []
    for s_row, sum_row, sess in zip(s.tolist(), sums, session):
        taken = [False] * n
        spans: list[tuple[int, int]] = []
        for _ in range(n_spans):
            j = -1
            for i in range(n - w + 1):  # the best free window, the earliest on ties
                if (j < 0 or sum_row[i] > sum_row[j]) and not any(taken[i : i + w]):
                    j = i
            if j < 0:
                break
            seg = s_row[j : j + w]
            seed = j + seg.index(max(seg))
            start, end, here = seed, seed + 1, sess[seed]
            while end - start < max_span:
                left, right = start - 1, end
                can_l = left >= 0 and not taken[left] and sess[left] == here
                can_r = right < n and not taken[right] and sess[right] == here
                if not (can_l or can_r):
                    break
                if can_l and (not can_r or s_row[left] >= s_row[right]):
                    start = left
                else:
                    end = right + 1
            taken[start:end] = [True] * (end - start)
            spans.append((start, end))
        out.append(sorted(spans))
    return out


def span_addresses_many(
    d: np.ndarray, u: np.ndarray, chunk: np.ndarray, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """``span_addresses`` of many notes at once: note i spans events start[i] .. end[i] - 1
    of chunk chunk[i]; d [m, n, C_ch], u [m, n, C_ch, d_rho] -> [notes, C_ch, d_rho]."""
    t = np.arange(d.shape[1])
    inside = (t[None, :] >= start[:, None]) & (t[None, :] < end[:, None])  # [notes, n]
    masked = np.where(inside[:, :, None], d[chunk], -np.inf)
    t_star = np.argmax(masked, axis=1)  # [notes, C_ch], the earliest on ties
    rho = u[chunk[:, None], t_star, np.arange(d.shape[2])[None, :]]
    return l2_normalise(rho)
