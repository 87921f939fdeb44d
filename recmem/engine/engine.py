"""The engine: every user's memory state, latest events and NoteBank notes, and the step that
applies a micro-batch of events to them.

``Engine`` is owned by one thread: the engine loop (recmem/engine/loop.py) under ``recmem
serve`` and ``recmem ingest``; a test, a benchmark or offline evaluation when it drives the
engine itself. It has no lock. An ingest batch is planned (grouped by user, each user's
events in order, vocab-encoded, right-padded [B, T]) and cut into pieces (row sets of
users); each piece is ``begin`` (gather the users' states from the store: a private copy),
``compute`` (ONE ``model.advance`` under ``torch.no_grad`` on that copy; touches nothing
else, so it may run on another thread), ``commit`` (scatter the new states, the latest
events and their query features: q~, or its learned routing projection; partition
bookkeeping) and ``commit_notes`` (the NoteBank's write path). ``apply`` runs them in order.

Read side, for the rank step (recmem/ranking.py, ``RankSources``): ``snapshot`` (copies of
states, never the live tensors), ``recent_events``/``recent_queries`` (and their ``_many`` forms for a batch) and
``route_many``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch._dynamo

from models.recommender import AdvanceResult, MemoryRecommender
from models.state import MemoryState
from recmem.archive import ItemIdRows, NoteBank
from recmem.config import Config
from recmem.engine.dedupe import SeenEvents
from recmem.engine.tails import RecentEvents
from recmem.ranking import Events, ReplayCache, UserEvents
from recmem.rows import row_cells
from recmem.state_store import UserStateStore
from recmem.vocab import ItemVocab
from streams.batch import EventBatch
from streams.validate import ValidEvent

log = logging.getLogger(__name__)


@dataclass
class ApplyCounts:
    """What one ingest batch did."""

    events: int = 0
    users: int = 0
    new_users: int = 0
    duplicates: int = 0
    """Events dropped by the duplicate policy (not counted in ``events``)."""
    max_len: int = 0
    """T: the longest run of one user's events in the batch (the padded width)."""


@dataclass(frozen=True)
class UserInfo:
    """What InspectUser reports about a known user."""

    position: int
    last_ts_ms: int
    unlocked_blocks: int
    total_blocks: int
    note_count: int
    resident_tier: str


@dataclass
class GroupedBatch:
    """A micro-batch grouped by user: right-padded [B, T] arrays and lengths [B]."""

    user_ids: list[str]
    partitions: list[int]
    items: np.ndarray
    actions: np.ndarray
    ts_ms: np.ndarray
    lengths: np.ndarray


def group_events(
    events: Sequence[ValidEvent] | EventBatch, vocab: ItemVocab, *, longest_first: bool = False
) -> GroupedBatch:
    """Group by user in first-appearance order (``longest_first``: users with more events
    first, ties in first-appearance order, the order ``Engine`` runs a piece's users in),
    each user's events in batch order; the same result as :func:`group_events_reference`.
    The users' codes come from one dict built in C (``dict.fromkeys`` keeps first
    appearances in order), the rest is numpy."""
    b = events if isinstance(events, EventBatch) else EventBatch.of(events)
    n = len(b)
    if not n:
        z = np.zeros((0, 0), dtype=np.int64)
        return GroupedBatch([], [], z, z.copy(), z.copy(), np.zeros(0, dtype=np.int64))
    users = list(dict.fromkeys(b.user_id))
    n_users = len(users)
    code_of = dict(zip(users, range(n_users)))
    codes = np.fromiter(map(code_of.__getitem__, b.user_id), dtype=np.int64, count=n)
    lengths = np.bincount(codes, minlength=n_users).astype(np.int64)
    if longest_first:
        rank = np.argsort(-lengths, kind="stable")  # rank[j]: the user that goes to row j
        row_of = np.empty(n_users, dtype=np.int64)
        row_of[rank] = np.arange(n_users)
        codes, lengths = row_of[codes], lengths[rank]
        users = [users[i] for i in rank.tolist()]
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    col = np.empty(n, dtype=np.int64)
    col[order] = np.arange(n) - np.repeat(starts, lengths)
    T = int(lengths.max())
    items = np.zeros((n_users, T), dtype=np.int64)
    actions = np.zeros((n_users, T), dtype=np.int64)
    ts = np.zeros((n_users, T), dtype=np.int64)
    items[codes, col] = vocab.encode(b.item_id)
    actions[codes, col] = b.action
    ts[codes, col] = b.ts_ms
    partitions = np.zeros(n_users, dtype=np.int64)
    partitions[codes] = b.partition  # a user's events share one partition
    return GroupedBatch(users, partitions.tolist(), items, actions, ts, lengths)


