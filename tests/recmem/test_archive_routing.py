import numpy as np
import pytest
import torch

from recmem.archive.index import masked_cosines
from recmem.archive.routing import route_cosines, vote_pick, vote_pick_padded, vote_rank


def _cumsum_cosines(raw: np.ndarray, u: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """masked_cosines as np.cumsum and take_along_axis write it."""
    d = u.shape[-1]
    cum = np.zeros((*u.shape[:-1], d + 1), dtype=np.float32)
    cum[..., 1:] = np.sqrt(np.cumsum(u.astype(np.float32) ** 2, axis=-1))
    idx = np.broadcast_to(np.swapaxes(open_, -1, -2)[..., None, :, :], raw.shape)
    norm = np.take_along_axis(cum, idx, axis=-1)
    return np.where(norm > 1e-6, raw / np.maximum(norm, 1e-6), 0.0).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_masked_cosines_equal_the_cumsum_form_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    W, n, C, N, d = 3, 4, 5, 6, int(rng.choice([1, 7, 32]))
    u = rng.normal(size=(W, n, C, d)).astype(np.float32)
    u[0, 1, 2] = 0.0
    u[1, :, :, : d // 2] = 0.0  # a zero open prefix
    raw = rng.normal(size=(W, n, C, N)).astype(np.float32)
    open_ = rng.integers(0, d + 1, size=(W, N, C))
    assert np.array_equal(masked_cosines(raw, u, open_), _cumsum_cosines(raw, u, open_))
    assert np.array_equal(
        masked_cosines(raw[0], u[0], open_[0]), _cumsum_cosines(raw[0], u[0], open_[0])
    )


@pytest.mark.parametrize("seed", range(8))
def test_both_loop_free_votes_equal_vote_rank(seed):
    """Inner products drawn from a few values (ties in votes and strength everywhere),
    requests with 1..4 positions and 1..N notes, dead positions and channels, r from 0 to
    past the note count, min_votes 0..2: vote_pick (numpy, the positions unpadded) and
    vote_pick_padded (torch, padding positions dead) pick the same notes and count the
    same votes as vote_rank's loop."""
    rng = np.random.default_rng(seed)
    W, n, C, N, d = 9, 4, 6, 7, 4
    rows = rng.integers(1, n + 1, size=W)
    counts = rng.integers(1, N + 1, size=W)
    has_note = np.arange(N)[None, :] < counts[:, None]
    unit = np.zeros((W, n, C, d), dtype=np.float32)
    unit[..., 0] = 1.0
    live = (rng.random((W, n, C)) < 0.8) & (np.arange(n)[None, :, None] < rows[:, None, None])
    unit[~live] = 0.0
    sims = rng.choice([-0.5, 0.0, 0.5, 1.0], size=(W, n, C, N)).astype(np.float32)
    sims[~has_note[:, None, None, :].repeat(n, 1).repeat(C, 2)] = -np.inf
    open_ = np.full((W, N, C), d)
    rs = rng.integers(0, N + 2, size=W)
    padded_cos = torch.from_numpy(masked_cosines(sims, unit, open_))
    for min_votes in (0, 1, 2):
        want, want_votes = vote_rank(sims, unit, open_, has_note, live, rs.tolist(), min_votes)
        want_notes = [w.tolist() for w in want]
        keep = np.arange(n)[None, :] < rows[:, None]  # each request's positions, in order
        cos = masked_cosines(sims[keep][:, None], unit[keep][:, None], open_.repeat(rows, 0))
        picked, votes = vote_pick(cos[:, 0], live[keep], rows, has_note, rs, min_votes)
        assert [np.flatnonzero(p).tolist() for p in picked] == want_notes
        assert np.array_equal(votes, want_votes)
        picked_t, votes_t = vote_pick_padded(
            padded_cos, torch.from_numpy(live), torch.from_numpy(has_note),
            torch.from_numpy(rs), min_votes,
        )  # fmt: skip
        assert [np.flatnonzero(p).tolist() for p in picked_t.numpy()] == want_notes
        assert np.array_equal(votes_t.numpy(), want_votes)
        assert sum(len(w) for w in want) > 0


@pytest.mark.parametrize("seed", range(4))
def test_route_cosines_equal_masked_cosines_of_the_inner_products(seed):
    """route_cosines (one batched matmul, torch's float32 sums) against masked_cosines of
    the inner products numpy computes: equal within float rounding, zero and partly open
    notes and zero query rows included, and the same notes routed."""
    rng = np.random.default_rng(seed)
    W, n, C, N, d = 5, 8, 4, 11, 32
    unit = rng.normal(size=(W, n, C, d)).astype(np.float32)
    unit[rng.random((W, n, C)) < 0.2] = 0.0
    unit /= np.maximum(np.linalg.norm(unit, axis=-1, keepdims=True), 1e-12)
    notes = rng.normal(size=(W, N, C, d)).astype(np.float32)
    open_ = rng.choice([0, 8, 16, 32], size=(W, N, C))
    notes[np.arange(d) >= open_[..., None]] = 0.0
    notes /= np.maximum(np.linalg.norm(notes, axis=-1, keepdims=True), 1e-12)
    sims = np.einsum("wmcd,wncd->wmcn", unit, notes)
    want = masked_cosines(sims, unit, open_)
    got = route_cosines(torch.from_numpy(unit), torch.from_numpy(notes), torch.from_numpy(open_))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    live = np.linalg.norm(unit, axis=-1) > 0
    has_note = np.ones((W, N), dtype=bool)
    rs = np.full(W, 3)
    picks, _ = vote_rank(sims, unit, open_, has_note, live, rs.tolist(), 0)
    picked, _ = vote_pick_padded(got, torch.from_numpy(live), torch.from_numpy(has_note),
                          torch.from_numpy(rs), 0)  # fmt: skip
    assert [np.flatnonzero(p).tolist() for p in picked.numpy()] == [p.tolist() for p in picks]
