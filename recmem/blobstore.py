"""Where checkpoints live: a local (or shared) directory, or an object store through the S3
API (AWS S3, MinIO, moto in the tests). Keys are ``/``-separated paths under the store's
root (``p-00003/ckpt-.../meta.json``).

Both give the two operations fencing needs (recmem/checkpoint/):

- a conditional replace, ``put_if(key, data, tag)``: the write happens only if the object
  is still the one read with ``tag``; ``tag=None``: only if there is none yet. On S3 these
  are the ``If-Match`` / ``If-None-Match: *`` preconditions of PutObject (AWS since 2024,
  MinIO, moto). In a directory they are compare-and-replace under an exclusive
  ``flock`` of the partition's lock file (``exclusive``), which every writer takes: one
  host, or a shared filesystem whose locks reach every client (NFSv4).
- create-only objects (``put_if(key, data, None)``), which a later writer never replaces.

``conditional=False`` (``checkpoint.conditional_writes``) turns the preconditions off for
S3-compatible stores without them: writes are then checked before, not at, the write, and
restores ignore what a stale owner slipped in (docs/scaling.md, Fencing).

This module imports no torch and boto3 only for ``s3://`` locations, so that the health
check can use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class WriteConflict(RuntimeError):
    """A conditional write whose precondition failed: someone else wrote the object."""


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-API store (credentials come from the usual AWS variables or
    files: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)."""

    endpoint_url: str = ""
    """Empty: AWS itself; e.g. http://minio:9000 or a moto server."""
    region: str = ""
    """Empty: boto3's default (us-east-1 when nothing is configured)."""


class Blobs(Protocol):
    """Objects under one root; keys are relative ``/``-separated paths."""

    conditional: bool

    def describe(self, key: str = "") -> str: ...

    def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        ...

    def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, tag for ``put_if``), or None when there is none."""
        ...

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write (replace) an object; durable when this returns."""
        ...

    def put_if(self, key: str, data: bytes, tag: str | None) -> None:
        """Replace the object only if it is still the one read with ``tag`` (None: only if
        absent); raises WriteConflict otherwise (unconditional when not ``conditional``)."""
        ...

    def children(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (objects and sub-prefixes), sorted."""
        ...

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (and ``prefix`` itself as an object)."""
        ...

    def sync(self, prefix: str) -> None:
        """Make the names of what was written under ``prefix`` durable."""
        ...

    def exclusive(self, prefix: str) -> contextlib.AbstractContextManager[None]:
        """Held around a read-check-write of ``prefix``'s objects (a lock in a directory;
        nothing on S3, whose preconditions do the job)."""
        ...


def open_blobs(location: str, s3: S3Settings | None = None, conditional: bool = True) -> Blobs:
    """``s3://bucket/prefix`` -> S3Blobs, anything else is a directory."""
    if location.startswith("s3://"):
        return S3Blobs(location, s3 or S3Settings(), conditional)
    return DirBlobs(Path(location).expanduser(), conditional)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirBlobs:
    """Objects as files under ``root`` (written and fsynced; replacements go aside and are
    renamed into place)."""

    def __init__(self, root: Path, conditional: bool = True) -> None:
        self.root = root
        self.conditional = conditional
        self.root.mkdir(parents=True, exist_ok=True)

    def describe(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = (self.root / key).read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.blake2b(data, digest_size=16).hexdigest()

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _put_aside(self, key: str, data: bytes) -> Path:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_if(self, key: str, data: bytes, tag: str | None) -> None:
        path = self.root / key
        tmp = self._put_aside(key, data)
        try:
            if tag is None and self.conditional:
                try:
                    os.link(tmp, path)  # fails if the name exists: create-only, whole content
                except FileExistsError:
                    raise WriteConflict(f"{path} exists") from None
            else:
                if self.conditional:
                    current = self.get_tagged(key)
                    if current is None or current[1] != tag:
                        raise WriteConflict(f"{path} changed since it was read")
                os.replace(tmp, path)
            _fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def children(self, prefix: str) -> list[str]:
        d = self.root / prefix
        try:
            return sorted(p.name for p in d.iterdir())
        except FileNotFoundError:
            return []

    def delete_tree(self, prefix: str) -> None:
        import shutil

        path = self.root / prefix
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def sync(self, prefix: str) -> None:
        path = self.root / prefix
        if path.is_dir():
            _fsync_dir(path)
        _fsync_dir(path.parent)

    @contextlib.contextmanager
    def exclusive(self, prefix: str) -> Iterator[None]:
        if not self.conditional:  # a filesystem whose locks do not reach every writer
            yield
            return
        d = self.root / prefix
        d.mkdir(parents=True, exist_ok=True)
        with open(d / ".lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class S3Blobs:
    """Objects in ``s3://bucket/prefix`` through boto3."""

    def __init__(self, location: str, settings: S3Settings, conditional: bool = True) -> None:
        import boto3
        from botocore.config import Config as BotoConfig

        bucket, _, prefix = location[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"{location!r}: no bucket (expected s3://bucket/prefix)")
        self.location = location.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.conditional = conditional
        self.client: Any = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url or None,
            region_name=settings.region or None,
            config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}),
        )

    def describe(self, key: str = "") -> str:
        return f"{self.location}/{key}" if key else self.location

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _code(e: Exception) -> str:
        response = getattr(e, "response", None) or {}
        return str(response.get("Error", {}).get("Code", ""))

    def get(self, key: str) -> bytes:
        got = self.get_tagged(key)
        if got is None:
            raise FileNotFoundError(self.describe(key))
        return got[0]

    def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        try:
            res = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return res["Body"].read(), str(res["ETag"])

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))

    def put_if(self, key: str, data: bytes, tag: str | None) -> None:
        from botocore.exceptions import ClientError

        extra: dict[str, str] = {}
        if self.conditional:
            extra = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except ClientError as e:
            code = self._code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise WriteConflict(f"{self.describe(key)}: {code}") from None
            if code in ("NoSuchKey", "404") and tag is not None:
                raise WriteConflict(f"{self.describe(key)} is gone") from None
            raise

    def _list(self, prefix: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        full = self._key(prefix).rstrip("/") + "/" if prefix or self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full, **({"Delimiter": "/"} if delimiter else {})
        )
        for page in pages:
            page["_full"] = full
            yield page

    def children(self, prefix: str) -> list[str]:
        names: set[str] = set()
        for page in self._list(prefix, delimiter=True):
            full = page["_full"]
            for p in page.get("CommonPrefixes", []):
                names.add(p["Prefix"][len(full) :].rstrip("/"))
            for obj in page.get("Contents", []):
                names.add(obj["Key"][len(full) :])
        return sorted(n for n in names if n)

    def delete_tree(self, prefix: str) -> None:
        keys = [
            obj["Key"] for page in self._list(prefix, False) for obj in page.get("Contents", [])
        ]
        keys.append(self._key(prefix))
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def sync(self, prefix: str) -> None:
        return None  # a PutObject is durable when it returns

    @contextlib.contextmanager
    def exclusive(self, prefix: str) -> Iterator[None]:
        yield  # the preconditions of put_if do the job


def probe(blobs: Blobs) -> None:
    """Write, read back and remove a small object (health checks); raises what fails."""
    key = f".probe-{uuid.uuid4().hex}"
    blobs.put(key, b"ok")
    try:
        if blobs.get(key) != b"ok":
            raise OSError(f"{blobs.describe(key)} did not read back")
    finally:
        blobs.delete_tree(key)
