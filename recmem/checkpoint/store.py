"""The checkpoint store: writes one partition's checkpoint as files under a fresh name and
commits it with a conditional replace of the partition's manifest, keeps the newest
restore points and what their delta chains need, claims partitions for a generation, and
restores the newest checkpoint whose chain passes its checks (recmem/checkpoint/__init__.py
describes the layout and the guarantees)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import PurePath, PurePosixPath
from typing import Any

import numpy as np
import torch

from models.state import MemoryState
from recmem.blobstore import Blobs, DirBlobs, S3Settings, WriteConflict, open_blobs
from recmem.checkpoint.fencing import (
    CKPT,
    FENCE,
    NAME_OK,
    NO_GENERATION,
    Fence,
    Fenced,
    generation_of,
    is_stale,
    seq_of,
)
from recmem.checkpoint.settings import settings_diff
from recmem.state_store import StateLayout, state_from_numpy, state_to_numpy

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: meta.json carries the settings that shape the stored data (``data_settings``) and the
source topic's identity; 1 (a config hash only) is refused."""
MANIFEST = "MANIFEST.json"
FENCES_KEPT = 3
COMMIT_ATTEMPTS = 5


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted or incompatible with this service."""


class IncompatibleCheckpoint(CheckpointError):
    """A complete checkpoint this service must not continue: another format, other
    settings or another model version. Never skipped silently (an older restore point would
    have the same problem)."""


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
    path: PurePath
    chain: list[str]
    source: dict[str, Any]
    """What the newest checkpoint recorded about its source (topic id, last record)."""
    generation: int = NO_GENERATION
    """The group generation of the owner that wrote the newest checkpoint."""
    bytes_read: int = 0


@dataclass
class _Loaded:
    """One verified checkpoint, as written."""

    partition: int
    next_offset: int
    user_ids: list[str]
    state: MemoryState
    notes: dict[str, np.ndarray] | None
    model_version: str
    settings: dict[str, Any]
    seq: int
    path: PurePath
    parent: str | None
    source: dict[str, Any]
    generation: int
    nbytes: int


@dataclass
class _Manifest:
    names: list[str] = field(default_factory=list)
    fence: Fence = field(default_factory=Fence)
    tag: str | None = None
    """The stored object's tag for a conditional replace (None: there is none)."""
    readable: bool = True


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _info(data: bytes | memoryview) -> dict[str, int]:
    return {
        "bytes": len(data) if isinstance(data, bytes) else data.nbytes,
        "crc32": zlib.crc32(data),
    }


