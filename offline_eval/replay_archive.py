"""The NoteBank archive of many users at once, for replay-aware training and the offline
replay scorer (offline_eval/replay_training.py), and routing over it as it stood at any
earlier position.

``build_note_archive`` runs a model over each user's events and writes notes through the
NoteBank's own write path (``observe_batch``: the chunks, spans and addresses the service
writes), with no cap, remembering where each note's chunk closed. ``NoteArchive.route``
then answers a route at position p from the notes closed by p (less those the per-user cap
would have evicted), with the selection functions the service's route uses
(recmem/archive/routing.py): so one build over a user's whole history serves every target
causally, and the notes used for a target never come from an event after it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from models.recommender import MemoryRecommender, padded_batch
from models.sequences import EventSeqs
from recmem.archive.bank import NoteBank
from recmem.archive.index import open_dims
from recmem.archive.routing import closed_at, eligible_range, overlap_rank, vote_rank
from recmem.archive.selection import l2_normalise
from recmem.config import ArchiveConfig

log = logging.getLogger(__name__)

BUILD_SEGMENT = 512
"""Events per user per model call while building (the state is carried between calls)."""
NO_CAP = 1 << 30


@dataclass
class UserNotes:
    """One user's notes, chronological: raw events per note, the positions their chunks
    closed at, unit addresses [n, C_ch, d] and their open prefixes [n, C_ch]."""

    items: list[np.ndarray]
    actions: list[np.ndarray]
    ts_ms: list[np.ndarray]
    closed: np.ndarray
    addresses: np.ndarray
    open: np.ndarray

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class Routed:
    """The notes routed for one query: indices into the user's notes (chronological)."""

    user: int
    picked: np.ndarray
    lo: int
    hi: int
    """The eligible notes [lo, hi) (closed by the query's position, within the cap)."""