def group_events_reference(
    events: Sequence[ValidEvent] | EventBatch, vocab: ItemVocab, *, longest_first: bool = False
) -> GroupedBatch:
    """The plain form of :func:`group_events`: one user at a time, one event at a time."""
    b = events if isinstance(events, EventBatch) else EventBatch.of(events)
    runs: dict[str, list[int]] = {}
    for i, user in enumerate(b.user_id):
        runs.setdefault(user, []).append(i)
    if longest_first:  # sorted() is stable: ties keep their first-appearance order
        runs = dict(sorted(runs.items(), key=lambda kv: -len(kv[1])))
    T = max((len(r) for r in runs.values()), default=0)
    items = np.zeros((len(runs), T), dtype=np.int64)
    actions = np.zeros((len(runs), T), dtype=np.int64)
    ts = np.zeros((len(runs), T), dtype=np.int64)
    partitions = []
    for row, run in enumerate(runs.values()):
        for col, i in enumerate(run):
            items[row, col] = vocab.encode_one(b.item_id[i])
            actions[row, col] = b.action[i]
            ts[row, col] = b.ts_ms[i]
        partitions.append(int(b.partition[run[0]]))
    lengths = np.array([len(r) for r in runs.values()], dtype=np.int64)
    return GroupedBatch(list(runs), partitions, items, actions, ts, lengths)


@dataclass
class IngestPlan:
    """A batch grouped by user and cut into pieces (row sets), each one ``advance``."""

    batch: GroupedBatch
    pieces: list[np.ndarray]
    counts: ApplyCounts


@dataclass
class Piece:
    """One ``advance`` of an ingest batch: the users' events and a private copy of their
    states (``begin``), then the model's result (``compute``)."""

    users: list[str]
    partitions: list[int]
    items: np.ndarray
    actions: np.ndarray
    ts_ms: np.ndarray
    lengths: np.ndarray
    state: MemoryState
    slots: torch.Tensor
    positions: np.ndarray
    """Each user's lifetime position before the piece."""
    packed: bool = False
    """Run by ``advance_packed``: the result's outputs and (k~, q~) are packed, one row per
    event, user by user (``MemoryRecommender.advance_packed``)."""
    result: AdvanceResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    computed: torch.cuda.Event | None = None
    """On a GPU: recorded on the compute stream after the model step (``commit`` waits
    for it on the owner's stream); None on the CPU."""


@dataclass
class EngineTotals:
    """Running figures: events and batches applied (committed), notes written."""

    events: int = 0
    batches: int = 0


