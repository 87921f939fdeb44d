"""Per-user memory states in three tiers: a fixed-capacity slab (GPU memory when a GPU is
present), host memory, and disk.

The slab holds the users being updated; the least recently used ones move to host memory
when a slot is needed, and past ``host_capacity`` on to one file per user in a private
spill directory. A user comes back on demand, bit-exact (raw bytes, any dtype). The spill
files are a cache, not a durable copy: checkpoints (recmem/checkpoint/) are the durable
copy, so a new store starts with an empty spill directory of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from models.config import MemoryConfig, ModelConfig
from models.memory.schedule import UnlockSchedule
from models.state import MemoryState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateLayout:
    """Shape of one user's state: S and M [L, H, K, V] (no M without momentum), h [D], the
    window of the latest W events and the unlock schedule's own fields, when it has them
    (``models.state.MemoryState``)."""

    n_layers: int
    n_heads: int
    key_dim: int
    value_dim: int
    momentum: bool
    embed_dim: int
    window: int = 0
    dtype: torch.dtype = torch.float32
    adaptive: bool = False
    """Unlock counts and signal sums per layer (memory.unlock surprise | drift)."""
    keyed_order: bool = False
    """A block-order key per user (memory.block_order random)."""

    @classmethod
    def from_config(cls, mem: MemoryConfig, model: ModelConfig) -> StateLayout:
        sched = UnlockSchedule.from_config(mem)
        return cls(
            mem.n_layers,
            mem.n_heads,
            mem.key_dim,
            mem.value_dim,
            mem.momentum,
            model.embed_dim,
            model.window if model.hybrid != "none" else 0,
            adaptive=sched.adaptive,
            keyed_order=sched.keyed,
        )

    def zeros(self, batch: int, device: torch.device | str = "cpu") -> MemoryState:
        return MemoryState.zeros(
            batch,
            self.n_layers,
            self.n_heads,
            self.key_dim,
            self.value_dim,
            self.momentum,
            self.embed_dim,
            window=self.window,
            device=device,
            dtype=self.dtype,
            adaptive=self.adaptive,
            keyed_order=self.keyed_order,
        )

    def empty(self, batch: int) -> MemoryState:
        """Host states of ``batch`` users, uninitialised (for :meth:`UserStateStore.read_into`,
        which writes every row)."""
        return _from_fields(
            {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in self.field_shapes(batch).items()}
        )

    def field_shapes(self, batch: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of each field for ``batch`` users."""
        one = self.zeros(1, "meta").to_fields()
        return {k: ((batch, *t.shape[1:]), t.dtype) for k, t in one.items()}

    def bytes_per_user(self) -> int:
        return sum(
            int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in self.field_shapes(1).values()
        )


def _fields(state: MemoryState) -> dict[str, torch.Tensor]:
    return state.to_fields()


def _from_fields(f: dict[str, torch.Tensor]) -> MemoryState:
    return MemoryState.from_fields(f)


def state_to_numpy(state: MemoryState, copy: bool = True) -> dict[str, np.ndarray]:
    """Host copies of a state's tensors as raw bytes (uint8 views keep any dtype bit-exact);
    ``copy=False``: views of host tensors that are contiguous already (the caller keeps
    ``state`` unchanged while it uses them)."""
    out = {
        k: v.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        for k, v in _fields(state).items()
    }
    return {k: v.copy() for k, v in out.items()} if copy else out