class CheckpointStore:
    """Writes and restores per-partition checkpoints under ``root`` (a directory, an
    ``s3://bucket/prefix`` location or a Blobs); keeps the newest ``keep``."""

    def __init__(
        self,
        root: str | os.PathLike[str] | Blobs,
        layout: StateLayout,
        keep: int = 3,
        *,
        s3: S3Settings | None = None,
        conditional: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError("checkpoint.keep must be >= 1")
        if isinstance(root, str | os.PathLike):
            self.blobs = open_blobs(os.fspath(root), s3, conditional)
        else:
            self.blobs = root
        self.layout = layout
        self.keep = keep
        self.bytes_written = 0
        """Bytes of checkpoint files written by this object (figures, benchmarks)."""

    @property
    def location(self) -> str:
        return self.blobs.describe()

    def _pdir(self, partition: int) -> str:
        return f"p-{partition:05d}"

    def _path(self, key: str) -> PurePath:
        if isinstance(self.blobs, DirBlobs):
            return self.blobs.path(key)
        return PurePosixPath(self.blobs.describe(key))

    # ---- manifest and fences -----------------------------------------------------------

    def _read_manifest(self, partition: int) -> _Manifest:
        pdir = self._pdir(partition)
        got = self.blobs.get_tagged(f"{pdir}/{MANIFEST}")
        if got is None:
            return _Manifest()
        data, tag = got
        try:
            raw = json.loads(data)
            names = raw["checkpoints"]
            if not all(isinstance(n, str) and NAME_OK.match(n) for n in names):
                raise ValueError("bad checkpoint name")
            return _Manifest(list(names), Fence.from_json(raw.get("fence")), tag)
        except (ValueError, KeyError, TypeError) as e:
            log.warning(
                "partition %d: unreadable manifest (%s); scanning checkpoints", partition, e
            )
            names = sorted(
                (n for n in self.blobs.children(pdir) if CKPT.match(n)), key=seq_of, reverse=True
            )
            return _Manifest(names, Fence(), tag, readable=False)

    def _manifest(self, partition: int) -> list[str]:
        return self._read_manifest(partition).names

    def _fence_objects(self, partition: int) -> list[tuple[int, str]]:
        """(generation, name) of the partition's fence objects, oldest first."""
        found = []
        for name in self.blobs.children(self._pdir(partition)):
            m = FENCE.match(name)
            if m:
                found.append((int(m.group(1)), name))
        return sorted(found)

    def fence(self, partition: int, manifest: _Manifest | None = None) -> Fence:
        """The partition's newest claim: the manifest's, or a newer fence object (written
        even where the manifest could not be replaced conditionally)."""
        manifest = manifest or self._read_manifest(partition)
        best = manifest.fence
        objects = self._fence_objects(partition)
        if objects and objects[-1][0] > best.generation:
            gen, name = objects[-1]
            try:
                raw = json.loads(self.blobs.get(f"{self._pdir(partition)}/{name}"))
                best = Fence.from_json(raw)
            except (OSError, ValueError):
                best = Fence(gen)  # a broken claim still fences its generation
            if best.generation != gen:
                best = Fence(gen, best.owner, best.base, best.claimed_unix)
        return best

    def _put_manifest(
        self, partition: int, names: list[str], fence: Fence, tag: str | None
    ) -> None:
        body = json.dumps(
            {"partition": partition, "checkpoints": names, "fence": fence.to_json()}, indent=1
        ).encode()
        self.blobs.put_if(f"{self._pdir(partition)}/{MANIFEST}", body, tag)

    def claim(self, partition: int, generation: int, owner: str = "") -> Fence:
        """Record that the owner of group generation ``generation`` took ``partition`` over
        (before it restores): every writer of an older generation is refused from now on.
        Raises Fenced when a newer generation claimed it already (this member is stale)."""
        pdir = self._pdir(partition)
        for _ in range(COMMIT_ATTEMPTS):
            with self.blobs.exclusive(pdir):
                manifest = self._read_manifest(partition)
                current = self.fence(partition, manifest)
                if current.generation > generation:
                    raise Fenced(
                        f"partition {partition}: claimed by generation {current.generation} "
                        f"({current.owner or 'unknown'}); this member holds {generation}"
                    )
                base = next((n for n in manifest.names if not is_stale(n, current)), None)
                fence = Fence(generation, owner, base, time.time())
                key = f"{pdir}/fence-{generation:012d}.json"
                # (exists already after a retry of this generation's claim: the manifest decides)
                with contextlib.suppress(WriteConflict):
                    self.blobs.put_if(key, json.dumps(fence.to_json()).encode(), None)
                try:
                    self._put_manifest(partition, manifest.names, fence, manifest.tag)
                except WriteConflict:
                    continue  # a write landed in between: read again
            for gen, name in self._fence_objects(partition)[:-FENCES_KEPT]:
                if gen < generation:
                    self.blobs.delete_tree(f"{pdir}/{name}")
            log.debug("partition %d: claimed by generation %d (%s)", partition, generation, owner)
            return fence
        raise WriteConflict(f"partition {partition}: the manifest kept changing during a claim")

    def partitions(self) -> list[int]:
        """Partitions that have a manifest."""
        out = []
        for name in self.blobs.children(""):
            manifest = f"{name}/{MANIFEST}"
            if name[:2] == "p-" and name[2:].isdigit() and self.blobs.get_tagged(manifest):
                out.append(int(name[2:]))
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
        generation: int = NO_GENERATION,
        owner: str = "",
    ) -> PurePath:
        """Write one checkpoint of ``partition`` and make it the newest. Without ``parent``
        it is full (every user of the partition); with ``parent`` (the name of an earlier
        checkpoint of this partition) it is a delta holding only the users that changed
        since ``parent``, and restoring it reads the chain back to the last full one.
        ``settings``: ``data_settings`` of the writer; ``source``: what identifies the
        records the offset points into (``topic_id``, ``last_record``); ``generation``:
        the writer's group generation. Raises Fenced (and leaves nothing behind) when a
        newer generation claimed the partition."""
        pdir = self._pdir(partition)
        if parent is not None and not (
            NAME_OK.match(parent) and self.blobs.get_tagged(f"{pdir}/{parent}/meta.json")
        ):
            raise ValueError(f"partition {partition}: parent checkpoint {parent!r} does not exist")
        if int(state.pos.shape[0]) != len(user_ids):
            raise ValueError(f"{len(user_ids)} user ids but {state.pos.shape[0]} states")
        for name in notes or {}:
            if not NAME_OK.match(name):
                raise ValueError(f"note array name {name!r} is not a safe file name")
        existing = self.blobs.children(pdir)
        seq = max((seq_of(n) for n in existing + self._manifest(partition)), default=0)
        seq = max(seq, 0) + 1
        name = f"ckpt-{seq:012d}-g{generation}-{uuid.uuid4().hex[:6]}"
        prefix = f"{pdir}/{name}"
        try:
            self._write_files(prefix, partition, seq, user_ids, state, next_offset,
                              model_version, settings, notes, parent, source, generation,
                              owner)  # fmt: skip
            keep = self._commit(partition, name, generation)
        except OSError as e:
            self.blobs.delete_tree(prefix)
            # a newer owner removes a stale writer's unfinished files (below): when they
            # vanish under this write because the partition was claimed, it is refused
            fence = self.fence(partition)
            if fence.generation > generation:
                raise Fenced(
                    f"partition {partition}: checkpoint of generation {generation} refused"
                    f" while writing ({type(e).__name__}); generation {fence.generation}"
                    f" ({fence.owner or 'unknown'}) owns it"
                ) from e
            raise
        except BaseException:
            self.blobs.delete_tree(prefix)
            raise
        # older checkpoints, leftovers of crashed writes, refused writes: never anything a
        # newer generation wrote (it may be writing now)
        for child in self.blobs.children(pdir):
            leftover = CKPT.match(child) or child.startswith(".tmp-")
            if leftover and child not in keep and generation_of(child) <= generation:
                self.blobs.delete_tree(f"{pdir}/{child}")
        log.debug(
            "partition %d: checkpoint %s, %d users, offset %d",
            partition, name, len(user_ids), next_offset,
        )  # fmt: skip
        return self._path(prefix)

    def _write_files(
        self,
        prefix: str,
        partition: int,
        seq: int,
        user_ids: list[str],
        state: MemoryState,
        next_offset: int,
        model_version: str,
        settings: dict[str, Any],
        notes: dict[str, np.ndarray] | None,
        parent: str | None,
        source: dict[str, Any] | None,
        generation: int,
        owner: str,
    ) -> None:
        files: dict[str, dict[str, int]] = {}

        def put(fname: str, data: bytes | memoryview) -> None:
            self.blobs.put(f"{prefix}/{fname}", data)
            files[fname] = _info(data)
            self.bytes_written += files[fname]["bytes"]

        put("users.json", json.dumps(user_ids).encode())
        for name, arr in state_to_numpy(state, copy=False).items():  # written before return
            put(f"state.{name}.bin", arr.data)
        for name, arr in (notes or {}).items():
            put(f"notes.{name}.npy", _npy_bytes(arr))
        meta = {
            "format": FORMAT_VERSION,
            "partition": partition,
            "seq": seq,
            "next_offset": int(next_offset),
            "n_users": len(user_ids),
            "model_version": model_version,
            "settings": settings,
            "source": dict(source or {}),
            "generation": generation,
            "owner": owner,
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
        self.blobs.put(f"{prefix}/meta.json", json.dumps(meta, indent=1).encode())
        self.blobs.sync(prefix)

    def _commit(self, partition: int, name: str, generation: int) -> set[str]:
        """Make ``name`` the newest restore point, unless a newer generation claimed the
        partition (Fenced). Returns what the manifest names now."""
        pdir = self._pdir(partition)
        for _ in range(COMMIT_ATTEMPTS):
            with self.blobs.exclusive(pdir):
                manifest = self._read_manifest(partition)
                fence = self.fence(partition, manifest)
                if fence.generation > generation:
                    raise Fenced(
                        f"partition {partition}: checkpoint of generation {generation} refused;"
                        f" generation {fence.generation} ({fence.owner or 'unknown'}) owns it"
                    )
                names = [n for n in manifest.names if n != name]
                keep = self._retained(partition, [name] + names)
                try:
                    self._put_manifest(partition, keep, fence, manifest.tag)
                except WriteConflict:
                    continue  # a claim or a write landed in between: check again
                return set(keep)
        raise WriteConflict(f"partition {partition}: the manifest kept changing during a write")

    # ---- read --------------------------------------------------------------------------

    def latest_offset(self, partition: int) -> int | None:
        """The next offset of the newest checkpoint the manifest names that could be the
        restore point (meta only, no verify)."""
        manifest = self._read_manifest(partition)
        fence = self.fence(partition, manifest)
        for name in manifest.names:
            if is_stale(name, fence):
                continue
            try:
                meta = json.loads(self.blobs.get(f"{self._pdir(partition)}/{name}/meta.json"))
                return int(meta["next_offset"])
            except (OSError, ValueError, KeyError):
                continue
        return None

    def _parent_of(self, partition: int, name: str) -> str | None:
        try:
            meta = json.loads(self.blobs.get(f"{self._pdir(partition)}/{name}/meta.json"))
        except (OSError, ValueError):
            return None
        parent = meta.get("parent")
        return parent if isinstance(parent, str) and NAME_OK.match(parent) else None

    def _retained(self, partition: int, names: list[str]) -> list[str]:
        """The newest ``keep`` restore points of ``names`` (newest first) and every older
        checkpoint their delta chains need, newest first."""
        keep: set[str] = set()
        for name in names[: self.keep]:
            cur: str | None = name
            while cur is not None and cur not in keep:
                keep.add(cur)
                cur = self._parent_of(partition, cur)
        return sorted(keep, key=seq_of, reverse=True)

    def restore(
        self,
        partition: int,
        *,
        settings: dict[str, Any] | None = None,
        model_version: str | None = None,
        prefetched: PartitionCheckpoint | None = None,
    ) -> PartitionCheckpoint | None:
        """The newest checkpoint of ``partition`` whose whole chain passes its checks, or
        None if there is none. Corrupted ones are skipped with a warning, and so are those a
        stale owner wrote after the partition's newest claim. One of another format, or
        written under other ``settings`` or by another ``model_version``, raises
        :class:`IncompatibleCheckpoint` naming what differs (its states mean something
        else).

        ``prefetched``: what an earlier ``restore`` of this partition (same ``settings``
        and ``model_version``) returned. It is returned again, without reading its files,
        when it is still the checkpoint this restore picks (the manifest and the claims are
        read now, so a newer checkpoint or a newer claim wins; a checkpoint's files never
        change once it is in the manifest)."""
        manifest = self._read_manifest(partition)
        fence = self.fence(partition, manifest)
        for name in manifest.names:
            if is_stale(name, fence):
                log.warning(
                    "partition %d: ignoring checkpoint %s: written by generation %d after "
                    "generation %d claimed the partition (from %s)",
                    partition, name, generation_of(name), fence.generation, fence.base,
                )  # fmt: skip
                continue
            if (
                prefetched is not None
                and prefetched.partition == partition
                and prefetched.path.name == name
            ):
                return prefetched
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
                    f"{self.location} away to start fresh"
                )
            if model_version is not None and newest.model_version != model_version:
                raise IncompatibleCheckpoint(
                    f"partition {partition}: checkpoint {newest.path} was written by model "
                    f"{newest.model_version}, this service serves {model_version}; a new model "
                    "version needs a group of its own (kafka.group_id, e.g. "
                    "'recmem-{model_version}'; docs/scaling.md, Rolling out a model)"
                )
            return self._merge(chain)
        return None

    def _load_chain(self, partition: int, name: str) -> list[_Loaded]:
        """``name`` and its ancestors back to a full checkpoint, oldest first, all verified."""
        chain: list[_Loaded] = []
        cur: str | None = name
        while cur is not None:
            ck = self._load(partition, f"{self._pdir(partition)}/{cur}")
            if chain and ck.seq >= chain[-1].seq:
                raise CheckpointError(f"{cur} is not older than its child {chain[-1].path.name}")
            if chain and settings_diff(ck.settings, chain[-1].settings):
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
            generation=newest.generation,
            bytes_read=sum(ck.nbytes for ck in chain),
        )

    def _load(self, partition: int, prefix: str) -> _Loaded:
        path = self._path(prefix)
        meta = json.loads(self.blobs.get(f"{prefix}/meta.json"))
        if meta.get("format") != FORMAT_VERSION:
            raise IncompatibleCheckpoint(
                f"{path}: checkpoint format {meta.get('format')!r}, this service reads "
                f"{FORMAT_VERSION} (format 1 recorded a config hash only, not the settings "
                f"and topic identity); move {self.location} away to start fresh"
            )
        if int(meta["partition"]) != partition:
            raise CheckpointError(f"belongs to partition {meta['partition']}")
        blobs: dict[str, bytes] = {}
        for fname, info in meta["files"].items():
            if not NAME_OK.match(fname):
                raise CheckpointError(f"bad file name {fname!r}")
            data = self.blobs.get(f"{prefix}/{fname}")
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
        if parent is not None and not (isinstance(parent, str) and NAME_OK.match(parent)):
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
            generation=int(meta.get("generation", NO_GENERATION)),
            nbytes=sum(len(d) for d in blobs.values()),
        )
