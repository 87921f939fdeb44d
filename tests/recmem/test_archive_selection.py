import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmem.archive.selection import (
    address_coords,
    distinctiveness,
    l2_normalise,
    most_distinctive,
    select_spans,
    select_spans_many,
    session_ids,
    span_addresses,
    span_addresses_many,
)


def _keys(n: int, channels: int, dim: int, planted: list[int], seed: int = 0) -> np.ndarray:
    """Near-identical keys per channel, except random keys at the planted events."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(1, channels, dim))
    k = base + 0.01 * rng.normal(size=(n, channels, dim))
    k[planted] = rng.normal(size=(len(planted), channels, dim))
    return l2_normalise(k)


def test_distinctiveness_marks_planted_events_and_ignores_zero_keys():
    k = _keys(32, 3, 16, planted=[7, 20])
    k[3] = 0.0
    d = distinctiveness(k)
    assert d.shape == (32, 3)
    total = d.sum(axis=1)
    assert set(np.argsort(total)[-2:]) == {7, 20}
    assert np.all(d[3] == 0.0)
    ordinary = np.delete(total, [3, 7, 20])
    assert ordinary.max() < 0.1 < total[[7, 20]].min()


def test_planted_distinctive_span_is_chosen_first():
    scores = np.zeros(32)
    scores[12:15] = [3.0, 5.0, 4.0]
    spans = select_spans(scores, np.arange(32), window=4, n_spans=1, max_span=3, gap_ms=0)
    assert spans == [(12, 15)]


def test_spans_respect_max_span_non_overlap_and_limit():
    rng = np.random.default_rng(1)
    scores = rng.random(32)
    spans = select_spans(scores, np.arange(32), window=4, n_spans=3, max_span=6, gap_ms=0)
    assert len(spans) == 3
    covered = np.zeros(32, dtype=int)
    for a, b in spans:
        assert 1 <= b - a <= 6
        covered[a:b] += 1
    assert covered.max() == 1
    assert spans == sorted(spans)


def test_span_count_limited_by_free_windows():
    scores = np.arange(8, dtype=float)
    spans = select_spans(scores, np.arange(8), window=4, n_spans=5, max_span=4, gap_ms=0)
    assert spans == [(0, 4), (4, 8)]


def test_session_gap_bounds_span():
    scores = np.ones(16)
    scores[8] = 10.0
    scores[9:] = 2.0  # would pull the span right, but the gap stops it
    ts = np.arange(16) * 1000
    ts[9:] += 10_000_000  # a long gap between events 8 and 9
    spans = select_spans(scores, ts, window=2, n_spans=1, max_span=6, gap_ms=3_600_000)
    a, b = spans[0]
    assert b == 9 and b - a == 6
    no_gap = select_spans(scores, ts, window=2, n_spans=1, max_span=6, gap_ms=0)
    assert no_gap[0][1] > 9


def test_span_grows_towards_higher_scores():
    scores = np.array([0, 0, 0, 5, 1, 2, 0, 0], dtype=float)
    spans = select_spans(scores, np.arange(8), window=1, n_spans=1, max_span=4, gap_ms=0)
    assert spans == [(2, 6)]  # right twice (1, 2 beat 0), then left on the 0-0 tie


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40),
    st.lists(st.integers(0, 5000), min_size=40, max_size=40),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 9),
)
def test_span_invariants(scores, gaps, window, n_spans, max_span):
    n = len(scores)
    ts = np.cumsum(np.array(gaps[:n]))
    spans = select_spans(
        np.array(scores), ts, window=window, n_spans=n_spans, max_span=max_span, gap_ms=2500
    )
    sess = session_ids(ts, 2500)
    assert 1 <= len(spans) <= n_spans
    covered = np.zeros(n, dtype=int)
    for a, b in spans:
        assert 0 <= a < b <= n and b - a <= max_span
        assert len(set(sess[a:b].tolist())) == 1
        covered[a:b] += 1
    assert covered.max() <= 1


def test_address_coords_fixed_by_seed():
    p = address_coords(64, 32, seed=7)
    assert np.array_equal(p, address_coords(64, 32, seed=7))
    assert not np.array_equal(p, address_coords(64, 32, seed=8))
    assert len(set(p.tolist())) == 32 and p.min() >= 0 and p.max() < 64
    assert np.all(np.diff(p) > 0)
    with pytest.raises(ValueError, match="address_dim"):
        address_coords(16, 32, seed=0)


def test_span_address_is_projected_query_at_most_distinctive_event():
    rng = np.random.default_rng(3)
    d = rng.random((10, 4))
    u = rng.normal(size=(10, 4, 5)).astype(np.float32)
    rho = span_addresses(d, u, 2, 6)
    t_star = most_distinctive(d, 2, 6)
    for c in range(4):
        assert t_star[c] == 2 + np.argmax(d[2:6, c])
        expected = u[t_star[c], c] / np.linalg.norm(u[t_star[c], c])
        np.testing.assert_allclose(rho[c], expected, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 40),
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 9),
    st.booleans(),
)
def test_select_spans_many_equals_select_spans_per_chunk(
    m, n, seed, window, n_spans, max_span, ties
):
    """The batched span choice (the NoteBank's write path) against its plain twin."""
    rng = np.random.default_rng(seed)
    scores = rng.random((m, n)).astype(np.float32)
    if ties:  # few distinct values: ties everywhere, the earliest must win in both
        scores = np.round(scores * 3) / 3
    ts = np.cumsum(rng.integers(0, 5000, (m, n)), axis=1)
    for gap in (0.0, 2500.0):
        kw = dict(window=window, n_spans=n_spans, max_span=max_span, gap_ms=gap)
        many = select_spans_many(scores, ts, **kw)
        assert many == [select_spans(scores[i], ts[i], **kw) for i in range(m)]


def test_batched_distinctiveness_and_addresses_equal_the_per_chunk_ones():
    rng = np.random.default_rng(5)
    k = l2_normalise(rng.normal(size=(7, 32, 4, 16))).astype(np.float16)
    k[2, 5] = 0.0  # a zero key: d = 0
    k[4, :, 1, 8:] = 0.0  # rows locked by the schedule
    u = l2_normalise(rng.normal(size=(7, 32, 4, 8))).astype(np.float16)
    d = distinctiveness(k)
    for i in range(7):
        assert np.array_equal(d[i], distinctiveness(k[i]))
    chunk = np.array([0, 0, 3, 6, 6])
    start, end = np.array([0, 9, 4, 30, 0]), np.array([8, 10, 12, 32, 32])
    rho = span_addresses_many(d, u, chunk, start, end)
    for j in range(5):
        assert np.array_equal(rho[j], span_addresses(d[chunk[j]], u[chunk[j]], start[j], end[j]))


def test_l2_normalise_of_stored_float16_zero_vectors_is_silent_and_zero() -> None:
    """The pending chunk stores float16 (PENDING_DTYPE); a zero vector among them normalises
    to zero without a 0 / 0 (in float16 the epsilon rounds to 0)."""
    x = np.zeros((3, 2, 4), np.float16)
    x[0, 0] = [3.0, 4.0, 0.0, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = l2_normalise(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0, 0], [0.6, 0.8, 0.0, 0.0], rtol=1e-3)
    assert not out[1:].any() and not out[0, 1].any()