def state_from_numpy(
    arrays: dict[str, np.ndarray], layout: StateLayout, device: torch.device | str = "cpu"
) -> MemoryState:
    """Inverse of :func:`state_to_numpy` for a batch of users; validates sizes."""
    n = int(arrays["pos"].size // 8)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in layout.field_shapes(n).items():
        if name not in arrays:
            raise ValueError(f"state arrays lack field {name!r}")
        raw = torch.from_numpy(np.array(arrays[name], copy=True).reshape(-1).view(np.uint8))
        expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if raw.numel() != expected:
            raise ValueError(
                f"state field {name!r} has {raw.numel()} bytes, layout expects {expected}"
            )
        out[name] = raw.view(dtype).reshape(shape).to(device)
    return _from_fields(out)


INITIAL_SLAB_ROWS = 1024
"""Slab rows allocated at start; the slab doubles on demand up to state.device_capacity."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UserStateStore:
    """user id -> memory state, in a slab of ``capacity`` slots plus host and disk tiers.

    ``gather(user_ids)`` makes the users resident (new users get zero states) and returns
    a copy of their states with their slots; ``scatter(slots, state)`` writes updated states
    back. The users of one gather must fit in the slab at once.
    """

    def __init__(
        self,
        layout: StateLayout,
        capacity: int,
        host_capacity: int,
        spill_dir: str | os.PathLike[str],
        device: torch.device | str | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("state store capacity must be >= 1")
        if host_capacity < 0:
            raise ValueError("state store host_capacity must be >= 0")
        self.layout = layout
        self.capacity = capacity
        self.host_capacity = host_capacity
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # The slab grows on demand up to ``capacity`` (doubling), so a large configured
        # capacity costs memory only once that many users are resident.
        initial = min(capacity, INITIAL_SLAB_ROWS)
        self.slab = layout.zeros(initial, self.device)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order, oldest first
        self._free: list[int] = list(range(initial - 1, -1, -1))
        # host tier: user -> its fields as [1, ...] CPU tensors
        self._host: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._disk: set[str] = set()
        root = Path(spill_dir)
        root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_spills(root)
        self._spill = Path(tempfile.mkdtemp(prefix=f"store-{os.getpid()}-", dir=root))

    # ---- tiers -------------------------------------------------------------------------

    @staticmethod
    def _remove_stale_spills(root: Path) -> None:
        """Spill directories of processes that died (e.g. kill -9) are garbage."""
        for d in root.glob("store-*"):
            try:
                pid = int(d.name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if not _pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)

    def _spill_path(self, user: str) -> Path:
        return self._spill / (hashlib.blake2b(user.encode(), digest_size=16).hexdigest() + ".npz")

    def _write_disk(self, user: str, rec: dict[str, torch.Tensor]) -> None:
        path = self._spill_path(user)
        tmp = path.with_suffix(".tmp")
        arrays = {k: v.contiguous().view(torch.uint8).numpy() for k, v in rec.items()}
        with open(tmp, "wb") as f:
            np.savez(f, **cast(dict[str, Any], arrays))
        os.replace(tmp, path)
        self._disk.add(user)

    def _read_disk(self, user: str, remove: bool) -> dict[str, torch.Tensor]:
        path = self._spill_path(user)
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        st = state_from_numpy(arrays, self.layout)
        if remove:
            path.unlink()
            self._disk.discard(user)
        return _fields(st)

    def _to_host(self, users: Sequence[str], slots: Sequence[int]) -> None:
        if not users:
            return
        rows = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        batch = {k: v.index_select(0, rows).to("cpu") for k, v in _fields(self.slab).items()}
        for i, user in enumerate(users):
            self._host[user] = {k: v[i : i + 1].clone() for k, v in batch.items()}
        while len(self._host) > self.host_capacity:
            user, rec = self._host.popitem(last=False)
            self._write_disk(user, rec)

    def _take(self, user: str) -> dict[str, torch.Tensor] | None:
        """Remove a non-resident user from host or disk; None for an unknown user."""
        rec = self._host.pop(user, None)
        if rec is not None:
            return rec
        if user in self._disk:
            return self._read_disk(user, remove=True)
        return None

    # ---- the slab ----------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        """Slab rows allocated so far (<= capacity)."""
        return int(self.slab.pos.shape[0])

    def _grow(self, needed: int) -> None:
        """Add at least ``needed`` rows (doubling, capped at capacity); existing slots keep
        their rows, so slots handed out earlier stay valid."""
        old = self.allocated
        new = min(self.capacity, max(2 * old, old + needed))
        if new <= old:
            return
        grown = {}
        for k, v in _fields(self.slab).items():
            g = v.new_empty((new, *v.shape[1:]))
            g[:old].copy_(v)
            g[old:].zero_()  # one pass over the new rows (zeros then a copy made two)
            grown[k] = g
        self.slab = _from_fields(grown)
        self._free.extend(range(new - 1, old - 1, -1))

    def gather(self, user_ids: Sequence[str]) -> tuple[MemoryState, torch.Tensor]:
        """States of distinct ``user_ids`` (a copy, on the store's device) and their slots."""
        if len(set(user_ids)) != len(user_ids):
            raise ValueError("gather needs distinct user ids")
        if len(user_ids) > self.capacity:
            raise ValueError(
                f"{len(user_ids)} users in one gather exceed the slab capacity {self.capacity}"
            )
        for user in user_ids:
            if user in self._slot_of:
                self._slot_of.move_to_end(user)
        missing = [u for u in user_ids if u not in self._slot_of]
        if len(missing) > len(self._free):
            self._grow(len(missing) - len(self._free))
        n_evict = max(0, len(missing) - len(self._free))
        evicted = [self._slot_of.popitem(last=False) for _ in range(n_evict)]
        self._to_host([u for u, _ in evicted], [s for _, s in evicted])
        self._free.extend(s for _, s in evicted)
        if missing:
            load_slots, load_recs = [], []
            new_slots = []
            for user in missing:
                slot = self._free.pop()
                self._slot_of[user] = slot
                rec = self._take(user)
                if rec is None:
                    new_slots.append(slot)
                else:
                    load_slots.append(slot)
                    load_recs.append(rec)
            if load_slots:
                rows = torch.tensor(load_slots, dtype=torch.int64, device=self.device)
                for name, dst in _fields(self.slab).items():
                    src = torch.cat([r[name] for r in load_recs]).to(self.device)
                    dst.index_copy_(0, rows, src)
            if new_slots:
                rows = torch.tensor(new_slots, dtype=torch.int64, device=self.device)
                zero = self.layout.zeros(len(new_slots), self.device)
                for name, dst in _fields(self.slab).items():
                    dst.index_copy_(0, rows, _fields(zero)[name])
        slots = torch.tensor(
            [self._slot_of[u] for u in user_ids], dtype=torch.int64, device=self.device
        )
        # index_select copies whole rows (memcpy); plain indexing gathers element-wise
        gathered = {k: v.index_select(0, slots) for k, v in _fields(self.slab).items()}
        return _from_fields(gathered), slots

    def scatter(self, slots: torch.Tensor, state: MemoryState) -> None:
        """Write updated states of the slots returned by :meth:`gather`."""
        src = _fields(state)
        for name, dst in _fields(self.slab).items():
            dst.index_copy_(0, slots, src[name].to(dst.dtype))

    def put(self, user_ids: Sequence[str], state: MemoryState) -> None:
        """Set the states of ``user_ids`` (e.g. restored from a checkpoint), slab-sized chunks."""
        for start in range(0, len(user_ids), self.capacity):
            chunk = list(user_ids[start : start + self.capacity])
            _, slots = self.gather(chunk)
            part = state.index(slice(start, start + len(chunk)))
            self.scatter(slots, _move(part, self.device))

    # ---- read-only access, drop, figures -----------------------------------------------

    def read_resident(self, user_ids: Sequence[str]) -> MemoryState | None:
        """Copies of the users' states gathered on the slab's device, when every one of them
        is resident there (None otherwise); tiers and LRU are untouched. On a GPU this skips
        the host round trip of ``read``."""
        slots = [self._slot_of.get(u) for u in user_ids]
        if not user_ids or any(s is None for s in slots):
            return None
        rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return _from_fields({n: t.index_select(0, rows) for n, t in _fields(self.slab).items()})

    def read(self, user_ids: Sequence[str]) -> MemoryState:
        """A host copy of known users' states from any tier, without changing tiers or LRU."""
        out = self.layout.zeros(len(user_ids))
        self.read_into(user_ids, out, 0)
        return out

    def read_into(self, user_ids: Sequence[str], out: MemoryState, start: int) -> None:
        """``read`` into rows ``start:start + len(user_ids)`` of the host states ``out``
        (every one of those rows is written; one copy per field when all are resident)."""
        dst = {k: v.narrow(0, start, len(user_ids)) for k, v in _fields(out).items()}
        slot_of = self._slot_of
        resident = [(i, slot_of[u]) for i, u in enumerate(user_ids) if u in slot_of]
        if resident and len(resident) == len(user_ids):
            rows = torch.tensor([s for _, s in resident], dtype=torch.int64, device=self.device)
            for name, src in _fields(self.slab).items():
                if src.device.type == "cpu":
                    torch.index_select(src, 0, rows, out=dst[name])
                else:
                    dst[name].copy_(src.index_select(0, rows))
        elif resident:
            idx = torch.tensor([i for i, _ in resident], dtype=torch.int64)
            rows = torch.tensor([s for _, s in resident], dtype=torch.int64, device=self.device)
            for name, src in _fields(self.slab).items():
                dst[name].index_copy_(0, idx, src.index_select(0, rows).to("cpu"))
        for i, user in enumerate(user_ids):
            if user in slot_of:
                continue
            rec = self._host.get(user)
            if rec is None:
                if user not in self._disk:
                    raise KeyError(f"unknown user {user!r}")
                rec = self._read_disk(user, remove=False)
            for name, v in rec.items():
                dst[name][i] = v[0]

    def __contains__(self, user: object) -> bool:
        return user in self._slot_of or user in self._host or user in self._disk

    def __len__(self) -> int:
        return len(self._slot_of) + len(self._host) + len(self._disk)

    def users(self) -> Iterator[str]:
        """Every known user, in every tier."""
        yield from list(self._slot_of)
        yield from list(self._host)
        yield from sorted(self._disk)

    def drop(self, user_ids: Iterable[str]) -> int:
        """Forget users (their partition was revoked); returns how many were known."""
        n = 0
        for user in user_ids:
            slot = self._slot_of.pop(user, None)
            if slot is not None:
                self._free.append(slot)
                n += 1
            elif self._host.pop(user, None) is not None:
                n += 1
            elif user in self._disk:
                self._spill_path(user).unlink(missing_ok=True)
                self._disk.discard(user)
                n += 1
        return n

    def tier_of(self, user: str) -> str:
        """ "device" | "host" | "disk" for a known user, "" for an unknown one."""
        if user in self._slot_of:
            return "device"
        if user in self._host:
            return "host"
        return "disk" if user in self._disk else ""

    def tier_counts(self) -> dict[str, int]:
        return {"device": len(self._slot_of), "host": len(self._host), "disk": len(self._disk)}

    def bytes_per_user(self) -> int:
        return self.layout.bytes_per_user()

    def close(self) -> None:
        """Remove this store's spill files (they are a cache; checkpoints are durable)."""
        shutil.rmtree(self._spill, ignore_errors=True)


def _move(state: MemoryState, device: torch.device) -> MemoryState:
    return state.to(device)
