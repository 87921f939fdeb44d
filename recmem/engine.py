"""The engine step: one micro-batch of validated events -> one batched memory update.

``Engine.apply`` groups the batch by user (each user's events keep their order), encodes
items with the vocabulary, builds one right-padded [B, T] batch for all users of the
micro-batch, gathers their states from the store, runs ONE ``model.advance`` (no autograd,
on the store's device) and scatters the new states back. It also records which Kafka
partition each user belongs to, because a checkpoint is per partition.

The ingest service (recmem/ingest.py) and the rank path feed this same engine; ``snapshot``
gives the rank path copies of states, never the live tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from models.recommender import MemoryRecommender
from models.state import MemoryState
from recmem.config import Config
from recmem.state_store import UserStateStore
from recmem.vocab import ItemVocab
from streams.validate import ValidEvent

log = logging.getLogger(__name__)


class ArchiveHook(Protocol):
    """The seam for the NoteBank archive (recmem/archive). ``observe`` is called once per
    engine step, under ``Engine.lock`` together with the state write; ``settle`` right
    after it, outside the lock (work that readers need not see together with the new
    states, such as writing notes). The notes travel in the partition's checkpoint
    (export/import) and leave with it (drop).

    ``user_ids`` [B]; ``items``/``actions``/``ts_ms`` [B, T] and ``lengths`` [B] as given to
    ``advance`` (host numpy, vocab-encoded items, right-padded); ``kq`` = (k~, q~), each
    [B, T, L, H, K] on the engine's device; ``positions`` [B] each user's lifetime position
    before this step (event j of user b is at position positions[b] + j + 1)."""

    def observe(
        self,
        user_ids: list[str],
        items: np.ndarray,
        actions: np.ndarray,
        ts_ms: np.ndarray,
        lengths: np.ndarray,
        kq: tuple[torch.Tensor, torch.Tensor],
        positions: np.ndarray,
    ) -> None: ...

    def settle(self) -> None:
        """Finish the last ``observe`` outside the engine's lock (may do nothing)."""
        ...

    def export_notes(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """The notes of these users as arrays, for their partition's checkpoint."""
        ...

    def import_notes(self, user_ids: list[str], notes: dict[str, np.ndarray] | None) -> None:
        """Install notes restored from a checkpoint (None: the checkpoint had none)."""
        ...

    def drop(self, user_ids: list[str]) -> None:
        """Forget these users (their partition was revoked)."""
        ...


@dataclass
class ApplyCounts:
    """What one ``apply`` did."""

    events: int = 0
    users: int = 0
    new_users: int = 0
    max_len: int = 0
    """T: the longest run of one user's events in the batch (the padded width)."""


@dataclass
class GroupedBatch:
    """A micro-batch grouped by user: right-padded [B, T] arrays and lengths [B]."""

    user_ids: list[str]
    partitions: list[int]
    items: np.ndarray
    actions: np.ndarray
    ts_ms: np.ndarray
    lengths: np.ndarray


def group_events(events: Sequence[ValidEvent], vocab: ItemVocab) -> GroupedBatch:
    """Group by user in first-appearance order, each user's events in batch order."""
    code_of: dict[str, int] = {}
    codes = np.fromiter(
        (code_of.setdefault(e.user_id, len(code_of)) for e in events),
        dtype=np.int64,
        count=len(events),
    )
    n_users = len(code_of)
    lengths = np.bincount(codes, minlength=n_users).astype(np.int64)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    col = np.empty(len(events), dtype=np.int64)
    col[order] = np.arange(len(events)) - np.repeat(starts, lengths)
    T = int(lengths.max()) if n_users else 0
    items = np.zeros((n_users, T), dtype=np.int64)
    actions = np.zeros((n_users, T), dtype=np.int64)
    ts = np.zeros((n_users, T), dtype=np.int64)
    items[codes, col] = vocab.encode(e.item_id for e in events)
    actions[codes, col] = np.fromiter((e.action for e in events), np.int64, len(events))
    ts[codes, col] = np.fromiter((e.ts_ms for e in events), np.int64, len(events))
    partitions = [0] * n_users
    for e in events:
        partitions[code_of[e.user_id]] = e.partition
    return GroupedBatch(list(code_of), partitions, items, actions, ts, lengths)


def config_hash(cfg: Config) -> str:
    """Digest of the settings that define what a stored state means (memory and model
    sections): states written under another hash cannot be continued."""
    body = json.dumps(
        {"memory": cfg.to_dict()["memory"], "model": cfg.to_dict()["model"]}, sort_keys=True
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class Engine:
    """Per-user memories: the state store, the model's batched update and the archive."""

    def __init__(
        self,
        model: MemoryRecommender,
        vocab: ItemVocab,
        store: UserStateStore,
        cfg: Config,
        archive: ArchiveHook | None = None,
        model_version: str = "unversioned",
    ) -> None:
        self.model = model.to(store.device).eval()
        self.vocab = vocab
        self.store = store
        self.cfg = cfg
        self.archive = archive
        self.model_version = model_version
        self.config_hash = config_hash(cfg)
        self.lock: AbstractContextManager[Any] = nullcontext()
        """Held while ``apply`` changes the store or the archive (the gather that may move
        users between tiers; the scatter with the archive's observe; the bookkeeping), not
        while the model computes nor while the archive settles (``ArchiveHook.settle``):
        readers holding it (the rank path's snapshots) see a complete step and never wait
        for the model. Only one thread may call ``apply`` (and the partition methods);
        ``recmem serve`` sets it to the rank stack's lock."""
        self.partition_of: dict[str, int] = {}
        self._users_of: dict[int, set[str]] = {}
        self._dirty: dict[int, set[str]] = {}
        """Per partition: users whose state changed since :meth:`clear_dirty` (deltas)."""
        self.seconds: dict[str, float] = dict.fromkeys(
            ("group", "gather", "advance", "scatter", "archive", "user_steps"), 0.0
        )
        """Running totals for profiling: seconds per phase of ``apply``, and user_steps (the
        padded [B, T] cells run, a count)."""

    @property
    def device(self) -> torch.device:
        return self.store.device

    # ---- ingest ------------------------------------------------------------------------

    def apply(self, events: Sequence[ValidEvent]) -> ApplyCounts:
        """Apply one micro-batch; every user's position advances by its number of events."""
        if not events:
            return ApplyCounts()
        t0 = time.perf_counter()
        batch = group_events(events, self.vocab)
        self.seconds["group"] += time.perf_counter() - t0
        counts = ApplyCounts(
            events=len(events), users=len(batch.user_ids), max_len=int(batch.lengths.max())
        )
        counts.new_users = sum(1 for u in batch.user_ids if u not in self.store)
        for rows in self._steps(batch.lengths):
            self._advance(batch, rows)
        with self.lock:
            for user, part in zip(batch.user_ids, batch.partitions):
                self._record(user, part)
                self._dirty.setdefault(part, set()).add(user)
        return counts

    def _steps(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Row sets of the batch, one ``advance`` each: all rows at once, or (with
        ``state.length_buckets``) users grouped by power-of-two length so that padding stays
        below 2x the events; any set larger than the slab is cut into slab-sized pieces.
        Each set lists its users longest first.
        Buckets pay on the CPU path (padded steps cost as much as real ones); on the GPU they
        only add launches, so ``auto`` leaves them off there."""
        mode = self.cfg.state.length_buckets
        if mode == "on" or (mode == "auto" and self.device.type == "cpu"):
            bucket = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
            groups = [np.nonzero(bucket == b)[0] for b in np.unique(bucket)[::-1]]
        else:
            groups = [np.arange(len(lengths))]
        # longest first: the chunked CPU scan then runs each chunk on a prefix of the users
        groups = [g[np.argsort(-lengths[g], kind="stable")] for g in groups]
        cap = self.store.capacity
        return [g[i : i + cap] for g in groups for i in range(0, len(g), cap)]

    @torch.no_grad()
    def _advance(self, batch: GroupedBatch, rows: np.ndarray) -> None:
        t0 = time.perf_counter()
        users = [batch.user_ids[i] for i in rows]
        lengths = batch.lengths[rows]
        T = int(lengths.max())
        dev = self.device
        items, actions, ts = (a[rows, :T] for a in (batch.items, batch.actions, batch.ts_ms))
        with self.lock:  # may move users between tiers
            state, slots = self.store.gather(users)
        positions = state.pos.cpu().numpy()
        t1 = time.perf_counter()
        result = self.model.advance(
            torch.from_numpy(items).to(dev),
            torch.from_numpy(actions).to(dev),
            torch.from_numpy(ts).to(dev),
            torch.from_numpy(lengths).to(dev),
            state,
            return_kq=self.archive is not None,
        )
        t2 = time.perf_counter()
        with self.lock:  # the new states and the archive's view of them appear together
            self.store.scatter(slots, result.state)
            t3 = time.perf_counter()
            if self.archive is not None and result.kq is not None:
                self.archive.observe(users, items, actions, ts, lengths, result.kq, positions)
        if self.archive is not None and result.kq is not None:
            self.archive.settle()
        t4 = time.perf_counter()
        self.seconds["gather"] += t1 - t0
        self.seconds["advance"] += t2 - t1
        self.seconds["scatter"] += t3 - t2
        self.seconds["archive"] += t4 - t3
        self.seconds["user_steps"] += len(users) * T

    def _record(self, user: str, partition: int) -> None:
        old = self.partition_of.get(user)
        if old == partition:
            return
        if old is not None:
            log.warning("user %r moved from partition %d to %d", user, old, partition)
            self._users_of[old].discard(user)
        self.partition_of[user] = partition
        self._users_of.setdefault(partition, set()).add(user)

    # ---- partitions (checkpoints, rebalances) ------------------------------------------

    def users_of(self, partition: int) -> list[str]:
        return sorted(self._users_of.get(partition, ()))

    def export_partition(self, partition: int) -> tuple[list[str], MemoryState]:
        """The users of ``partition`` and a host copy of their states (for a checkpoint)."""
        users = self.users_of(partition)
        return users, self.store.read(users)

    def dirty_users(self, partition: int) -> list[str]:
        """Users of ``partition`` changed since the last :meth:`clear_dirty` of it."""
        return sorted(self._dirty.get(partition, ()))

    def clear_dirty(self, partition: int) -> None:
        self._dirty.pop(partition, None)

    def adopt(self, partition: int, user_ids: list[str], state: MemoryState) -> None:
        """Install restored states of a partition's users."""
        self.store.put(user_ids, state)
        for user in user_ids:
            self._record(user, partition)

    def drop_partition(self, partition: int) -> int:
        self._dirty.pop(partition, None)
        users = self._users_of.pop(partition, set())
        for user in users:
            self.partition_of.pop(user, None)
        return self.store.drop(users)

    # ---- read-only helpers for ranking -------------------------------------------------

    def known(self, user_ids: Sequence[str]) -> list[bool]:
        return [u in self.store for u in user_ids]

    def snapshot(self, user_ids: Sequence[str]) -> MemoryState:
        """Copies of the users' states on the engine's device (zero states for unknown
        users); changing them never touches the live state."""
        resident = self.store.read_resident(user_ids)
        if resident is not None:  # every user on the slab: one gather on its device
            return _to(resident, self.device)
        out = self.store.layout.zeros(len(user_ids))
        known = [i for i, u in enumerate(user_ids) if u in self.store]
        if known:
            got = self.store.read([user_ids[i] for i in known])
            out = out.put_rows(torch.tensor(known, dtype=torch.int64), got)
        return _to(out, self.device)

    def stats(self) -> dict[str, Any]:
        return {
            "users": len(self.store),
            "tiers": self.store.tier_counts(),
            "bytes_per_user": self.store.bytes_per_user(),
            "partitions": {p: len(u) for p, u in sorted(self._users_of.items())},
        }


def _to(state: MemoryState, device: torch.device) -> MemoryState:
    if state.S.device == device:
        return state
    return state.to(device)
