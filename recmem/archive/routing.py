"""How routed notes are chosen, as pure functions over one request's candidate notes (numpy)
or a batch of requests (numpy, or torch on padded requests: ``route_cosines``,
``vote_pick_padded``), shared by the served route (``NoteBank``) and offline replay-aware
training and scoring (offline_eval/replay_training.py), so both choose the same notes.

- ``vote_rank`` (and its loop-free forms for the served route: ``vote_pick`` in numpy on
  the requests' rows one after another, ``vote_pick_padded`` in torch on padded requests,
  for ``archive.route_device = rank``): the native rule (SPEC section 5): each channel votes for the note whose
  address is the most cosine-similar to any query position; notes ranked by votes, summed
  best cosine, recency (docs/archive.md, Route).
- ``overlap_rank``: lexical (``archive.routing = lexical``: the notes sharing items or
  categories with the query events) and candidate-aware routing (``candidates``: the notes
  whose events' categories the candidates have, weighted by how many candidates have each:
  SIM's hard search). A note scores the sum over its events of the weight of the event's
  item plus that of its category; notes scoring 0 are not routed.

``closed_at`` gives the position at which a note's chunk closed, so that a route can be
restricted to the archive as it stood at an earlier position (``eligible_range``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from recmem.archive.index import masked_cosines

ROUTINGS = ("native", "lexical", "candidates")


def closed_at(positions: np.ndarray, chunk_events: int) -> int:
    """The lifetime position at which the chunk holding events at ``positions`` closed (its
    last position: chunks cover C positions from 1 on)."""
    last = int(np.max(positions))
    return -(-last // chunk_events) * chunk_events


def eligible_range(closed: np.ndarray, position: int, cap: int) -> tuple[int, int]:
    """[lo, hi) of a user's chronological notes (their ``closed`` positions, increasing)
    that its archive held after the event at ``position``: those closed by then, less the
    oldest beyond the per-user cap."""
    hi = int(np.searchsorted(closed, position, side="right"))
    return max(0, hi - cap), hi


def vote_rank(
    sims: np.ndarray,
    unit: np.ndarray,
    open_: np.ndarray,
    has_note: np.ndarray,
    live: np.ndarray,
    rs: Sequence[int],
    min_votes: int,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The native vote for W requests at once: raw inner products ``sims`` [W, n, C, N] of
    unit query addresses ``unit`` [W, n, C, d] with unit note addresses, whose open prefixes
    are ``open_`` [W, N, C]; ``has_note`` [W, N] marks real (eligible) notes, ``live``
    [W, n, C] the query positions and channels with a nonzero query. Returns per request the
    indices of its top ``rs[w]`` notes in chronological order, and the votes [W, N]."""
    cos = masked_cosines(sims, unit, open_)  # [W, n, C_ch, N]
    cos = np.where(live[..., None] & has_note[:, None, None, :], cos, -np.inf)
    best = cos.max(axis=1)  # [W, C_ch, N]: max over query positions
    order, votes = _vote_order(best, np.asarray(live.any(axis=1)), has_note)
    out = []
    for j in range(len(order)):
        ranked = order[j, : rs[j]]
        ranked = ranked[has_note[j, ranked]]
        if min_votes > 0:
            ranked = ranked[votes[j, ranked] >= min_votes]
        out.append(np.sort(ranked))
    return out, votes


