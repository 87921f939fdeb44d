"""The model-agnostic evaluator: full ranking of every target among all TRAIN items.

A model is evaluated through the :class:`Scorer` protocol: user vectors after given event
rows, and one vector per TRAIN item; the score is their dot product. Targets are taken in
chunks of whole users (``cfg.batch_users`` users per ``user_vectors`` call, so a stateful
model can run each user's sequence once per chunk), and the score matrix in row blocks small
enough to fit in memory.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from models.sequences import EventSeqs
from offline_eval.metrics import metrics_from_ranks, target_log_loss, target_ranks
from offline_eval.split import TargetSet, TimeSplit
from offline_eval.strata import STRATA, assign_strata

if TYPE_CHECKING:
    from recmem.config import EvalConfig

log = logging.getLogger(__name__)

SCORE_BLOCK_ELEMENTS = 1 << 24
"""Largest score block (rows x items) materialised at once."""


class Scorer(Protocol):
    """What every evaluated model implements."""

    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        """[n, D]: the user vector after event row r for each r in query_rows, computed from
        the user's events up to and including r, in order (rows are grouped by user, each
        user's rows ascending), for a question asked at ``request_ts`` (ms, one per row: the
        target's own timestamp, the one thing about the target a model may use)."""
        ...

    def item_matrix(self) -> torch.Tensor:
        """[n_items, D]: row i scores TRAIN item i of the split's vocabulary (extra rows,
        e.g. OOV buckets, are ignored)."""
        ...


def _user_chunks(users: np.ndarray, users_per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) target-index ranges covering ``users_per_chunk`` consecutive users."""
    if users.shape[0] == 0:
        return []
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    bounds = np.r_[starts[:: max(1, users_per_chunk)], users.shape[0]]
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def seen_mask(
    split: TimeSplit, targets: TargetSet, lo: int, hi: int, device: torch.device
) -> torch.Tensor:
    """bool [hi - lo, n_items]: TRAIN items each target's user saw up to its query row.

    Each user of the block contributes its events once: the row where it first saw each
    item (scatter-min into [users, items]); a target masks the items first seen at or before
    its query row.
    """
    n_items = split.n_items
    users = targets.users[lo:hi]
    query = targets.query_rows[lo:hi]
    uniq, slot = np.unique(users, return_inverse=True)
    last = np.zeros(uniq.shape[0], dtype=np.int64)
    np.maximum.at(last, slot, query)
    start = split.seqs.offsets[uniq]
    lengths = last - start + 1
    ev_slot = np.repeat(np.arange(uniq.shape[0]), lengths)
    ev_row = np.repeat(start, lengths) + (
        np.arange(ev_slot.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    )
    ev_item = split.seqs.items[ev_row]
    keep = ev_item < n_items
    flat = torch.as_tensor(ev_slot[keep] * n_items + ev_item[keep], device=device)
    never = torch.iinfo(torch.int64).max
    first = torch.full((uniq.shape[0] * n_items,), never, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, flat, torch.as_tensor(ev_row[keep], device=device), reduce="amin")
    first = first.view(uniq.shape[0], n_items)[torch.as_tensor(slot, device=device)]
    return first <= torch.as_tensor(query, device=device).unsqueeze(1)


def planted_groups(
    split: TimeSplit, rows: np.ndarray, masks: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Target groups with a known answer on generated data (empty without planted data):
    planted recalls, the other targets, and long-term returns (a target from a session of a
    long-term interest whose category was last seen outside the recent window)."""
    if "is_recall" not in split.planted:
        return {}
    recall = split.planted["is_recall"][rows].astype(bool)
    groups = {"planted_recall": recall, "planted_other": ~recall}
    if "long_term_session" in split.planted:
        lt = split.planted["long_term_session"][rows].astype(bool)
        groups["planted_long_term_return"] = lt & ~recall & masks["long_term"]
    return groups


