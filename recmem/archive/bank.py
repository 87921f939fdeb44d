"""NoteBank: per-user archive of salient event spans, written at ingest and routed at rank
time (SPEC section 5; docs/archive.md has the design decisions)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recmem.archive.index import (
    GPU_MAX_K,
    UserAddressIndex,
    gpu_resources,
    inner_products_by_rows,
    masked_cosines,
)
from recmem.archive.open_chunks import INT_FIELDS, EventColumns, OpenChunks
from recmem.archive.persist import pack_users, unpack_users
from recmem.archive.routing import (
    overlap_rank,
    route_cosines,
    vote_pick,
    vote_pick_padded,
    vote_rank,
)
from recmem.archive.selection import (
    NORM_EPS,
    address_coords,
    distinctiveness,
    l2_normalise,
    select_spans_many,
    span_addresses_many,
)
from recmem.archive.store import (
    PENDING_DTYPE,
    ItemIdRows,
    Note,
    PendingEvents,
    UserArchive,
    with_votes,
)
from recmem.config import ArchiveConfig
from recmem.rows import ragged_arange

log = logging.getLogger(__name__)


def _numpy(x: Any, dtype: Any) -> np.ndarray:
    """numpy view of a numpy array, torch tensor (any device) or sequence."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.float()  # numpy has no bfloat16
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


_PENDING_TORCH = torch.from_numpy(np.zeros(0, PENDING_DTYPE)).dtype
"""``PENDING_DTYPE`` as a torch dtype."""