def vote_pick(
    cos: np.ndarray,
    live: np.ndarray,
    rows: np.ndarray,
    has_note: np.ndarray,
    rs: np.ndarray,
    min_votes: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``vote_rank`` with the query positions of the W requests one after another, not
    padded, and no loop over the requests: masked cosines ``cos`` [M, C, N] (``masked_cosines``)
    and ``live`` [M, C] of the M query positions, ``rows`` [W] (each >= 1) of them per
    request. Returns the notes ``vote_rank`` returns as a mask [W, N] (``np.nonzero`` of
    it lists them request by request, chronologically), and the votes [W, N]."""
    starts = np.cumsum(rows) - rows
    owner = np.repeat(np.arange(len(rows)), rows)
    cos = np.where(live[..., None] & has_note[owner][:, None, :], cos, -np.inf)
    best = np.maximum.reduceat(cos, starts, axis=0)  # [W, C_ch, N]
    voters = np.logical_or.reduceat(live, starts, axis=0)  # [W, C_ch]
    order, votes = _vote_order(best, voters, has_note)
    W, N = order.shape
    rank = np.empty_like(order)  # each note's place in its request's ranking
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(N), (W, N)), axis=-1)
    picked: np.ndarray = (rank < np.asarray(rs, dtype=np.int64)[:, None]) & has_note
    if min_votes > 0:
        picked &= votes >= min_votes
    return picked, votes


def route_cosines(unit: torch.Tensor, notes: torch.Tensor, open_: torch.Tensor) -> torch.Tensor:
    """``masked_cosines`` of padded requests as torch computes them on any device: unit
    query addresses ``unit`` [W, n, C, d] against unit note addresses ``notes`` [W, N, C, d]
    whose open prefixes are ``open_`` [W, N, C] -> cosines [W, n, C, N] (0 where the query's
    open prefix is zero). Float32 sums in torch's order, not faiss's: equal to the numpy
    form within float rounding."""
    W, n, C, _ = unit.shape
    N = notes.shape[1]
    raw = torch.matmul(unit.transpose(1, 2), notes.permute(0, 2, 3, 1))  # [W, C, n, N]
    cum = torch.nn.functional.pad(unit.square().cumsum(-1), (1, 0)).sqrt()  # |u[:o]|
    idx = open_.transpose(1, 2)[:, :, None, :].expand(W, C, n, N)
    norm = torch.gather(cum.transpose(1, 2), -1, idx)  # [W, C, n, N]
    cos = torch.where(norm > 1e-6, raw / norm.clamp_min(1e-6), 0.0)
    return cos.transpose(1, 2)


def vote_pick_padded(
    cos: torch.Tensor,
    live: torch.Tensor,
    has_note: torch.Tensor,
    rs: torch.Tensor,
    min_votes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vote_rank`` in torch on padded tensors, with no loop over the requests (the served
    route on the rank device, ``archive.route_device = rank``): masked cosines ``cos`` [W, n, C, N]
    (``route_cosines``), ``live`` [W, n, C] (padding positions dead), ``has_note`` [W, N],
    ``rs`` [W]. Returns the notes ``vote_rank`` returns as a mask [W, N] (``nonzero`` of it
    lists them request by request, chronologically), and the votes [W, N]."""
    W, _, _, N = cos.shape
    dev = cos.device
    mask = live[..., None] & has_note[:, None, None, :]
    best = torch.where(mask, cos, -torch.inf).amax(dim=1)  # [W, C, N]: max over positions
    voters = live.any(dim=1)  # [W, C]
    winner = best.argmax(dim=-1)  # the first of equal maxima, as numpy's argmax
    notes_ = torch.arange(N, device=dev)
    votes = ((winner[..., None] == notes_) & voters[..., None]).sum(dim=1)
    strength = torch.where(voters[..., None], best, 0.0).sum(dim=1)
    votes = torch.where(has_note, votes, -1)  # padding ranks last
    strength = torch.where(has_note, strength, -torch.inf)
    # votes, then strength, then recency: stable sorts from the last key to the first
    order = notes_.flip(0).expand(W, N)
    order = order.gather(1, torch.argsort(-strength.gather(1, order), dim=1, stable=True))
    order = order.gather(1, torch.argsort(-votes.gather(1, order), dim=1, stable=True))
    rank = torch.empty_like(order).scatter_(1, order, notes_.expand(W, N))
    picked = (rank < rs[:, None]) & has_note
    if min_votes > 0:
        picked &= votes >= min_votes
    return picked, votes


def _vote_order(
    best: np.ndarray, voters: np.ndarray, has_note: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """From each channel's best cosine per note ``best`` [W, C, N] (max over the query
    positions) and its voting channels ``voters`` [W, C]: the ranking [W, N] of each
    request's notes (votes, then strength, then recency; padding last) and the votes
    [W, N] (-1 for padding)."""
    W, _, N = best.shape
    winner = best.argmax(axis=-1)  # [W, C_ch]
    votes = ((winner[..., None] == np.arange(N)) & voters[..., None]).sum(axis=1)
    strength = np.where(voters[..., None], best, 0.0).sum(axis=1)  # [W, N]
    votes = np.where(has_note, votes, -1)  # padding ranks last
    strength = np.where(has_note, strength, -np.inf)
    recency = np.broadcast_to(np.arange(N), (W, N))
    order = np.lexsort((-recency, -strength, -votes), axis=-1)  # last key sorts first
    return order, votes


def overlap_weights(
    items: np.ndarray, item_cat: np.ndarray | None, with_items: bool = True
) -> tuple[dict[int, float], dict[int, float]]:
    """Item and category weights of a set of events or candidates (item indices): each
    distinct item 1 (``with_items``), each category the share of them that have it."""
    items = np.asarray(items, dtype=np.int64)
    item_w = {int(i): 1.0 for i in np.unique(items)} if with_items else {}
    cat_w: dict[int, float] = {}
    if item_cat is not None and len(items):
        cats = item_cat[np.clip(items, 0, len(item_cat) - 1)]
        cats = cats[(items < len(item_cat)) & (cats >= 0)]
        keys, counts = np.unique(cats, return_counts=True)
        cat_w = {int(k): float(c) / len(items) for k, c in zip(keys, counts, strict=True)}
    return item_w, cat_w


def overlap_rank(
    note_items: Sequence[np.ndarray],
    item_w: Mapping[int, float],
    cat_w: Mapping[int, float],
    item_cat: np.ndarray | None,
    r: int,
) -> np.ndarray:
    """Indices (chronological) of the top ``r`` of a user's notes (``note_items``: each
    note's item indices, chronological) by overlap score, the more recent first on ties;
    notes scoring 0 are left out."""
    scores = np.zeros(len(note_items), dtype=np.float64)
    for i, items in enumerate(note_items):
        s = sum(item_w.get(int(x), 0.0) for x in items)
        if item_cat is not None and cat_w:
            for x in items:
                if 0 <= x < len(item_cat):
                    s += cat_w.get(int(item_cat[x]), 0.0)
        scores[i] = s
    order = np.lexsort((-np.arange(len(scores)), -scores))
    top = order[:r]
    return np.sort(top[scores[top] > 0])
