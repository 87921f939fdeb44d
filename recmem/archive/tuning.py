"""Helpers for choosing the archive defaults by evaluation (no CLI; offline_eval or a
notebook calls them).

``evidence_recall`` measures what the archive makes reachable, without replay: run a
model's memory over each user's events in time order, write notes as ingest would, and at
every target ask whether the target's key (the item, or its category key on datasets
without repeats) occurs among the events of the R routed notes, of the R most recent
notes, of R random notes, and of any note (the ceiling for any router). It is a cheap
proxy to narrow C, w, W, B, d_rho and R before the end-to-end replay evaluation, which is
the one that decides (``bench/experiments/notebank_tuning.py``; the defaults were chosen with it,
reports/ml-100k-notebank-tuning/).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from models.recommender import MemoryRecommender, padded_batch
from models.sequences import EventSeqs
from recmem.archive.bank import NoteBank
from recmem.config import ArchiveConfig

log = logging.getLogger(__name__)


def archive_grid(base: ArchiveConfig, **choices: Sequence[Any]) -> list[ArchiveConfig]:
    """Every combination of the given field values on top of ``base``, e.g.
    ``archive_grid(cfg, max_span=[4, 8, 16], replay_notes=[2, 4])``."""
    names = list(choices)
    known = {f.name for f in dataclasses.fields(ArchiveConfig)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown archive fields {unknown}")
    return [
        dataclasses.replace(base, **dict(zip(names, values)))
        for values in itertools.product(*(choices[n] for n in names))
    ]


@dataclass
class EvidenceRecall:
    """Per-target flags (bool [n]) for the targets in ``rows`` (event rows of ``seqs``)."""

    rows: np.ndarray
    routed: np.ndarray
    recent: np.ndarray
    random: np.ndarray
    archived: np.ndarray
    notes: np.ndarray
    """Notes the user had when the target came ([n] int)."""
    returned: np.ndarray
    """Notes the route returned ([n] int; fewer than R when fewer notes got votes)."""

    def summary(self, mask: np.ndarray | None = None) -> dict[str, float]:
        """Hit rates over all targets, or over those where ``mask`` is true."""
        m = np.ones(len(self.rows), dtype=bool) if mask is None else mask
        n = int(m.sum())

        def rate(x: np.ndarray) -> float:
            return float(x[m].mean()) if n else 0.0

        return {
            "targets": float(n),
            "routed": rate(self.routed),
            "recent": rate(self.recent),
            "random": rate(self.random),
            "archived": rate(self.archived),
            "mean_notes": float(self.notes[m].mean()) if n else 0.0,
            "mean_routed": float(self.returned[m].mean()) if n else 0.0,
        }


def _length_batches(users: np.ndarray, need: np.ndarray, max_slots: int) -> list[np.ndarray]:
    """Users sorted by need, cut so that batch size * longest need <= max_slots."""
    order = users[np.argsort(need[users], kind="stable")]
    batches, start = [], 0
    for end in range(1, len(order) + 1):
        if end - start > 1 and (end - start) * need[order[end - 1]] > max_slots:
            batches.append(order[start : end - 1])
            start = end - 1
    if start < len(order):
        batches.append(order[start:])
    return batches


def evidence_recall(
    model: MemoryRecommender,
    seqs: EventSeqs,
    target_rows: np.ndarray,
    cfg: ArchiveConfig,
    **kw: Any,
) -> EvidenceRecall:
    """``evidence_recall_grid`` for one archive configuration."""
    return evidence_recall_grid(model, seqs, target_rows, [cfg], **kw)[0]


@torch.no_grad()
def evidence_recall_grid(
    model: MemoryRecommender,
    seqs: EventSeqs,
    target_rows: np.ndarray,
    cfgs: Sequence[ArchiveConfig],
    *,
    event_keys: np.ndarray | None = None,
    query_events: int = 1,
    seed: int = 0,
    max_slots: int = 16_384,
) -> list[EvidenceRecall]:
    """For each archive configuration: archive every user's events before each target
    (rows of ``seqs``) and route with the queries of the ``query_events`` events just
    before it (as the rank path does with server.replay_query_events), R = ``replay_notes``. The model runs once for all configurations. ``event_keys[row]`` is
    the key of each event of ``seqs`` (default: its item; e.g. ``TimeSplit.event_cat``).
    Targets at a user's first event are dropped."""
    rows = np.asarray(target_rows, dtype=np.int64)
    user_of = seqs.user_of_event()[rows]
    idx = rows - seqs.offsets[user_of]
    rows, user_of, idx = rows[idx > 0], user_of[idx > 0], idx[idx > 0]
    order = np.lexsort((idx, user_of))
    rows, user_of, idx = rows[order], user_of[order], idx[order]
    keys = seqs.items if event_keys is None else np.asarray(event_keys)
    if len(keys) != seqs.n_events:
        raise ValueError(f"event_keys has {len(keys)} entries for {seqs.n_events} events")
    mem = model.mem_cfg
    banks = [NoteBank(c, mem.key_dim, mem.n_layers * mem.n_heads, seed) for c in cfgs]
    rng = np.random.default_rng(seed)
    flags = np.zeros((len(cfgs), 4, len(rows)), dtype=bool)
    n_notes = np.zeros((len(cfgs), len(rows)), dtype=np.int64)
    n_routed = np.zeros((len(cfgs), len(rows)), dtype=np.int64)
    need = np.zeros(seqs.n_users, dtype=np.int64)
    np.maximum.at(need, user_of, idx)  # events 0 .. idx-1 come before the target
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    first_target = np.searchsorted(user_of, np.arange(seqs.n_users + 1))
    try:
        batches = _length_batches(np.unique(user_of), need, max_slots)
        for batch in tqdm(batches, desc="evidence recall", unit="batch", leave=False):
            items, actions, ts, lengths = padded_batch(seqs, batch, need[batch], device)
            res = model.advance(
                items, actions, ts, lengths, model.init_state(len(batch), device), return_kq=True
            )
            assert res.kq is not None
            k, q = (x.flatten(2, 3).float().cpu().numpy() for x in res.kq)
            for b, u in enumerate(batch):
                first = int(seqs.offsets[u])
                ev = slice(first, first + int(need[u]))
                u_items, uid = seqs.items[ev], str(u)
                targets = range(first_target[u], first_target[u + 1])
                for g, (c, bank) in enumerate(zip(cfgs, banks)):
                    r, fed = c.replay_notes, 0
                    for j in targets:
                        t = int(idx[j])
                        bank.observe(
                            uid, u_items[fed:t], [str(i) for i in u_items[fed:t]],
                            seqs.actions[ev][fed:t], seqs.ts_ms[ev][fed:t],
                            np.arange(fed + 1, t + 1), k[b, fed:t], q[b, fed:t],
                        )  # fmt: skip
                        fed = t
                        notes = bank.notes(uid)
                        n_notes[g, j] = len(notes)
                        routed = bank.route(uid, q[b, max(0, t - query_events) : t], r=r)
                        n_routed[g, j] = len(routed)
                        picks = [routed, notes[-r:] if r else [], _sample(notes, r, rng), notes]
                        for f, chosen in enumerate(picks):
                            flags[g, f, j] = any(
                                np.any(keys[first + n.positions - 1] == keys[rows[j]])
                                for n in chosen
                            )
                    bank.drop_users([uid])
    finally:
        model.train(was_training)
    return [
        EvidenceRecall(rows, f[0], f[1], f[2], f[3], n, m)
        for f, n, m in zip(flags, n_notes, n_routed)
    ]


def _sample(notes: list[Any], r: int, rng: np.random.Generator) -> list[Any]:
    if len(notes) <= r:
        return notes
    return [notes[i] for i in rng.choice(len(notes), size=r, replace=False)]