def _on_accelerator(x: Any) -> bool:
    """Whether ``x`` is a tensor on a device other than the CPU."""
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _on(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """``x`` as a tensor on ``device`` (a view of it on the CPU)."""
    t = torch.from_numpy(x)
    return t if device.type == "cpu" else t.to(device)


def _valid_cells(x: Any, valid: np.ndarray) -> Any:
    """The rows of ``x`` [B, T, ...] where ``valid`` [B, T] holds, user by user, picked where
    ``x`` lives: only the valid cells of a tensor leave its device (in a padded batch one
    long user can make the padding most of it)."""
    B, T = valid.shape
    if hasattr(x, "detach"):
        return x.reshape(B, T, -1)[torch.as_tensor(valid, device=x.device)]
    return np.asarray(x).reshape(B, T, -1)[valid]


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-d object array of ``values`` (never split into a second axis)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _flat_item_ids(
    item_ids: Sequence[Sequence[str]], lens: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's item ids as one object array of str, event by event (None for a user
    whose count differs from its events'), and whether each user's count matches."""
    if isinstance(item_ids, ItemIdRows):
        flat, id_lens = item_ids.flat, item_ids.lengths
    else:
        id_lens = np.fromiter((len(x) for x in item_ids), dtype=np.int64, count=len(lens))
        flat = _objects([str(i) for ids in item_ids for i in ids])
    ok = id_lens == lens
    if ok.all():
        return flat, ok
    out = np.empty(int(lens.sum()), dtype=object)
    out[ragged_arange(starts[ok], lens[ok])] = flat[
        ragged_arange((np.cumsum(id_lens) - id_lens)[ok], lens[ok])
    ]
    return out, ok


def _distinct_runs(user_ids: Sequence[str], lens: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive row ranges of a batch in which no user with events appears twice."""
    act = np.nonzero(lens)[0].tolist()
    if len({user_ids[b] for b in act}) == len(act):
        return [(0, len(lens))]
    parts: list[tuple[int, int]] = []
    start, seen = 0, set[str]()
    for b in act:
        if user_ids[b] in seen:
            parts.append((start, b))
            start, seen = b, set()
        seen.add(user_ids[b])
    parts.append((start, len(lens)))
    return parts


@dataclass
class _Batch:
    """A batch prepared for buffering: users, events per user and where each user's start
    (``ev``: the valid events, user by user, unit keys and addresses), whether each user's
    item id count matches and whether its keys and queries are finite."""

    user_ids: Sequence[str]
    lens: np.ndarray
    starts: np.ndarray
    ev: EventColumns
    ids_ok: np.ndarray
    finite: np.ndarray

    def rows(self, b0: int, b1: int) -> _Batch:
        e0 = int(self.starts[b0])
        e1 = int(self.starts[b1 - 1] + self.lens[b1 - 1])
        return _Batch(
            self.user_ids[b0:b1], self.lens[b0:b1], self.starts[b0:b1] - e0,
            self.ev.take(np.arange(e0, e1)), self.ids_ok[b0:b1], self.finite[b0:b1],
        )  # fmt: skip


def check_archive_config(cfg: ArchiveConfig) -> None:
    """ValueError naming the first archive setting that cannot work."""
    checks = [
        (cfg.chunk_events >= 1, "archive.chunk_events must be >= 1"),
        (1 <= cfg.window <= cfg.chunk_events, "archive.window must be in 1..chunk_events"),
        (cfg.spans_per_chunk >= 1, "archive.spans_per_chunk must be >= 1"),
        (cfg.max_span >= 1, "archive.max_span must be >= 1"),
        (cfg.session_gap_s >= 0, "archive.session_gap_s must be >= 0"),
        (cfg.address_dim >= 1, "archive.address_dim must be >= 1"),
        (cfg.notes_per_user >= 1, "archive.notes_per_user must be >= 1"),
        (cfg.replay_notes >= 0, "archive.replay_notes must be >= 0"),
        (cfg.min_votes >= 0, "archive.min_votes must be >= 0"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


class NoteBank:
    """Notes of many users with one FAISS address index per user.

    ``key_dim`` is K, ``query_dim`` the dimension of the query features the model routes
    with (K, or ``model.route_dim`` with a learned routing projection; default K), and
    ``n_channels`` is C_ch = L * H (channel c = layer * H + head, the
    row-major flattening of the model's [L, H] axes). ``seed`` fixes the coordinate
    selection P (stored in the state and checked on load). ``use_gpu``: None = a GPU index
    when faiss has GPU support and sees a device. ``route_device``: where the batched route
    (``route_many``) computes its cosines and vote: None = numpy and faiss on the CPU (the
    default), a torch device = torch there (``archive.route_device = rank``).
    All methods are thread-safe.
    """

    def __init__(
        self,
        cfg: ArchiveConfig,
        key_dim: int,
        n_channels: int,
        seed: int = 0,
        *,
        use_gpu: bool | None = None,
        query_dim: int | None = None,
        route_device: torch.device | str | None = None,
    ) -> None:
        check_archive_config(cfg)
        self.route_device = None if route_device is None else torch.device(route_device)
        if key_dim < 1 or n_channels < 1:
            raise ValueError("key_dim and n_channels must be >= 1")
        self.cfg = cfg
        self.key_dim = key_dim
        self.query_dim = key_dim if query_dim is None else query_dim
        if self.query_dim < 1:
            raise ValueError("query_dim must be >= 1")
        self.n_channels = n_channels
        # d_rho cannot exceed K: a small model selects all of its key coordinates.
        self.coords = address_coords(self.query_dim, min(cfg.address_dim, self.query_dim), seed)
        self._coords_on: dict[torch.device, torch.Tensor] = {}  # self.coords per device
        self._gpu = gpu_resources(use_gpu)
        if self._gpu is not None and cfg.notes_per_user * n_channels > GPU_MAX_K:
            log.warning(
                "NoteBank: %d notes x %d channels exceed a GPU search (k <= %d); CPU indexes",
                cfg.notes_per_user, n_channels, GPU_MAX_K,
            )  # fmt: skip
            self._gpu = None
        self._open = OpenChunks(cfg.chunk_events, n_channels, key_dim, len(self.coords))
        """Every user with archive state has a row here: open chunk and last position."""
        self._no_pending = PendingEvents.empty(n_channels, key_dim, len(self.coords))
        self._users: dict[str, UserArchive] = {}
        """Notes and their count of the users with notes (``pending`` and
        ``last_position`` unused: ``_open`` has them)."""
        self._indexes: dict[str, UserAddressIndex] = {}
        self._lock = threading.RLock()

    # ---- write path -------------------------------------------------------------------

    def address(self, q: Any) -> np.ndarray:
        """u = P q: [..., C_ch, K] (or [..., L, H, K]) queries -> [..., C_ch, d_rho]."""
        arr = _numpy(q, np.float32)
        if arr.shape[-1] != self.query_dim:
            raise ValueError(f"queries end in {arr.shape[-1]} dims, query_dim is {self.query_dim}")
        return arr[..., self.coords]

    def _channels(self, x: Any, n: int, what: str, dim: int) -> np.ndarray:
        arr = _numpy(x, np.float32)
        if arr.ndim >= 2 and arr.shape[0] == n and arr.shape[-1] == dim:
            arr = arr.reshape(n, -1, dim)
        if arr.shape != (n, self.n_channels, dim):
            raise ValueError(
                f"{what} must be [{n}, {self.n_channels}, {dim}] "
                f"(or [{n}, L, H, {dim}]), got {list(arr.shape)}"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{what} has non-finite values")
        return arr

    def observe(
        self,
        user_id: str,
        items: Any,
        item_ids: Sequence[str],
        actions: Any,
        ts_ms: Any,
        positions: Any,
        k: Any,
        q: Any,
    ) -> int:
        """Buffer one user's new events (in order; k, q: the masked normalised keys and
        queries [T, C_ch, K] or [T, L, H, K]) and write notes for every chunk of
        ``chunk_events`` that closes. Returns the number of notes written."""
        items_a = _numpy(items, np.int64).reshape(-1)
        n = len(items_a)
        ev = [_numpy(x, np.int64).reshape(-1) for x in (actions, ts_ms, positions)]
        ids = [str(i) for i in item_ids]
        if any(len(x) != n for x in ev) or len(ids) != n:
            raise ValueError("items, item_ids, actions, ts_ms and positions differ in length")
        if n == 0:
            return 0
        new = EventColumns(
            np.stack([items_a, *ev], axis=1),
            _objects(ids),
            l2_normalise(self._channels(k, n, "keys", self.key_dim)).astype(PENDING_DTYPE),
            l2_normalise(self.address(self._channels(q, n, "queries", self.query_dim))).astype(
                PENDING_DTYPE
            ),
        )
        one = np.array([n], dtype=np.int64)
        batch = _Batch(
            [user_id], one, np.zeros(1, np.int64), new, np.ones(1, bool), np.ones(1, bool)
        )
        with self._lock:
            users, chunks, rejected = self._buffer_batch(batch)
            if rejected:
                raise ValueError(rejected[0][1])
            return self._write(users, chunks)

    def observe_batch(
        self,
        user_ids: Sequence[str],
        items: Any,
        item_ids: Sequence[Sequence[str]],
        actions: Any,
        ts_ms: Any,
        positions: Any,
        lengths: Any,
        k: Any,
        q: Any,
        *,
        packed: bool = False,
    ) -> int:
        """``observe`` for a right-padded batch: [B, T] event arrays, ``lengths`` [B],
        k, q [B, T, L, H, K] (as the model's advance returns them; moved off the device
        once), or with ``packed`` [N, L, H, K], one row per valid event, user by user (as
        ``advance_packed`` returns them). ``item_ids[b]`` lists user b's valid events only
        (an ``ItemIdRows`` holds them all in one array). A user whose events are rejected
        (see ``observe``) is skipped with a warning; the others go on. Returns notes
        written."""
        arrays = [_numpy(x, np.int64) for x in (items, actions, ts_ms, positions)]
        lens = _numpy(lengths, np.int64).reshape(-1)
        if len(user_ids) != len(lens) or len(item_ids) != len(lens):
            raise ValueError("user_ids, item_ids and lengths differ in batch size")
        if len(lens) == 0 or int(lens.max()) == 0:
            return 0
        T = int(arrays[0].shape[1])
        N = int(lens.sum())
        if int(lens.max()) > T or int(lens.min()) < 0:
            raise ValueError(f"lengths must be in 0..{T} (the padded arrays' T)")
        # the unit keys and addresses of the batch's events at once (packed: one row per
        # event, user by user)
        if not packed:
            valid = np.arange(T)[None, :] < lens[:, None]
            k, q = _valid_cells(k, valid), _valid_cells(q, valid)
        # sequences as arrays (tensors stay where they are), then one size check for both paths
        k, q = (x if isinstance(x, torch.Tensor) else _numpy(x, np.float32) for x in (k, q))
        for x, dim in ((k, self.key_dim), (q, self.query_dim)):
            if math.prod(x.shape) != N * self.n_channels * dim:
                raise ValueError(
                    f"k and q must be [B, T, {self.n_channels}, K={self.key_dim} | "
                    f"query_dim={self.query_dim}] (or [B, T, L, H, ...], or packed), got "
                    f"{list(k.shape)}, {list(q.shape)}"
                )
        if _on_accelerator(k) and _on_accelerator(q):
            # normalised where they live, so that only the pending chunks' half floats (and
            # of q only the address coordinates) leave the GPU; on the CPU numpy is as fast
            k_unit, u_unit, finite = self._units_of_tensors(k, q, N)
        else:
            k_a = _numpy(k, np.float32).reshape(N, -1, self.key_dim)
            q_a = _numpy(q, np.float32).reshape(N, -1, self.query_dim)
            finite = np.isfinite(k_a).all(axis=(1, 2)) & np.isfinite(q_a).all(axis=(1, 2))
            k_unit = l2_normalise(k_a).astype(PENDING_DTYPE)
            u_unit = l2_normalise(q_a[..., self.coords]).astype(PENDING_DTYPE)
        starts = np.cumsum(lens) - lens
        ids, ids_ok = _flat_item_ids(item_ids, lens, starts)
        cells = ragged_arange(np.arange(len(lens)) * T, lens)  # the valid cells of [B, T]
        ints = np.stack([a[:, :T].reshape(-1)[cells] for a in arrays], axis=1)
        active = np.nonzero(lens)[0]
        finite_user = np.ones(len(lens), dtype=bool)
        finite_user[active] = np.logical_and.reduceat(finite, starts[active])
        batch = _Batch(
            user_ids, lens, starts, EventColumns(ints, ids, k_unit, u_unit), ids_ok, finite_user
        )
        with self._lock:
            users, chunks, rejected = self._buffer_batch(batch)
            for b, why in rejected:
                # One user's inconsistent events must not stop the others' (nor ingest).
                log.warning(
                    "NoteBank: skipped %d events of user %r: %s", int(lens[b]), user_ids[b], why
                )
            return self._write(users, chunks)

    def _units_of_tensors(
        self, k: torch.Tensor, q: torch.Tensor, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``observe_batch``'s unit keys, unit address queries (as ``PENDING_DTYPE``) and
        whether each event's k and q are finite, computed on the tensors' device: the
        torch form of ``l2_normalise`` (fp32, zero rows stay zero; the same values as the
        numpy path within fp32 rounding before the cast to half)."""
        k32 = k.detach().reshape(n, self.n_channels, self.key_dim).float()
        q32 = q.detach().reshape(n, self.n_channels, self.query_dim).float()
        finite = torch.isfinite(k32).flatten(1).all(1) & torch.isfinite(q32).flatten(1).all(1)
        coords = self._coords_on.get(q32.device)
        if coords is None:
            coords = self._coords_on[q32.device] = torch.as_tensor(self.coords, device=q32.device)

        def unit(x: torch.Tensor) -> torch.Tensor:
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            return torch.where(norm > NORM_EPS, x / norm, 0.0).to(_PENDING_TORCH)

        return unit(k32).cpu().numpy(), unit(q32[..., coords]).cpu().numpy(), finite.cpu().numpy()

    def _buffer_batch(
        self, batch: _Batch
    ) -> tuple[list[str], EventColumns | None, list[tuple[int, str]]]:
        """Buffer a prepared batch; returns the chunks that closed (the owner of each,
        and their events chunk after chunk) and the rejected users (batch row, reason).
        A batch naming a user twice runs as consecutive parts that do not."""
        parts = _distinct_runs(batch.user_ids, batch.lens)
        if len(parts) == 1:
            return self._buffer_distinct(batch, 0)
        users: list[str] = []
        chunks: list[EventColumns] = []
        rejected: list[tuple[int, str]] = []
        for b0, b1 in parts:
            u, c, r = self._buffer_distinct(batch.rows(b0, b1), b0)
            users += u
            chunks += [c] if c is not None else []
            rejected += r
        return users, EventColumns.concat(chunks) if chunks else None, rejected

    def _buffer_distinct(
        self, batch: _Batch, b_offset: int
    ) -> tuple[list[str], EventColumns | None, list[tuple[int, str]]]:
        """``_buffer_batch`` of a batch that names each user once, with numpy over the whole
        batch: checks, one append of every user's events whose chunk stays open, and the
        closing users' chunks cut from their buffered and new events together."""
        oc, C = self._open, self.cfg.chunk_events
        act = np.nonzero(batch.lens)[0]
        uids = [batch.user_ids[b] for b in act.tolist()]
        rows = oc.rows.lookup(uids)
        n, s = batch.lens[act], batch.starts[act]
        pos = batch.ev.ints[:, 3]
        last = np.where(rows >= 0, oc.last[np.maximum(rows, 0)] if len(oc.last) else -1, -1)
        viol = np.zeros(len(pos), dtype=bool)
        viol[1:] = pos[1:] <= pos[:-1]
        viol[s] = pos[s] <= last
        bad_pos = np.logical_or.reduceat(viol, s) if len(act) else viol[:0]
        bad_ids, bad_keys = ~batch.ids_ok[act], ~batch.finite[act]
        rejected = []
        for i in np.nonzero(bad_ids | bad_keys | bad_pos)[0].tolist():
            if bad_ids[i]:
                why = "item_ids differ in length from the user's events"
            elif bad_keys[i]:
                why = "keys or queries have non-finite values"
            else:
                got = pos[s[i] : s[i] + n[i]][:4].tolist()
                why = (
                    f"user {uids[i]!r}: positions must increase (last seen {int(last[i])}, "
                    f"got {got}...)"
                )
            rejected.append((int(act[i]) + b_offset, why))
        ok = ~(bad_ids | bad_keys | bad_pos)
        if not ok.all():
            act, n, s, rows = act[ok], n[ok], s[ok], rows[ok]
            uids = [u for u, keep in zip(uids, ok.tolist()) if keep]
        new = np.nonzero(rows < 0)[0]
        rows[new] = oc.add_users([uids[i] for i in new.tolist()])
        if not len(act):
            return [], None, rejected
        cnt = oc.count[rows].astype(np.int64)
        tot = cnt + n
        m = tot // C
        cl = m > 0
        stay = ~cl
        app_rows = [rows[stay]]
        app_lens = [n[stay]]
        everyone = bool(stay.all()) and len(act) == int(np.count_nonzero(batch.lens))
        # (the batch's events are its own arrays: when all of them stay, no copy is taken)
        app_ev = [batch.ev if everyone else batch.ev.take(ragged_arange(s[stay], n[stay]))]
        users: list[str] = []
        chunks = None
        if cl.any():
            # each closing user's buffered events, then its new ones; the first m * C of
            # them close, the rest is the new open chunk
            rc, cc, nc, tc, mc = rows[cl], cnt[cl], n[cl], tot[cl], m[cl]
            old = oc.gather(rc)
            src = EventColumns.concat([old, batch.ev.take(ragged_arange(s[cl], nc))])
            out_off = np.cumsum(tc) - tc
            seq = np.empty(int(tc.sum()), dtype=np.int64)
            seq[ragged_arange(out_off, cc)] = ragged_arange(np.cumsum(cc) - cc, cc)
            seq[ragged_arange(out_off + cc, nc)] = len(old) + ragged_arange(np.cumsum(nc) - nc, nc)
            chunks = src.take(seq[ragged_arange(out_off, mc * C)])
            rest = tc - mc * C
            oc.clear(rc)
            app_rows.append(rc)
            app_lens.append(rest)
            app_ev.append(src.take(seq[ragged_arange(out_off + mc * C, rest)]))
            users = [
                u for u, k in zip([u for u, c in zip(uids, cl.tolist()) if c], mc.tolist())
                for _ in range(k)
            ]  # fmt: skip
        oc.append(np.concatenate(app_rows), np.concatenate(app_lens), EventColumns.concat(app_ev))
        oc.last[rows] = pos[s + n - 1]
        return users, chunks, rejected

    def _archive(self, user_id: str) -> UserArchive:
        """The user's notes and their count (made with the user's first note)."""
        ua = self._users.get(user_id)
        if ua is None:
            ua = self._users[user_id] = UserArchive(self._no_pending)
        return ua

    def _write(self, users: list[str], chunks: EventColumns | None) -> int:
        """Notes of closed chunks (``users[i]`` owns chunk i, events ``chunk_events * i``
        on; several users', each user's in order): distinctiveness, spans and addresses of
        all of them at once, then each user's notes stored and indexed. Returns the number
        of notes written."""
        if not users or chunks is None:
            return 0
        cfg = self.cfg
        m, C = len(users), cfg.chunk_events
        ints = chunks.ints.reshape(m, C, 4)
        ids = chunks.ids.reshape(m, C)
        d = distinctiveness(chunks.k.reshape(m, C, *chunks.k.shape[1:]))  # [m, n, C_ch]
        spans = select_spans_many(
            d.sum(axis=2), ints[:, :, 2], window=cfg.window,
            n_spans=cfg.spans_per_chunk, max_span=cfg.max_span, gap_ms=cfg.session_gap_s * 1000.0,
        )  # fmt: skip
        where = np.array([(i, a, b) for i, sp in enumerate(spans) for a, b in sp], np.int64)
        if not len(where):
            return 0
        u = chunks.u.reshape(m, C, *chunks.u.shape[1:])
        addresses = span_addresses_many(d, u, where[:, 0], where[:, 1], where[:, 2])
        written: dict[str, list[Note]] = {}
        for (i, start, end), rho in zip(where.tolist(), addresses):
            user_id = users[i]
            ua = self._archive(user_id)
            ev = ints[i, start:end]
            written.setdefault(user_id, []).append(
                Note(
                    serial=ua.n_written,
                    items=ev[:, 0].copy(),
                    item_ids=tuple(ids[i, start:end].tolist()),
                    actions=ev[:, 1].copy(),
                    ts_ms=ev[:, 2].copy(),
                    positions=ev[:, 3].copy(),
                    addresses=rho,
                )
            )
            ua.n_written += 1
        for user_id, notes in written.items():
            self._store(user_id, self._users[user_id], notes)
        return len(where)

    def _store(self, user_id: str, ua: UserArchive, written: list[Note]) -> None:
        ua.notes.extend(written)
        index = self._indexes.get(user_id)
        if index is None:
            index = self._indexes[user_id] = self._new_index()
        excess = len(ua.notes) - self.cfg.notes_per_user
        if excess > 0:
            del ua.notes[:excess]
            index.rebuild(ua.addresses())
        else:
            index.add(np.stack([n.addresses for n in written]))

    def _new_index(self) -> UserAddressIndex:
        return UserAddressIndex(self.n_channels, len(self.coords), self._gpu)

    # ---- route ------------------------------------------------------------------------

    def route(self, user_id: str, q: Any, r: int | None = None) -> list[Note]:
        """Top-``r`` notes for queries q~ [n, C_ch, K] (or [n, L, H, K], or one position
        [C_ch, K]); see ``route_addresses``."""
        return self.route_many([(user_id, q, r)])[0]

    def route_many(
        self, requests: Sequence[tuple[str, Any, int | None]], votes: bool = True
    ) -> list[list[Note]]:
        """``route`` for several (user, q~, r) requests at once (a rank micro-batch), the
        same notes as ``route_many_plain`` gives: the queries leave their device in one
        piece, and every request's cosines with its user's notes (read from that user's
        index, never another's) and the vote of all requests are one computation over the
        batch, on ``route_device`` (``_route_rows``). ``votes``
        False: the stored notes themselves, not a copy of each with its ``votes`` set (the
        rank step reads only their events; the route of a GPU index sets them still)."""
        if self._gpu is not None:  # a GPU index's rows cannot be read off the host
            return self.route_many_plain(requests)
        qs = [q for _, q, _ in requests]
        shapes = [tuple(q.shape) for q in qs]
        dims = [self._query_dims(s) for s in shapes]
        lens = np.array([n for n, _ in dims], dtype=np.int64)
        bad = [k for _, k in dims if k != self.query_dim]
        if bad:
            raise ValueError(f"queries end in {bad[0]} dims, query_dim is {self.query_dim}")
        if qs and all(isinstance(q, torch.Tensor) for q in qs):
            if len({q.device for q in qs}) > 1:
                qs = [q.detach().cpu() for q in qs]
            if len(set(s[1:] for s in shapes)) == 1 and len(shapes[0]) in (3, 4):
                whole = torch.cat(qs)  # [n, L, H, K] or [n, C_ch, K] alike: no reshape each
            else:
                whole = torch.cat([q.reshape(-1, q.shape[-1]) for q in qs])
            stacked = _numpy(whole, np.float32).reshape(int(lens.sum()), self.n_channels, -1)
        else:
            parts = [_numpy(q, np.float32).reshape(-1, self.n_channels, k) for q, (_, k) in
                     zip(qs, dims, strict=True)]  # fmt: skip
            stacked = np.concatenate(
                parts or [np.zeros((0, self.n_channels, self.query_dim), np.float32)]
            )
        rows = self.address(stacked)  # [sum n, C_ch, d_rho]
        rs = [r for _, _, r in requests]
        return self._route_rows([u for u, _, _ in requests], rows, lens, rs, votes)

    def route_many_plain(self, requests: Sequence[tuple[str, Any, int | None]]) -> list[list[Note]]:
        """The plain reference of ``route_many``: request after request, its user's index
        searched and the vote of that request alone (``_route_one``). Also the route of
        GPU indexes."""
        out = []
        for user_id, q, r in requests:
            arr = _numpy(q, np.float32)
            n, k = self._query_dims(arr.shape)
            out.append(self._route_one(user_id, self.address(arr.reshape(n, -1, k)), r))
        return out

    def _query_dims(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(query positions, feature dims) of queries of ``shape``: [n, C_ch, K],
        [n, L, H, K] or one position [C_ch, K] or [L, H, K] (a 3-d shape merges its
        leading axes only when it cannot be [n, C_ch, K])."""
        ch = self.n_channels
        merge_lh = len(shape) == 4 or (len(shape) == 3 and shape[-2] != ch)
        if merge_lh and shape[-3] * shape[-2] == ch:
            shape = (*shape[:-3], ch, shape[-1])
        if len(shape) not in (2, 3) or shape[-2] != ch:
            raise ValueError(f"queries must be [n, {ch}, K] or [n, L, H, K], got {list(shape)}")
        return (shape[0] if len(shape) == 3 else 1), shape[-1]

    def route_addresses(self, user_id: str, u: Any, r: int | None = None) -> list[Note]:
        """Each channel votes for the user's note whose address is the most cosine-similar
        to any of its query addresses u [n, C_ch, d_rho] (max over the n query positions);
        channels whose queries are all zero abstain. Notes are ranked by votes, then by
        the sum over voting channels of their best cosine, then recency; the top ``r``
        (default archive.replay_notes) are returned in chronological order with ``votes``
        set. With few channels fewer than r notes may get votes: the ranking then fills
        up with unvoted notes by the same summed cosine, unless ``archive.min_votes`` > 0:
        then only notes with at least that many votes are returned (possibly none). A user
        without notes gets []."""
        u_a = self._unit_rows(u)
        if self._gpu is not None:
            return self._route_one(user_id, u_a, r)
        return self._route_rows([user_id], u_a, np.array([len(u_a)]), [r])[0]

    def _unit_rows(self, u: Any) -> np.ndarray:
        """Query addresses [n, C_ch, d_rho] (or one position [C_ch, d_rho]) as [n, C_ch,
        d_rho] float32; ValueError for another shape or non-finite values."""
        ch, d = self.n_channels, len(self.coords)
        u_a = _numpy(u, np.float32)
        if u_a.ndim == 2:
            u_a = u_a[None]
        if u_a.ndim != 3 or u_a.shape[1:] != (ch, d):
            raise ValueError(f"query addresses must be [n, {ch}, {d}], got {list(u_a.shape)}")
        if not np.all(np.isfinite(u_a)):
            raise ValueError("query addresses have non-finite values")
        return u_a

    def _r(self, r: int | None) -> int:
        r_ = self.cfg.replay_notes if r is None else r
        if r_ < 0:
            raise ValueError(f"r must be >= 0, got {r_}")
        return r_

    def _route_one(self, user_id: str, u: np.ndarray, r: int | None) -> list[Note]:
        """``route_addresses`` of one request, plainly: its user's index searched, the vote
        (``vote_rank``) of this request alone."""
        r_ = self._r(r)
        unit = l2_normalise(self._unit_rows(u))
        live = np.linalg.norm(unit, axis=-1) > 0  # [n, C_ch]
        if r_ == 0 or not live.any():
            return []
        with self._lock:
            ua = self._users.get(user_id)
            if ua is None or not ua.notes:
                return []
            index = self._indexes[user_id]
            raw = index.inner_products(unit)  # [n, C_ch, notes]
            opened = index.open_dims
            notes = list(ua.notes)
        has_note = np.ones((1, len(notes)), dtype=bool)
        (picked,), votes = vote_rank(
            raw[None], unit[None], opened[None], has_note, live[None], [r_], self.cfg.min_votes
        )
        return [with_votes(notes[k], int(votes[0, k])) for k in picked]

    def _route_rows(
        self,
        user_ids: Sequence[str],
        rows: np.ndarray,
        lens: np.ndarray,
        rs: Sequence[int | None],
        votes: bool = True,
    ) -> list[list[Note]]:
        """``route_addresses`` for many requests, query addresses ``rows`` [sum lens, C_ch,
        d_rho] request after request (``lens`` [U] positions each), scored against their
        users' notes (rows read in place from the users' indexes) and voted on at once: in
        numpy on the CPU (``_vote_rows``), or in torch on ``route_device`` when one is set
        (``_vote_padded``)."""
        ch, d = self.n_channels, len(self.coords)
        U = len(user_ids)
        out: list[list[Note]] = [[] for _ in range(U)]
        rs_ = np.array([self._r(r) for r in rs], dtype=np.int64)
        if U == 0:
            return out
        if rows.shape[1:] != (ch, d) or len(rows) != int(lens.sum()):
            raise ValueError(f"query addresses must be [n, {ch}, {d}], got {list(rows.shape)}")
        if not np.all(np.isfinite(rows)):
            raise ValueError("query addresses have non-finite values")
        unit = l2_normalise(rows)
        live = np.linalg.norm(unit, axis=-1) > 0  # [M, C_ch]
        starts = np.cumsum(lens) - lens
        live_rows = np.concatenate([[0], np.cumsum(live.any(axis=1))])
        asked = (rs_ > 0) & (live_rows[starts + lens] > live_rows[starts])
        todo: list[int] = []
        stored: list[np.ndarray] = []
        opened: list[np.ndarray] = []
        notes: list[list[Note]] = []
        with self._lock:
            for i in np.flatnonzero(asked).tolist():
                ua = self._users.get(user_ids[i])
                if ua is None or not ua.notes:
                    continue
                index = self._indexes[user_ids[i]]
                got = index.rows()
                assert got is not None, "a CPU index"
                todo.append(i)
                stored.append(got)
                opened.append(index.open_dims)
                notes.append(list(ua.notes))
            if not todo:
                return out
            counts = np.array([len(x) for x in notes], dtype=np.int64)  # notes per request
            if self.route_device is None:
                note_rows = np.concatenate(stored)  # copied while the views are valid
            else:
                pad = self._pad_notes(stored, opened, counts)
        if self.route_device is None:
            picked, counted = self._vote_rows(unit, live, lens, starts, todo, note_rows, opened,
                                              counts, rs_)  # fmt: skip
        else:
            picked, counted = self._vote_padded(unit, lens, starts, todo, *pad, counts, rs_)
        ws, ks = np.nonzero(picked)  # request by request, chronological
        if not votes:
            for w, k in zip(ws.tolist(), ks.tolist(), strict=True):
                out[todo[w]].append(notes[w][k])
            return out
        for w, k, v in zip(ws.tolist(), ks.tolist(), counted[ws, ks].tolist(), strict=True):
            out[todo[w]].append(with_votes(notes[w][k], v))
        return out

    def _vote_rows(
        self,
        unit: np.ndarray,
        live: np.ndarray,
        lens: np.ndarray,
        starts: np.ndarray,
        todo: list[int],
        note_rows: np.ndarray,
        opened: list[np.ndarray],
        counts: np.ndarray,
        rs_: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The vote of ``_route_rows`` on the CPU (numpy): one faiss call scores every query
        row of the ``todo`` requests against its user's notes (``note_rows``, the users' rows
        one after another, labels per request); ``vote_pick`` runs on those rows unpadded."""
        ch, d = self.n_channels, len(self.coords)
        W, N = len(todo), int(counts.max())
        n_w = lens[todo]
        # the query rows of each request, and which request and position each is
        q_rows = ragged_arange(starts[todo], n_w)
        w_of = np.repeat(np.arange(W), n_w)
        # labels: query row (tau, c) of request w meets row off_w + i * C_ch + c of its
        # user's note i (-1 past the user's notes)
        off = np.cumsum(counts * ch) - counts * ch
        note_i = np.arange(N)
        labels = off[w_of][:, None, None] + note_i * ch + np.arange(ch)[:, None]
        labels = np.where(note_i < counts[w_of][:, None, None], labels, -1)  # [Mw, C_ch, N]
        raw = inner_products_by_rows(unit[q_rows].reshape(-1, d), note_rows, labels.reshape(-1, N))
        has_note = note_i[None, :] < counts[:, None]
        open_ = np.zeros((W, N, ch), dtype=np.int64)
        open_[has_note] = np.concatenate(opened)
        cos = masked_cosines(raw.reshape(-1, 1, ch, N), unit[q_rows, None], open_[w_of])
        return vote_pick(cos[:, 0], live[q_rows], n_w, has_note, rs_[todo], self.cfg.min_votes)

    def _pad_notes(
        self, stored: list[np.ndarray], opened: list[np.ndarray], counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each request's notes [W, N, C_ch, d] and open prefixes [W, N, C_ch], padded."""
        ch, d = self.n_channels, len(self.coords)
        W, N = len(stored), int(counts.max())
        note_pad = np.zeros((W, N, ch, d), dtype=np.float32)
        open_ = np.zeros((W, N, ch), dtype=np.int64)
        for w, (got, op) in enumerate(zip(stored, opened, strict=True)):
            note_pad[w, : len(op)] = got.reshape(-1, ch, d)
            open_[w, : len(op)] = op
        return note_pad, open_

    def _vote_padded(
        self,
        unit: np.ndarray,
        lens: np.ndarray,
        starts: np.ndarray,
        todo: list[int],
        note_pad: np.ndarray,
        open_: np.ndarray,
        counts: np.ndarray,
        rs_: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The vote of ``_route_rows`` on ``route_device`` (torch): the requests padded,
        ``route_cosines`` and ``vote_pick_padded`` there, three copies in and one out."""
        ch, d = self.n_channels, len(self.coords)
        W, N = note_pad.shape[:2]
        n_w = lens[todo]
        n = int(n_w.max())
        q_rows = ragged_arange(starts[todo], n_w)
        if bool((n_w == n).all()):
            q = unit[q_rows].reshape(W, n, ch, d)
        else:  # padded with zero rows
            q = np.zeros((W, n, ch, d), dtype=np.float32)
            q[np.arange(n)[None, :] < n_w[:, None]] = unit[q_rows]
        dev = self.route_device
        assert dev is not None
        ints = _on(np.concatenate([open_.reshape(-1), counts, rs_[todo]]), dev)
        open_d, counts_d, rs_d = ints.split([open_.size, W, W])
        q_d = _on(q, dev)
        live_d = (q_d != 0).any(dim=-1)  # unit rows: nonzero exactly where live
        has_note_d = torch.arange(N, device=dev)[None, :] < counts_d[:, None]
        cos = route_cosines(q_d, _on(note_pad, dev), open_d.view(W, N, ch))
        picked, votes = vote_pick_padded(cos, live_d, has_note_d, rs_d, self.cfg.min_votes)
        both = torch.stack([picked.long(), votes]).cpu().numpy()  # one copy back
        return both[0].astype(bool), both[1]

    def route_overlap_many(
        self,
        requests: Sequence[tuple[str, Mapping[int, float], Mapping[int, float], int | None]],
        item_cat: np.ndarray | None,
    ) -> list[list[Note]]:
        """Lexical / candidate-aware routing (``archive.routing``; recmem/archive/routing.py
        ``overlap_rank``) for (user, item weights, category weights, r) requests: the top r
        notes by the weights of their events' items and categories (``item_cat``: the
        category of each item index; None: items only), in chronological order."""
        out: list[list[Note]] = []
        with self._lock:
            for user_id, item_w, cat_w, r in requests:
                ua = self._users.get(user_id)
                r_ = self.cfg.replay_notes if r is None else r
                if ua is None or not ua.notes or r_ <= 0:
                    out.append([])
                    continue
                picked = overlap_rank([n.items for n in ua.notes], item_w, cat_w, item_cat, r_)
                out.append([ua.notes[k] for k in picked])
        return out

    # ---- inspection -------------------------------------------------------------------

    def users(self) -> list[str]:
        """Users with archive state (notes or buffered events)."""
        with self._lock:
            return list(self._open.rows.of)

    def notes(self, user_id: str) -> list[Note]:
        """The user's notes, chronological (oldest first)."""
        with self._lock:
            ua = self._users.get(user_id)
            return list(ua.notes) if ua is not None else []

    def note_count(self, user_id: str) -> int:
        with self._lock:
            ua = self._users.get(user_id)
            return len(ua.notes) if ua is not None else 0

    def pending_count(self, user_id: str) -> int:
        """Events buffered in the user's open chunk."""
        with self._lock:
            row = self._open.rows.of.get(user_id)
            return int(self._open.count[row]) if row is not None else 0

    # ---- persistence ------------------------------------------------------------------

    def state_for_users(self, user_ids: Iterable[str]) -> dict[str, np.ndarray]:
        """The archive state of ``user_ids`` (notes, addresses, open chunks) as flat numpy
        arrays; users without archive state are left out."""
        with self._lock:
            return pack_users(
                self._user_archives(user_ids), self.coords, self.key_dim, self.n_channels
            )

    def _user_archives(self, user_ids: Iterable[str]) -> list[tuple[str, UserArchive]]:
        """Whole ``UserArchive`` copies (open chunk and last position included) of the users
        of ``user_ids`` with archive state, each once."""
        oc = self._open
        users = [u for u in dict.fromkeys(user_ids) if u in oc]
        out = []
        for u, pending in zip(users, oc.pending(users)):
            ua = self._users.get(u)
            notes, n_written = (ua.notes, ua.n_written) if ua is not None else ([], 0)
            out.append((u, UserArchive(pending, notes, n_written, int(oc.last[oc.rows.of[u]]))))
        return out

    def load_users(self, state: Mapping[str, np.ndarray], replace: Iterable[str] = ()) -> int:
        """Replace the archive of every user in ``state`` (from ``state_for_users``) and
        rebuild their indexes; users named in ``replace`` but absent from ``state`` are
        dropped. Validates all of it first: on ValueError nothing changed.
        Returns the number of users loaded."""
        users = unpack_users(state, self.coords, self.key_dim, self.n_channels)
        with self._lock:
            present = {uid for uid, _ in users}
            for uid in replace:
                if uid not in present:
                    self._forget(uid)
            self._install(users)
        log.debug("NoteBank: loaded %d users", len(users))
        return len(users)

    def _install(self, users: list[tuple[str, UserArchive]]) -> None:
        """Take over loaded users (notes capped, indexes rebuilt)."""
        self._open.put([(uid, ua.pending, ua.last_position) for uid, ua in users])
        for _, ua in users:
            ua.pending, ua.last_position = self._no_pending, -1
        self._take_over(users)

    def _take_over(self, users: list[tuple[str, UserArchive]]) -> None:
        """Keep loaded users' archives (notes capped) and build their indexes."""
        for uid, ua in users:
            if len(ua.notes) > self.cfg.notes_per_user:
                del ua.notes[: len(ua.notes) - self.cfg.notes_per_user]
            self._users[uid] = ua
            index = self._new_index()
            if ua.notes:
                index.rebuild(ua.addresses())
            self._indexes[uid] = index

    def _forget(self, user_id: str) -> bool:
        self._users.pop(user_id, None)
        self._indexes.pop(user_id, None)
        return self._open.drop_user(user_id)

    def drop_users(self, user_ids: Iterable[str]) -> int:
        """Forget these users' archives (e.g. after their partition moved away)."""
        with self._lock:
            return sum(self._forget(uid) for uid in user_ids)


class PlainNoteBank(NoteBank):
    """The plain reference of NoteBank's write path and open chunks: one ``PendingEvents``
    per user in its ``UserArchive`` (``_users`` holds every user with archive state),
    buffered user by user (appending arrays, closing chunks one at a time). Same results
    as NoteBank (tests/recmem/test_archive_open_chunks.py compares them on random
    batches); kept for the tests and as the readable form."""

    def _buffer_batch(
        self, batch: _Batch
    ) -> tuple[list[str], EventColumns | None, list[tuple[int, str]]]:
        closed: list[tuple[str, PendingEvents]] = []
        rejected: list[tuple[int, str]] = []
        ev = batch.ev
        for b, uid in enumerate(batch.user_ids):
            n, s0 = int(batch.lens[b]), int(batch.starts[b])
            if not n:
                continue
            try:
                if not batch.ids_ok[b]:
                    raise ValueError("item_ids differ in length from the user's events")
                if not batch.finite[b]:
                    raise ValueError("keys or queries have non-finite values")
                ints = ev.ints[s0 : s0 + n]
                new = PendingEvents(
                    ints[:, 0].copy(), ev.ids[s0 : s0 + n].tolist(), ints[:, 1].copy(),
                    ints[:, 2].copy(), ints[:, 3].copy(), ev.k[s0 : s0 + n], ev.u[s0 : s0 + n],
                )  # fmt: skip
                closed += self._buffer(uid, new)
            except ValueError as e:
                rejected.append((b, str(e)))
        if not closed:
            return [], None, rejected
        chunks = [c for _, c in closed]
        stacked = EventColumns(
            np.concatenate([np.stack([getattr(c, f) for f in INT_FIELDS], axis=1) for c in chunks]),
            _objects([i for c in chunks for i in c.item_ids]),
            np.concatenate([c.k for c in chunks]),
            np.concatenate([c.u for c in chunks]),
        )
        return [u for u, _ in closed], stacked, rejected

    def _buffer(self, user_id: str, new: PendingEvents) -> list[tuple[str, PendingEvents]]:
        """Buffer one user's prepared events; returns the chunks that closed. Checks
        first: on ValueError nothing changed."""
        ua = self._users.get(user_id)
        last = ua.last_position if ua is not None else -1
        pos = new.positions
        if len(pos) and (pos[0] <= last or (len(pos) > 1 and bool((pos[1:] <= pos[:-1]).any()))):
            raise ValueError(
                f"user {user_id!r}: positions must increase (last seen {last}, "
                f"got {new.positions[:4].tolist()}...)"
            )
        if ua is None:
            ua = UserArchive(PendingEvents.empty(self.n_channels, self.key_dim, len(self.coords)))
            self._users[user_id] = ua
        ua.pending.append(new)
        ua.last_position = int(new.positions[-1])
        closed = []
        while len(ua.pending) >= self.cfg.chunk_events:
            closed.append((user_id, ua.pending.take(self.cfg.chunk_events)))
        return closed

    def users(self) -> list[str]:
        with self._lock:
            return list(self._users)

    def pending_count(self, user_id: str) -> int:
        with self._lock:
            ua = self._users.get(user_id)
            return len(ua.pending) if ua is not None else 0

    def _user_archives(self, user_ids: Iterable[str]) -> list[tuple[str, UserArchive]]:
        return [(u, self._users[u]) for u in dict.fromkeys(user_ids) if u in self._users]

    def _install(self, users: list[tuple[str, UserArchive]]) -> None:
        self._take_over(users)  # the open chunks stay in each UserArchive

    def _forget(self, user_id: str) -> bool:
        self._indexes.pop(user_id, None)
        return self._users.pop(user_id, None) is not None