class Engine:
    """Per-user memories: the state store, the model's batched update, the latest events
    and the NoteBank archive (``bank``; None: no notes are written and replay finds none).
    ``replay_cache``: user vectors after replay (server.replay_cache_users), forgotten for
    every user the engine changes."""

    def __init__(
        self,
        model: MemoryRecommender,
        vocab: ItemVocab,
        store: UserStateStore,
        cfg: Config,
        bank: NoteBank | None = None,
        model_version: str = "unversioned",
    ) -> None:
        self.model = model.to(store.device).eval()
        self.vocab = vocab
        self.store = store
        self.cfg = cfg
        self.bank = bank
        self.tails = RecentEvents(max(1, cfg.server.replay_query_events))
        self.seen = SeenEvents(cfg.state.dedupe_window)
        self.replay_cache = ReplayCache(cfg.server.replay_cache_users)
        self.model_version = model_version
        self.partition_of: dict[str, int] = {}
        self._users_of: dict[int, set[str]] = {}
        self.serving: set[int] = set()
        """Partitions whose state is complete here (restored and installed, or started
        from nothing): a rank call for a user of another partition is not answered from
        this engine (``EngineLoop.submit(..., partition=)``)."""
        self._dirty: dict[int, set[str]] = {}
        """Per partition: users whose state changed since :meth:`clear_dirty` (deltas)."""
        self.totals = EngineTotals()
        self._names: np.ndarray | None = None
        """The vocabulary's item ids as an array (``_item_ids``), made on first use."""
        self.seconds: dict[str, float] = dict.fromkeys(
            ("group", "gather", "advance", "scatter", "archive", "user_steps"), 0.0
        )
        """Running totals for profiling: seconds per phase of an ingest batch, and
        user_steps (the padded [B, T] cells run, a count)."""
        self._compute_stream: torch.cuda.Stream | None = None
        """On a GPU, ``compute`` runs on this stream of its own, so that the owner's copies
        to the host (latest events, notes, checkpoints) wait only for the work they read,
        not for the next piece's model step queued behind it on one stream."""

    @property
    def device(self) -> torch.device:
        return self.store.device

    # ---- ingest ------------------------------------------------------------------------

    def apply(self, events: Sequence[ValidEvent] | EventBatch) -> ApplyCounts:
        """Apply one micro-batch; every user's position advances by its number of events."""
        return self._run(self.plan(events))

    def apply_grouped(self, batch: GroupedBatch) -> ApplyCounts:
        """``apply`` for events already grouped by user (vocab-encoded; offline evaluation
        feeds the engine this way)."""
        return self._run(self.plan_grouped(batch))

    def _run(self, plan: IngestPlan) -> ApplyCounts:
        for rows in plan.pieces:
            piece = self.begin(plan, rows)
            self.compute(piece)
            self.commit(piece)
            self.commit_notes(piece)
        self.totals.batches += 1
        return plan.counts

    def plan(self, events: Sequence[ValidEvent] | EventBatch) -> IngestPlan:
        """Group a batch (event objects, or columns from consumer processes: the same
        result) by user and cut it into pieces (no state is read or changed; the duplicate
        policy's keys are updated)."""
        t0 = time.perf_counter()
        b = events if isinstance(events, EventBatch) else EventBatch.of(events)
        kept = self.seen.keep(b.user_id, b.key)
        # longest first: the order _pieces runs users in, so that a piece is a range of
        # the batch's rows and begin takes views of its arrays instead of copies
        batch = group_events(
            b if len(kept) == len(b) else b.take(kept), self.vocab, longest_first=True
        )
        self.seconds["group"] += time.perf_counter() - t0
        plan = self.plan_grouped(batch)
        plan.counts.duplicates = len(b) - len(kept)
        return plan

    def plan_grouped(self, batch: GroupedBatch) -> IngestPlan:
        """Cut a grouped batch into pieces."""
        t0 = time.perf_counter()
        counts = ApplyCounts(events=int(batch.lengths.sum()), users=len(batch.user_ids))
        if batch.user_ids:
            counts.max_len = int(batch.lengths.max())
            counts.new_users = len(batch.user_ids) - sum(
                map(self.store.__contains__, batch.user_ids)
            )
        pieces = self._pieces(batch.lengths) if batch.user_ids else []
        self.seconds["group"] += time.perf_counter() - t0
        return IngestPlan(batch, pieces, counts)

    def _pieces(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Row sets of the batch, one ``advance`` each: all rows at once (always with the
        packed step, ``packs``: it computes no padded cells), or (with
        ``state.length_buckets``) users grouped by power-of-two length so that padding stays
        below 2x the events; any set larger than the slab is cut into slab-sized pieces,
        and (``state.piece_cells`` > 0, padded steps) into pieces of at most that many
        padded cells (users x the piece's longest length). Each set lists its users
        longest first.
        Buckets pay on the CPU path (padded steps cost as much as real ones); on the GPU they
        only add launches, so ``auto`` leaves them off there."""
        mode = self.cfg.state.length_buckets
        if self.packs:
            groups = [np.arange(len(lengths))]
        elif mode == "on" or (mode == "auto" and self.device.type == "cpu"):
            bucket = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
            groups = [np.nonzero(bucket == b)[0] for b in np.unique(bucket)[::-1]]
        else:
            groups = [np.arange(len(lengths))]
        # longest first: the chunked CPU scan then runs each chunk on a prefix of the users
        groups = [g[np.argsort(-lengths[g], kind="stable")] for g in groups]
        cap = self.store.capacity
        cells = 0 if self.packs else self.cfg.state.piece_cells
        return [p for g in groups for p in _cut(g, lengths[g], cap, cells)]

    @property
    def packs(self) -> bool:
        """Whether pieces run ``advance_packed`` (``state.packed_advance``: on, or auto on
        the CPU, for a model with the uniform schedule in prefix order)."""
        mode = self.cfg.state.packed_advance
        on = mode == "on" or (mode == "auto" and self.device.type == "cpu")
        return on and self.model.packs

    @property
    def compiles(self) -> bool:
        """Whether the packed step runs compiled (``state.compile_step``: on, or auto where
        the packed step runs and torch.compile is not disabled)."""
        mode = self.cfg.state.compile_step
        return self.packs and (
            mode == "on" or (mode == "auto" and not torch._dynamo.config.disable)
        )

    def compile_step(self) -> None:
        """Compile the packed step (``compiles``) and make its graphs now, on made-up
        batches, so that no real batch waits for a compilation; logs the seconds."""
        t0 = time.perf_counter()
        self.model.compile_packed()
        rounds = self.model.warm_up_packed(self.device)
        log.info(
            "compiled the packed ingest step in %.1f s (%d warm-up batches)",
            time.perf_counter() - t0,
            rounds,
        )

    def begin(self, plan: IngestPlan, rows: np.ndarray) -> Piece:
        """Gather the piece's users (may move users between tiers): a private copy."""
        t0 = time.perf_counter()
        b = plan.batch
        lengths = b.lengths[rows]
        T = int(lengths.max())
        span = _as_range(rows)
        if span is None:
            users = [b.user_ids[i] for i in rows]
            partitions = [b.partitions[i] for i in rows]
            items, actions, ts_ms = (a[rows, :T] for a in (b.items, b.actions, b.ts_ms))
        else:  # ``plan``'s order: the rows' arrays without a copy where they are contiguous
            users, partitions = b.user_ids[span], b.partitions[span]
            items, actions, ts_ms = (
                np.ascontiguousarray(a[span, :T]) for a in (b.items, b.actions, b.ts_ms)
            )
        state, slots = self.store.gather(users)
        piece = Piece(
            users=users,
            partitions=partitions,
            items=items,
            actions=actions,
            ts_ms=ts_ms,
            lengths=lengths,
            state=state,
            slots=slots,
            positions=state.pos.cpu().numpy(),
            packed=self.packs,
        )
        self.seconds["gather"] += time.perf_counter() - t0
        return piece

    @torch.no_grad()
    def compute(self, piece: Piece) -> None:
        """The model step on the piece's private copy. Reads the model only, so it may run
        on another thread than the engine's owner."""
        t0 = time.perf_counter()
        dev = self.device
        if dev.type != "cuda":
            self._advance(piece)
        else:
            if self._compute_stream is None:
                self._compute_stream = torch.cuda.Stream(device=dev)
            stream = self._compute_stream
            stream.wait_stream(torch.cuda.default_stream(dev))  # the gathered states
            with torch.cuda.stream(stream):
                self._advance(piece)
                piece.computed = torch.cuda.Event()
                piece.computed.record(stream)
        piece.seconds["advance"] = time.perf_counter() - t0

    def _advance(self, piece: Piece) -> None:
        dev = self.device
        advance = self.model.advance_packed if piece.packed else self.model.advance
        piece.result = advance(
            torch.from_numpy(piece.items).to(dev),
            torch.from_numpy(piece.actions).to(dev),
            torch.from_numpy(piece.ts_ms).to(dev),
            torch.from_numpy(piece.lengths).to(dev),
            piece.state,
            return_kq=True,
        )
        if piece.result.kq is not None:  # the archive's query features (routing projection)
            k, q = piece.result.kq
            piece.result.kq = (k, self.model.route_features(q))

    def _adopt_result(self, piece: Piece) -> None:
        """Make a piece computed on the compute stream safe to read on the owner's: the
        owner's stream waits for the step, and the caching allocator will not hand the
        result's memory back to the compute stream before the owner's reads of it ran."""
        if piece.computed is None:
            return
        owner = torch.cuda.current_stream(self.device)
        owner.wait_event(piece.computed)
        res = piece.result
        assert res is not None
        tensors = [*res.state.to_fields().values(), res.outputs, *(res.kq or ()), res.user]
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(owner)
        piece.computed = None

    def commit(self, piece: Piece) -> None:
        """The new states, the latest events (and their q~) and the bookkeeping."""
        t0 = time.perf_counter()
        res = piece.result
        assert res is not None and res.kq is not None, "compute the piece first"
        self._adopt_result(piece)
        self.store.scatter(piece.slots, res.state)
        self.tails.observe(
            piece.users, piece.items, piece.actions, piece.ts_ms, piece.lengths, res.kq[1],
            packed=piece.packed,
        )  # fmt: skip
        self._record_many(piece.users, piece.partitions)
        self.replay_cache.forget(piece.users)
        self.totals.events += int(piece.lengths.sum())
        self.seconds["advance"] += piece.seconds.get("advance", 0.0)
        self.seconds["scatter"] += time.perf_counter() - t0
        cells = int(piece.lengths.sum()) if piece.packed else piece.items.size
        self.seconds["user_steps"] += cells

    def commit_notes(self, piece: Piece) -> None:
        """The NoteBank's write path for the piece's events (positions continue after each
        user's position before the piece)."""
        if self.bank is None:
            return
        t0 = time.perf_counter()
        res = piece.result
        assert res is not None and res.kq is not None
        T = piece.items.shape[1]
        event_pos = piece.positions[:, None] + np.arange(1, T + 1)[None, :]
        item_ids = self._item_ids(piece.items, piece.lengths)
        self.bank.observe_batch(
            piece.users, piece.items, item_ids, piece.actions, piece.ts_ms, event_pos,
            piece.lengths, res.kq[0], res.kq[1], packed=piece.packed,
        )  # fmt: skip
        piece.result = None  # the kq tensors are large; nothing needs them any more
        self.seconds["archive"] += time.perf_counter() - t0

    def _item_ids(self, items: np.ndarray, lengths: np.ndarray) -> ItemIdRows:
        """The raw item id of each user's valid events in right-padded ``items`` [B, T]
        (an out-of-vocabulary bucket as ``<oov:j>``), as one array with the counts."""
        if self._names is None:
            self._names = np.empty(self.vocab.n_items, dtype=object)
            self._names[:] = [str(i) for i in self.vocab.item_ids]
        n = self.vocab.n_items
        flat = items[row_cells(np.arange(len(lengths)), lengths)]  # user by user
        known = flat < n
        names = np.empty(len(flat), dtype=object)
        names[known] = self._names[flat[known]]
        if not known.all():
            names[~known] = [f"<oov:{i - n}>" for i in flat[~known].tolist()]
        return ItemIdRows(names, lengths)

    def _record_many(self, users: list[str], partitions: list[int]) -> None:
        """``_record_reference`` of a piece's users: the users already recorded in their
        partition (nearly all after a user's first batch) cost one dict lookup each in C,
        and each partition's users join its dirty set in one update."""
        olds = list(map(self.partition_of.get, users))
        if olds != partitions:
            for user, part, old in zip(users, partitions, olds):
                if old != part:
                    self._record(user, part)
        parts = np.asarray(partitions, dtype=np.int64)
        if not len(parts):
            return
        if (parts == parts[0]).all():
            self._dirty.setdefault(int(parts[0]), set()).update(users)
            return
        order = np.argsort(parts, kind="stable")
        by_part = np.asarray(users, dtype=object)[order]
        cuts = np.flatnonzero(np.diff(parts[order])) + 1
        for p, group in zip(parts[order][np.r_[0, cuts]].tolist(), np.split(by_part, cuts)):
            self._dirty.setdefault(p, set()).update(group.tolist())

    def _record_reference(self, users: list[str], partitions: list[int]) -> None:
        """The plain form of :meth:`_record_many`: one user at a time."""
        for user, part in zip(users, partitions):
            self._record(user, part)
            self._dirty.setdefault(part, set()).add(user)

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

    def dirty_users(self, partition: int) -> list[str]:
        """Users of ``partition`` changed since the last :meth:`clear_dirty` of it."""
        return sorted(self._dirty.get(partition, ()))

    def clear_dirty(self, partition: int) -> None:
        self._dirty.pop(partition, None)

    def export_arrays(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """The users' notes and latest events as flat arrays (with their states from
        ``store.read``, a checkpoint's contents)."""
        arrays = self.bank.state_for_users(user_ids) if self.bank is not None else {}
        arrays.update(self.tails.export(user_ids))
        arrays.update(self.seen.export(user_ids))
        return arrays

    def adopt(
        self,
        partition: int,
        user_ids: list[str],
        state: MemoryState,
        arrays_parts: Sequence[tuple[list[str], dict[str, np.ndarray] | None]] = (),
    ) -> None:
        """Install a partition's restored users: states, then notes and latest events of
        each checkpoint of its chain in order (later parts replace earlier ones)."""
        for _ in self.adopt_steps(partition, user_ids, state, arrays_parts):
            pass

    def adopt_steps(
        self,
        partition: int,
        user_ids: list[str],
        state: MemoryState,
        arrays_parts: Sequence[tuple[list[str], dict[str, np.ndarray] | None]] = (),
        slice_users: int = 4096,
    ) -> Iterator[None]:
        """``adopt`` in steps (the states ``slice_users`` at a time), yielding between them
        so that the engine loop ranks in between; the partition is not ``serving`` until
        its caller says so."""
        for start in range(0, len(user_ids), slice_users):
            rows = user_ids[start : start + slice_users]
            self.store.put(rows, state.index(slice(start, start + len(rows))))
            for user in rows:
                self._record(user, partition)
            yield
        for users, arrays in arrays_parts:
            arrays = arrays or {}
            if self.bank is not None:
                notes = {k: v for k, v in arrays.items() if k.startswith("archive.")}
                if notes:
                    # validated before anything changes: a bad archive keeps the old notes
                    self.bank.load_users(notes, replace=users)
                else:
                    self.bank.drop_users(users)
            self.tails.load(users, arrays)
            self.seen.load(users, arrays)
            yield
        self.replay_cache.forget(user_ids)

    def drop_partition(self, partition: int) -> int:
        """Forget the partition's users (states, notes, latest events); it stops serving."""
        self.serving.discard(partition)
        self._dirty.pop(partition, None)
        users = self._users_of.pop(partition, set())
        for user in users:
            self.partition_of.pop(user, None)
        if self.bank is not None:
            self.bank.drop_users(users)
        self.tails.drop(list(users))
        self.seen.drop(list(users))
        self.replay_cache.forget(list(users))
        return self.store.drop(users)

    # ---- read side: the rank step's sources, inspection --------------------------------

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

    def recent_events(self, user_id: str, n: int) -> UserEvents:
        return self.tails.recent(user_id, n)

    def recent_queries(self, user_id: str, n: int) -> torch.Tensor | None:
        q = self.tails.recent_queries(user_id, n)
        return None if q is None else torch.from_numpy(q)

    def recent_events_many(self, user_ids: Sequence[str], n: int) -> list[UserEvents]:
        return self.tails.recent_many(user_ids, n)

    def recent_queries_many(self, user_ids: Sequence[str], n: int) -> list[torch.Tensor | None]:
        return [
            None if q is None else torch.from_numpy(q)
            for q in self.tails.recent_queries_many(user_ids, n)
        ]

    def route_many(
        self, requests: Sequence[tuple[str, torch.Tensor, int]]
    ) -> Sequence[Sequence[Events]]:
        # the notes themselves (their events are what the rank step reads; votes unset)
        if self.bank is None:
            return [[] for _ in requests]
        return self.bank.route_many(list(requests), votes=False)

    def route_overlap_many(
        self,
        requests: Sequence[tuple[str, Mapping[int, float], Mapping[int, float], int]],
        item_cat: np.ndarray | None,
    ) -> Sequence[Sequence[Events]]:
        if self.bank is None:
            return [[] for _ in requests]
        return self.bank.route_overlap_many(list(requests), item_cat)

    def inspect(self, user_id: str) -> UserInfo | None:
        """InspectUser's answer: position, Proteus blocks, notes, residence tier."""
        if user_id not in self.store:
            return None
        state = self.store.read([user_id])
        pos = int(state.pos[0])
        # adaptive schedules: the most any layer has unlocked
        unlocks = 0 if state.unlocks is None else int(state.unlocks[0].max())
        return UserInfo(
            position=pos,
            last_ts_ms=int(state.last_ts[0]),
            unlocked_blocks=self.model.sched.open_blocks(pos, unlocks),
            total_blocks=self.cfg.memory.n_blocks,
            note_count=self.bank.note_count(user_id) if self.bank is not None else 0,
            resident_tier=self.store.tier_of(user_id),
        )

    def stats(self) -> dict[str, Any]:
        return {
            "users": len(self.store),
            "tiers": self.store.tier_counts(),
            "bytes_per_user": self.store.bytes_per_user(),
            "partitions": {p: len(u) for p, u in sorted(self._users_of.items())},
        }


def _cut(rows: np.ndarray, lengths: np.ndarray, most: int, cells: int) -> list[np.ndarray]:
    """``rows`` (their ``lengths`` non-increasing) cut into consecutive pieces of at most
    ``most`` rows and, with ``cells`` > 0, at most ``cells`` padded cells each (rows x the
    piece's first, longest, length; one row at least)."""
    out = []
    i = 0
    while i < len(rows):
        n = most if cells <= 0 else min(most, max(1, cells // max(int(lengths[i]), 1)))
        out.append(rows[i : i + n])
        i += n
    return out


def _as_range(rows: np.ndarray) -> slice | None:
    """``rows`` as a slice when they are consecutive ascending indices, else None."""
    if not len(rows):
        return None
    r0 = int(rows[0])
    if int(rows[-1]) - r0 + 1 != len(rows) or not bool((np.diff(rows) == 1).all()):
        return None
    return slice(r0, r0 + len(rows))


def _to(state: MemoryState, device: torch.device) -> MemoryState:
    if state.S.device == device:
        return state
    return state.to(device)
