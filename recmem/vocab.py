"""Item vocabulary: known items get dense indices, unknown ones hashed OOV buckets."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np


def _bucket(item_id: str, n_buckets: int) -> int:
    digest = hashlib.blake2b(item_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n_buckets


class ItemVocab:
    """Known item ids -> 0..n_items-1; any other id -> n_items + stable hash % n_oov.

    The hash is blake2b, so the mapping is the same in every process and after restarts.
    """

    def __init__(self, item_ids: Sequence[str], n_oov_buckets: int) -> None:
        if n_oov_buckets < 1:
            raise ValueError("n_oov_buckets must be >= 1")
        self.item_ids: list[str] = list(item_ids)
        self.index: dict[str, int] = {item: i for i, item in enumerate(self.item_ids)}
        if len(self.index) != len(self.item_ids):
            raise ValueError("item ids in a vocabulary must be unique")
        self.n_oov = n_oov_buckets

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    @property
    def size(self) -> int:
        """Embedding rows needed: known items plus OOV buckets."""
        return self.n_items + self.n_oov

    def encode_one(self, item_id: str) -> int:
        idx = self.index.get(item_id)
        return idx if idx is not None else self.n_items + _bucket(item_id, self.n_oov)

    def encode(self, item_ids: Iterable[str]) -> np.ndarray:
        """``encode_one`` of each id: the known ones by one dict lookup each in C, then
        the out-of-vocabulary ones (hashed) alone."""
        ids = item_ids if isinstance(item_ids, list) else list(item_ids)
        out = np.fromiter(map(self.index.get, ids, repeat(-1)), dtype=np.int64, count=len(ids))
        oov = np.flatnonzero(out < 0)
        if len(oov):
            out[oov] = [self.n_items + _bucket(ids[i], self.n_oov) for i in oov.tolist()]
        return out

    def known(self, item_id: str) -> bool:
        return item_id in self.index

    def to_dict(self) -> dict[str, object]:
        return {"item_ids": self.item_ids, "n_oov_buckets": self.n_oov}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ItemVocab:
        return cls(list(data["item_ids"]), int(data["n_oov_buckets"]))  # type: ignore[call-overload, arg-type]