def evaluate(
    scorer: Scorer,
    split: TimeSplit,
    part: str | int,
    cfg: EvalConfig,
    *,
    batch_users: int | None = None,
    return_per_target: bool = False,
    with_loss: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Overall and per-stratum metrics of ``scorer`` on the VALID or TEST targets.

    Returns {"overall", "recent", "long_term", "new", "repeat"} (each {"hr@10", "ndcg@10",
    "mrr@10", "hr@50", "n"}), "n_targets", "excluded_cold_item", "excluded_first_event",
    "exclude_seen", "eval_seconds", "loss" (mean target loss, with ``with_loss``),
    "planted" (metrics of :func:`planted_groups`, generated data only) and, with
    ``return_per_target``, "per_target": numpy arrays rows, users, positions, ranks,
    (``with_loss``) loss (-log softmax of the target over the non-excluded items) and the
    stratum masks ``is_<stratum>``.
    """
    t0 = time.perf_counter()
    targets = split.targets(part, cfg.exclude_seen)
    masks = assign_strata(
        split.seqs,
        split.event_cat,
        targets.rows,
        recent_window=cfg.recent_window,
        repeat_gap=cfg.repeat_gap,
        with_repeat=split.has_repeats,
    )
    items = scorer.item_matrix()
    if items.shape[0] < split.n_items:
        raise ValueError(f"item_matrix has {items.shape[0]} rows; the split has {split.n_items}")
    items = items[: split.n_items]
    ranks = np.zeros(targets.n, dtype=np.int64)
    losses = np.zeros(targets.n, dtype=np.float64)
    block_rows = max(1, SCORE_BLOCK_ELEMENTS // max(1, split.n_items))
    chunks = _user_chunks(targets.users, batch_users or cfg.batch_users)
    with torch.no_grad():
        for lo, hi in tqdm(chunks, desc=f"eval {split.dataset}", disable=not progress):
            request_ts = split.seqs.ts_ms[targets.rows[lo:hi]]
            uv = scorer.user_vectors(split.seqs, targets.query_rows[lo:hi], request_ts)
            if uv.shape[0] != hi - lo:
                raise ValueError(f"user_vectors returned {uv.shape[0]} rows for {hi - lo} queries")
            uv = uv.to(device=items.device, dtype=items.dtype)
            for b_lo in range(lo, hi, block_rows):
                b_hi = min(hi, b_lo + block_rows)
                scores = uv[b_lo - lo : b_hi - lo] @ items.T
                tgt = torch.as_tensor(targets.items[b_lo:b_hi], device=scores.device)
                exclude = None
                if targets.exclude_seen:
                    exclude = seen_mask(split, targets, b_lo, b_hi, scores.device)
                ranks[b_lo:b_hi] = target_ranks(scores, tgt, exclude).cpu().numpy()
                if with_loss:
                    losses[b_lo:b_hi] = target_log_loss(scores, tgt).double().cpu().numpy()
    result: dict[str, Any] = {"overall": metrics_from_ranks(ranks)}
    for name in STRATA:
        result[name] = metrics_from_ranks(ranks[masks[name]])
    planted = planted_groups(split, targets.rows, masks)
    if planted:
        result["planted"] = {k: metrics_from_ranks(ranks[m]) for k, m in planted.items()}
    result.update(
        n_targets=targets.n,
        excluded_cold_item=targets.excluded_cold_item,
        excluded_first_event=targets.excluded_first_event,
        exclude_seen=targets.exclude_seen,
        eval_seconds=time.perf_counter() - t0,
    )
    log.debug("%s %s: %d targets in %.1f s", split.dataset, part, targets.n, result["eval_seconds"])
    if with_loss:
        result["loss"] = float(losses.mean()) if targets.n else None
    if return_per_target:
        per: dict[str, np.ndarray] = {
            "rows": targets.rows,
            "users": targets.users,
            "positions": targets.positions,
            "ranks": ranks,
        }
        if with_loss:
            per["loss"] = losses
        per.update({f"is_{k}": v for k, v in masks.items()})
        result["per_target"] = per
    return result
