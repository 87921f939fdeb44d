"""Checkpoints: the states of one Kafka partition's users, their archive notes and the next
offset of that partition, written as one unit (like a Kafka Streams task's state store,
changelog and input offsets).

Layout under the checkpoint root, one directory per partition::

    p-00003/MANIFEST.json        names the complete checkpoints, newest first
    p-00003/ckpt-000000000042/   meta.json (offset, kind, parent, CRCs), users.json,
                                 state.*.bin, notes.*.npy
    p-00003/.tmp-...             a checkpoint being written (never read)

A checkpoint is full (every user of the partition) or a delta (only the users that changed
since its parent, an earlier checkpoint); restoring a delta reads its chain back to the last
full one, later states winning. The manifest keeps the newest ``keep`` restore points and
every checkpoint their chains need.

A checkpoint is written into a temporary directory, every file and the directory are
fsynced, the directory is renamed into place, and then the manifest is replaced atomically.
A crash at any point leaves the previous manifest naming only complete checkpoints. Every
file carries a CRC32 in meta.json; a checkpoint that fails its checks is skipped with a
warning and the previous one is used.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.state import MemoryState
from recmem.config import Config
from recmem.state_store import StateLayout, state_from_numpy, state_to_numpy

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: meta.json carries the settings that shape the stored data (``data_settings``) and the
source topic's identity; 1 (a config hash only) is refused."""
MANIFEST = "MANIFEST.json"
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")

RUNTIME_ONLY = {
    "memory": ("backend", "chunk_size"),
    "model": ("dropout",),
    "archive": ("replay_notes", "min_votes"),
}
"""Fields of those sections that do not shape stored data: how this machine computes the
rule, training-only settings, and what a rank request asks for by default."""


def data_settings(cfg: Config) -> dict[str, Any]:
    """Every setting that shapes what a checkpoint stores, as ``section.field`` -> value:
    the memory and model sections (the states' meaning and the window), the archive's
    note selection and addresses (and the seed of their coordinate selection), and the
    number of latest events kept per user. A checkpoint written under other values is
    refused: its states, notes or tails mean something else."""
    out: dict[str, Any] = {}
    full = cfg.to_dict()
    for section in ("memory", "model", "archive"):
        for name, value in full[section].items():
            if name not in RUNTIME_ONLY.get(section, ()):
                out[f"{section}.{name}"] = value
    out["train.seed"] = cfg.train.seed  # seeds the archive's address coordinates
    out["recent_events"] = max(1, cfg.server.replay_query_events)
    return out


def settings_diff(stored: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Human-readable differences ``name: checkpoint X, this service Y``."""
    names = sorted(set(stored) | set(ours))
    return [
        f"{n}: checkpoint {stored.get(n, '<unset>')!r}, this service {ours.get(n, '<unset>')!r}"
        for n in names
        if stored.get(n) != ours.get(n)
    ]


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted or incompatible with this service."""


class IncompatibleCheckpoint(CheckpointError):
    """A complete checkpoint this service must not continue: another format or other
    settings. Never skipped silently (an older restore point would have the same problem)."""


@dataclass
class PartitionCheckpoint:
    """What a restore gives: the partition's users and their states (host memory), merged
    over the checkpoint's chain, and the next offset. ``notes_parts`` are the archive notes
    of each checkpoint of the chain, oldest first, with the users each one covers (import
    them in that order: later parts replace earlier ones for the same users). ``chain`` is
    the names used, the full checkpoint first."""

    partition: int
    next_offset: int
    user_ids: list[str]
    state: MemoryState
    notes_parts: list[tuple[list[str], dict[str, np.ndarray] | None]]
    model_version: str
    settings: dict[str, Any]
    seq: int
    path: Path
    chain: list[str]
    source: dict[str, Any]
    """What the newest checkpoint recorded about its source (topic id, last record)."""


@dataclass
class _Loaded:
    """One verified checkpoint directory, as written."""

    partition: int
    next_offset: int
    user_ids: list[str]
    state: MemoryState
    notes: dict[str, np.ndarray] | None
    model_version: str
    settings: dict[str, Any]
    seq: int
    path: Path
    parent: str | None
    source: dict[str, Any]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview) -> dict[str, int]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {
        "bytes": len(data) if isinstance(data, bytes) else data.nbytes,
        "crc32": zlib.crc32(data),
    }


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