class NoteArchive:
    """Notes of many users (by user row of ``EventSeqs``) and the routes over them.

    ``raw``: the addresses are the unit masked queries q~ at each note's most distinctive
    events (every key coordinate), for training a routing projection; otherwise they are
    the service's addresses (P of the model's query features)."""

    def __init__(
        self,
        cfg: ArchiveConfig,
        coords: np.ndarray,
        users: dict[int, UserNotes],
        raw: bool,
    ) -> None:
        self.cfg = cfg
        self.coords = coords
        self.users = users
        self.raw = raw

    def notes_of(self, user: int) -> UserNotes | None:
        return self.users.get(int(user))

    def eligible(self, user: int, position: int) -> tuple[int, int]:
        """[lo, hi) of the user's notes its archive held after its event at ``position``."""
        un = self.users.get(int(user))
        if un is None:
            return 0, 0
        return eligible_range(un.closed, position, self.cfg.notes_per_user)

    def route_native(
        self,
        users: Sequence[int],
        positions: Sequence[int],
        feats: Sequence[np.ndarray],
        r: int,
        addresses: Sequence[np.ndarray] | None = None,
    ) -> list[Routed]:
        """The native vote for queries (user, position, query features [n, C_ch, d_q] of
        the query events), over each user's notes eligible at the position. ``addresses``:
        per query, the eligible notes' unit addresses [hi - lo, C_ch, d] to vote on instead
        of the stored ones (a learned routing projection's current addresses)."""
        out: list[Routed] = []
        todo = []
        for j, (u, p) in enumerate(zip(users, positions, strict=True)):
            lo, hi = self.eligible(u, p)
            out.append(Routed(int(u), np.zeros(0, dtype=np.int64), lo, hi))
            if hi > lo and r > 0 and len(feats[j]):
                todo.append(j)
        if not todo:
            return out
        # a routing projection's features are its addresses already (every coordinate)
        sel = self.coords if addresses is None else slice(None)
        units = [l2_normalise(np.asarray(feats[j], np.float32)[..., sel]) for j in todo]
        n = max(len(x) for x in units)
        N = max(out[j].hi - out[j].lo for j in todo)
        W, ch, d = len(todo), units[0].shape[1], units[0].shape[2]
        unit = np.zeros((W, n, ch, d), dtype=np.float32)
        rho = np.zeros((W, N, ch, d), dtype=np.float32)
        open_ = np.zeros((W, N, ch), dtype=np.int64)
        has_note = np.zeros((W, N), dtype=bool)
        for w, j in enumerate(todo):
            unit[w, : len(units[w])] = units[w]
            lo, hi = out[j].lo, out[j].hi
            un = self.users[out[j].user]
            a = un.addresses[lo:hi] if addresses is None else addresses[j]
            rho[w, : hi - lo] = a
            open_[w, : hi - lo] = un.open[lo:hi] if addresses is None else open_dims(a)
            has_note[w, : hi - lo] = True
        live = np.linalg.norm(unit, axis=-1) > 0
        sims = np.einsum("wncd,wNcd->wncN", unit, rho)
        picked, _ = vote_rank(sims, unit, open_, has_note, live, [r] * W, self.cfg.min_votes)
        for w, j in enumerate(todo):
            out[j].picked = picked[w]
        return out

    def route_overlap(
        self,
        users: Sequence[int],
        positions: Sequence[int],
        weights: Sequence[tuple[dict[int, float], dict[int, float]]],
        item_cat: np.ndarray | None,
        r: int,
    ) -> list[Routed]:
        """Lexical / candidate-aware routes (``routing.overlap_rank``) over each user's
        notes eligible at the position."""
        out = []
        for u, p, (item_w, cat_w) in zip(users, positions, weights, strict=True):
            lo, hi = self.eligible(u, p)
            picked = np.zeros(0, dtype=np.int64)
            un = self.users.get(int(u))
            if un is not None and hi > lo and r > 0:
                picked = overlap_rank(un.items[lo:hi], item_w, cat_w, item_cat, r)
            out.append(Routed(int(u), picked, lo, hi))
        return out

    def replay_events(self, routed: Routed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The routed notes' raw events (items, actions, ts), chronological."""
        un = self.users.get(routed.user)
        if un is None or not len(routed.picked):
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        idx = [routed.lo + int(k) for k in routed.picked]
        return (
            np.concatenate([un.items[i] for i in idx]),
            np.concatenate([un.actions[i] for i in idx]),
            np.concatenate([un.ts_ms[i] for i in idx]),
        )


@torch.no_grad()
def build_note_archive(
    model: MemoryRecommender,
    seqs: EventSeqs,
    users: np.ndarray,
    lengths: np.ndarray,
    cfg: ArchiveConfig,
    seed: int,
    *,
    raw: bool = False,
    batch_users: int = 128,
    progress: bool = False,
) -> NoteArchive:
    """Notes of each user's first ``lengths[i]`` events (``users``: rows of ``seqs``), with
    ``model`` (in eval mode, no gradient) through the NoteBank write path. ``raw``: address
    with every coordinate of q~ (for a routing projection); else with the model's query
    features and the archive's coordinate selection, as the service does."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    mem = model.mem_cfg
    bank_cfg = dataclasses.replace(cfg, notes_per_user=NO_CAP)
    if raw:
        bank_cfg = dataclasses.replace(bank_cfg, address_dim=mem.key_dim)
    query_dim = mem.key_dim if raw else model.route_dim
    bank = NoteBank(bank_cfg, mem.key_dim, mem.n_layers * mem.n_heads, seed=seed,
                    use_gpu=False, query_dim=query_dim)  # fmt: skip
    users = np.asarray(users, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    users, lengths = users[keep], lengths[keep]
    order = np.argsort(-lengths, kind="stable")
    bar = tqdm(range(0, len(order), batch_users), desc="archive", leave=False, disable=not progress)
    try:
        for start in bar:
            sel = order[start : start + batch_users]
            b_users, b_len = users[sel], lengths[sel]
            names = [str(u) for u in b_users]
            state = model.init_state(len(sel), device)
            for s in range(0, int(b_len.max()), BUILD_SEGMENT):
                seg = np.clip(b_len - s, 0, BUILD_SEGMENT)
                items, actions, ts, lens = padded_batch(
                    seqs, b_users, seg, device, start=np.full(len(sel), s)
                )
                res = model.advance(items, actions, ts, lens, state, return_kq=True)
                state = res.state
                assert res.kq is not None
                k, q = res.kq
                feats = q if raw else model.route_features(q)
                T = items.shape[1]
                pos = s + np.arange(1, T + 1)[None, :].repeat(len(sel), 0)
                items_np = items.cpu().numpy()
                item_ids = [[str(i) for i in items_np[b, : seg[b]]] for b in range(len(sel))]
                bank.observe_batch(names, items_np, item_ids, actions.cpu().numpy(),
                                   ts.cpu().numpy(), pos, seg, k, feats)  # fmt: skip
    finally:
        model.train(was_training)
    out: dict[int, UserNotes] = {}
    C = cfg.chunk_events
    for name in bank.users():
        notes = bank.notes(name)
        if not notes:
            continue
        addr = np.stack([n.addresses for n in notes])
        out[int(name)] = UserNotes(
            items=[n.items for n in notes],
            actions=[n.actions for n in notes],
            ts_ms=[n.ts_ms for n in notes],
            closed=np.array([closed_at(n.positions, C) for n in notes], dtype=np.int64),
            addresses=addr,
            open=open_dims(addr),
        )
    log.info("archive: %d notes of %d users", sum(len(u) for u in out.values()), len(out))
    return NoteArchive(cfg, bank.coords, out, raw)