class CheckpointStore:
    """Writes and restores per-partition checkpoints under ``root``; keeps the newest ``keep``."""

    def __init__(self, root: str | os.PathLike[str], layout: StateLayout, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("checkpoint.keep must be >= 1")
        self.root = Path(root)
        self.layout = layout
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def _pdir(self, partition: int) -> Path:
        return self.root / f"p-{partition:05d}"

    # ---- manifest ----------------------------------------------------------------------

    def _manifest(self, partition: int) -> list[str]:
        path = self._pdir(partition) / MANIFEST
        if not path.exists():
            return []
        try:
            names = json.loads(path.read_text())["checkpoints"]
            if not all(isinstance(n, str) and _NAME_OK.match(n) for n in names):
                raise ValueError("bad checkpoint name")
            return list(names)
        except (ValueError, KeyError, TypeError) as e:
            log.warning(
                "partition %d: unreadable manifest (%s); scanning directories", partition, e
            )
            return sorted((d.name for d in self._pdir(partition).glob("ckpt-*")), reverse=True)

    def _write_manifest(self, partition: int, names: list[str]) -> None:
        pdir = self._pdir(partition)
        tmp = pdir / f".{MANIFEST}.{os.getpid()}.tmp"
        body = json.dumps({"partition": partition, "checkpoints": names}, indent=1).encode()
        _write_file(tmp, body)
        os.replace(tmp, pdir / MANIFEST)
        _fsync_dir(pdir)

    def partitions(self) -> list[int]:
        """Partitions that have a manifest."""
        out = []
        for d in self.root.glob("p-*"):
            if (d / MANIFEST).exists():
                out.append(int(d.name[2:]))
        return sorted(out)

    # ---- write -------------------------------------------------------------------------

    def write(
        self,
        partition: int,
        user_ids: list[str],
        state: MemoryState,
        next_offset: int,
        *,
        model_version: str,
        settings: dict[str, Any],
        notes: dict[str, np.ndarray] | None = None,
        parent: str | None = None,
        source: dict[str, Any] | None = None,
    ) -> Path:
        """Write one checkpoint of ``partition`` and make it the newest. Without ``parent``
        it is full (every user of the partition); with ``parent`` (the name of an earlier
        checkpoint of this partition) it is a delta holding only the users that changed
        since ``parent``, and restoring it reads the chain back to the last full one.
        ``settings``: ``data_settings`` of the writer; ``source``: what identifies the
        records the offset points into (``topic_id``, ``last_record``)."""
        if parent is not None and not (
            _NAME_OK.match(parent) and (self._pdir(partition) / parent / "meta.json").exists()
        ):
            raise ValueError(f"partition {partition}: parent checkpoint {parent!r} does not exist")
        if int(state.pos.shape[0]) != len(user_ids):
            raise ValueError(f"{len(user_ids)} user ids but {state.pos.shape[0]} states")
        pdir = self._pdir(partition)
        pdir.mkdir(parents=True, exist_ok=True)
        names = self._manifest(partition)
        existing = [int(n.split("-")[1]) for n in names]
        existing += [int(d.name.split("-")[1]) for d in pdir.glob("ckpt-*")]
        seq = max(existing, default=0) + 1
        final = pdir / f"ckpt-{seq:012d}"
        tmp = pdir / f".tmp-ckpt-{seq:012d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files: dict[str, dict[str, int]] = {}
        files["users.json"] = _write_file(tmp / "users.json", json.dumps(user_ids).encode())
        for name, arr in state_to_numpy(state).items():
            files[f"state.{name}.bin"] = _write_file(tmp / f"state.{name}.bin", arr.data)
        for name, arr in (notes or {}).items():
            if not _NAME_OK.match(name):
                raise ValueError(f"note array name {name!r} is not a safe file name")
            files[f"notes.{name}.npy"] = _write_file(tmp / f"notes.{name}.npy", _npy_bytes(arr))
        meta = {
            "format": FORMAT_VERSION,
            "partition": partition,
            "seq": seq,
            "next_offset": int(next_offset),
            "n_users": len(user_ids),
            "model_version": model_version,
            "settings": settings,
            "source": dict(source or {}),
            "layout": {
                "n_layers": self.layout.n_layers,
                "n_heads": self.layout.n_heads,
                "key_dim": self.layout.key_dim,
                "value_dim": self.layout.value_dim,
                "momentum": self.layout.momentum,
                "embed_dim": self.layout.embed_dim,
                "dtype": str(self.layout.dtype),
            },
            "has_notes": notes is not None,
            "kind": "full" if parent is None else "delta",
            "parent": parent,
            "created_unix": time.time(),
            "files": files,
        }
        _write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(pdir)
        keep = self._retained(partition, [final.name] + [n for n in names if n != final.name])
        self._write_manifest(partition, keep)
        # older checkpoints, and leftovers of writes that crashed (this process owns p now)
        for d in pdir.iterdir():
            if d.is_dir() and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
        log.debug(
            "partition %d: checkpoint %s, %d users, offset %d",
            partition,
            final.name,
            len(user_ids),
            next_offset,
        )
        return final

    # ---- read --------------------------------------------------------------------------

    def latest_offset(self, partition: int) -> int | None:
        """The next offset of the newest checkpoint the manifest names (meta only, no verify)."""
        for name in self._manifest(partition):
            try:
                meta = json.loads((self._pdir(partition) / name / "meta.json").read_text())
                return int(meta["next_offset"])
            except (OSError, ValueError, KeyError):
                continue
        return None

    def _parent_of(self, partition: int, name: str) -> str | None:
        try:
            meta = json.loads((self._pdir(partition) / name / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        parent = meta.get("parent")
        return parent if isinstance(parent, str) and _NAME_OK.match(parent) else None

    def _retained(self, partition: int, names: list[str]) -> list[str]:
        """The newest ``keep`` restore points of ``names`` (newest first) and every older
        checkpoint their delta chains need, newest first."""
        keep: set[str] = set()
        for name in names[: self.keep]:
            cur: str | None = name
            while cur is not None and cur not in keep:
                keep.add(cur)
                cur = self._parent_of(partition, cur)
        return sorted(keep, reverse=True)

    def restore(
        self, partition: int, *, settings: dict[str, Any] | None = None
    ) -> PartitionCheckpoint | None:
        """The newest checkpoint of ``partition`` whose whole chain passes its checks, or
        None if there is none. Corrupted ones are skipped with a warning. One of another
        format, or written under other ``settings``, raises :class:`IncompatibleCheckpoint`
        naming each setting that differs (its states mean something else)."""
        for name in self._manifest(partition):
            try:
                chain = self._load_chain(partition, name)
            except IncompatibleCheckpoint:
                raise
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning(
                    "partition %d: checkpoint %s is unusable (%s); trying the previous one",
                    partition,
                    name,
                    e,
                )
                continue
            newest = chain[-1]
            diff = settings_diff(newest.settings, settings) if settings is not None else []
            if diff:
                raise IncompatibleCheckpoint(
                    f"partition {partition}: checkpoint {newest.path} was written under other "
                    f"settings ({'; '.join(diff)}); run with those settings, or move "
                    f"{self.root} away to start fresh"
                )
            return self._merge(chain)
        return None

    def _load_chain(self, partition: int, name: str) -> list[_Loaded]:
        """``name`` and its ancestors back to a full checkpoint, oldest first, all verified."""
        chain: list[_Loaded] = []
        cur: str | None = name
        while cur is not None:
            ck = self._load(partition, self._pdir(partition) / cur)
            if chain and ck.seq >= chain[-1].seq:
                raise CheckpointError(f"{cur} is not older than its child {chain[-1].path.name}")
            if chain and ck.settings != chain[-1].settings:
                raise CheckpointError(f"{cur} has other settings than its child")
            chain.append(ck)
            cur = ck.parent
        return chain[::-1]

    def _merge(self, chain: list[_Loaded]) -> PartitionCheckpoint:
        """Users of every checkpoint in the chain; a later checkpoint's state of a user wins."""
        where: dict[str, tuple[int, int]] = {}
        for ci, ck in enumerate(chain):
            for row, user in enumerate(ck.user_ids):
                where[user] = (ci, row)
        users = list(where)
        if len(chain) == 1:
            state = chain[0].state
        else:
            state = self.layout.zeros(len(users))
            for ci, ck in enumerate(chain):
                pick = [(i, where[u][1]) for i, u in enumerate(users) if where[u][0] == ci]
                if not pick:
                    continue
                dst = torch.tensor([i for i, _ in pick], dtype=torch.int64)
                src = torch.tensor([r for _, r in pick], dtype=torch.int64)
                state = state.put_rows(dst, ck.state.index(src))
        newest = chain[-1]
        return PartitionCheckpoint(
            partition=newest.partition,
            next_offset=newest.next_offset,
            user_ids=users,
            state=state,
            notes_parts=[(ck.user_ids, ck.notes) for ck in chain],
            model_version=newest.model_version,
            settings=newest.settings,
            seq=newest.seq,
            path=newest.path,
            chain=[ck.path.name for ck in chain],
            source=newest.source,
        )

    def _load(self, partition: int, path: Path) -> _Loaded:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise IncompatibleCheckpoint(
                f"{path}: checkpoint format {meta.get('format')!r}, this service reads "
                f"{FORMAT_VERSION} (format 1 recorded a config hash only, not the settings "
                f"and topic identity); move {self.root} away to start fresh"
            )
        if int(meta["partition"]) != partition:
            raise CheckpointError(f"belongs to partition {meta['partition']}")
        blobs: dict[str, bytes] = {}
        for fname, info in meta["files"].items():
            if not _NAME_OK.match(fname):
                raise CheckpointError(f"bad file name {fname!r}")
            data = (path / fname).read_bytes()
            if len(data) != info["bytes"] or zlib.crc32(data) != info["crc32"]:
                raise CheckpointError(f"{fname} fails its size/CRC32 check")
            blobs[fname] = data
        user_ids = json.loads(blobs["users.json"])
        arrays = {
            f[len("state.") : -len(".bin")]: np.frombuffer(d, dtype=np.uint8)
            for f, d in blobs.items()
            if f.startswith("state.")
        }
        state = state_from_numpy(arrays, self.layout)
        if int(state.pos.shape[0]) != len(user_ids):
            raise CheckpointError(f"{len(user_ids)} users but {state.pos.shape[0]} states")
        notes = None
        if meta.get("has_notes"):
            notes = {
                f[len("notes.") : -len(".npy")]: np.load(io.BytesIO(d), allow_pickle=False)
                for f, d in blobs.items()
                if f.startswith("notes.")
            }
        parent = meta.get("parent")
        if parent is not None and not (isinstance(parent, str) and _NAME_OK.match(parent)):
            raise CheckpointError(f"bad parent name {parent!r}")
        return _Loaded(
            partition=partition,
            next_offset=int(meta["next_offset"]),
            user_ids=list(user_ids),
            state=state,
            notes=notes,
            model_version=str(meta["model_version"]),
            settings=dict(meta["settings"]),
            seq=int(meta["seq"]),
            path=path,
            parent=parent,
            source=dict(meta.get("source") or {}),
        )
