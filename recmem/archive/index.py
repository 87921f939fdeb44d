"""FAISS address index of one user's notes.

Layout: one small exact inner-product index per user (dimension d_rho) holding one row per
(note, channel): row i * C_ch + c is the unit address rho_c of the user's i-th note in
chronological order. A search touches this user's rows only, never another user's.

Route needs, for every query position tau and channel c, the cosine with channel c's
address of EVERY note (votes take the per-channel max over positions, the tie-break sums
them). The cosine is taken on the note's open coordinates: an address P q~ written while
the Proteus schedule had only some key blocks open is zero past its last open coordinate,
so the query is compared on that prefix only (u . rho / |u[:open]|). With every block
open this is the plain cosine; without it, a query from a later position (more blocks
open) would lose cosine to every older note and routing would lean to recent notes. On the CPU ``compute_distance_subset`` scores query (tau, c) against exactly the
rows c, C_ch + c, 2 C_ch + c, ...: no other channel's rows, no top-k heap. On a GPU
(``GpuIndexFlatIP``, when the installed faiss has GPU support and sees a device) the
index is searched for all of its rows (k = rows, at most 2048 there) and the channel's
columns are picked out. Eviction rebuilds the index from the kept notes (<= the cap).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)

GPU_MAX_K = 2048
"""The largest k a faiss GPU search accepts."""


def gpu_resources(use_gpu: bool | None) -> Any | None:
    """Shared faiss GPU resources, or None for CPU indexes. ``use_gpu`` None = automatic
    (GPU when faiss has GPU support and sees a device); True demands a GPU."""
    has_gpu = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if use_gpu is None:
        use_gpu = has_gpu
    if not use_gpu:
        return None
    if not has_gpu:
        raise ValueError("a GPU address index was requested but faiss has no GPU support here")
    log.info("NoteBank: FAISS GPU indexes")
    return faiss.StandardGpuResources()


def open_dims(addresses: np.ndarray) -> np.ndarray:
    """[..., C_ch] how many leading coordinates of each address [..., C_ch, d_rho] can be
    nonzero: one past the last nonzero coordinate (0 for an all-zero address)."""
    nonzero = addresses != 0
    last = addresses.shape[-1] - np.argmax(nonzero[..., ::-1], axis=-1)
    return np.where(nonzero.any(axis=-1), last, 0).astype(np.int64)


def masked_cosines(raw: np.ndarray, u: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """raw [..., n, C_ch, notes] = u . rho for unit queries u [..., n, C_ch, d_rho] -> the
    cosine on each note's open prefix, u . rho / |u[:open]| (0 where that prefix of u is
    zero); open_ [..., notes, C_ch] (leading axes: several users at once)."""
    d = u.shape[-1]
    sq = np.ascontiguousarray(np.moveaxis(u.astype(np.float32) ** 2, -1, 0))  # [d, ..., n, C]
    cum = np.zeros((d + 1, *sq.shape[1:]), dtype=np.float32)
    for j in range(d):  # float32 prefix sums as np.cumsum adds them, a slice at a time:
        np.add(cum[j], sq[j], out=cum[j + 1])  # cumsum's loop per row costs more (short d)
    cum = np.sqrt(cum)
    cells = cum[0].size  # cum[o] holds |u[:o]| of every (position, channel)
    idx = np.swapaxes(open_, -1, -2)[..., None, :, :]  # [..., 1, C_ch, notes]
    flat = idx * cells + np.arange(cells).reshape(cum.shape[1:])[..., None]
    norm = cum.reshape(-1)[np.broadcast_to(flat, raw.shape)]  # |u[tau, c, :open[i, c]]|
    return np.where(norm > 1e-6, raw / np.maximum(norm, 1e-6), 0.0).astype(np.float32)


@functools.lru_cache(maxsize=512)
def _subset_labels(n: int, ch: int, notes: int) -> np.ndarray:
    """[n * ch, notes] (read-only, shared by every user's index): query row tau * ch + c is
    scored against rows i * ch + c of every note i."""
    labels = np.ascontiguousarray(
        np.tile(np.arange(notes, dtype=np.int64)[None, :] * ch, (n * ch, 1))
        + np.tile(np.arange(ch, dtype=np.int64), n)[:, None]
    )
    labels.setflags(write=False)
    return labels


class UserAddressIndex:
    """The address index of one user's notes (see the module docstring for the layout)."""

    def __init__(self, n_channels: int, address_dim: int, gpu: Any | None = None) -> None:
        self.n_channels = n_channels
        self.address_dim = address_dim
        self._gpu = gpu
        self._open = np.zeros((0, n_channels), dtype=np.int64)
        self._rows: np.ndarray | None = None
        """A view of the CPU index's rows, made on demand; reset by ``add`` and ``rebuild``."""
        self._index: Any = (
            faiss.GpuIndexFlatIP(gpu, address_dim)
            if gpu is not None
            else faiss.IndexFlatIP(address_dim)
        )

    @property
    def size(self) -> int:
        """Notes in the index."""
        return int(self._index.ntotal) // self.n_channels

    def add(self, addresses: np.ndarray) -> None:
        """Append notes (chronologically after the present ones), addresses [n, C_ch, d_rho]."""
        if len(addresses):
            self._rows = None  # the storage may move
            rows = addresses.reshape(-1, self.address_dim).astype(np.float32)
            self._index.add(np.ascontiguousarray(rows))
            self._open = np.concatenate([self._open, open_dims(addresses)])

    def rebuild(self, addresses: np.ndarray) -> None:
        """Replace the contents with ``addresses`` [n, C_ch, d_rho] (after eviction or load)."""
        self._index.reset()
        self._rows = None
        self._open = np.zeros((0, self.n_channels), dtype=np.int64)
        self.add(addresses)

    def rows(self) -> np.ndarray | None:
        """[notes * C_ch, d_rho] the index's stored rows (a view, valid until the next
        ``add`` or ``rebuild``), or None for a GPU index."""
        if self._gpu is not None:
            return None
        if self._rows is None:
            total = int(self._index.ntotal)
            if total == 0:
                return np.zeros((0, self.address_dim), dtype=np.float32)
            flat = faiss.rev_swig_ptr(self._index.get_xb(), total * self.address_dim)
            self._rows = np.asarray(flat).reshape(total, self.address_dim)
        return self._rows

    @property
    def open_dims(self) -> np.ndarray:
        """[notes, C_ch] leading coordinates of each note's address that can be nonzero."""
        return self._open

    def similarities(self, u: np.ndarray) -> np.ndarray:
        """Cosine of u[tau, c] and rho_c of note i on the note's open prefix (module
        docstring) for unit queries u [n, C_ch, d_rho]: [n, C_ch, notes], exact."""
        return masked_cosines(self.inner_products(u), u, self._open)

    def inner_products(self, u: np.ndarray) -> np.ndarray:
        """u[tau, c] . rho_c of every note for queries u [n, C_ch, d_rho]: [n, C_ch, notes]."""
        n, ch, notes = u.shape[0], self.n_channels, self.size
        if notes == 0 or n == 0:
            return np.zeros((n, ch, notes), dtype=np.float32)
        queries = np.ascontiguousarray(u.reshape(n * ch, self.address_dim), dtype=np.float32)
        return self._inner_products(queries, n)

    def _inner_products(self, queries: np.ndarray, n: int) -> np.ndarray:
        """u . rho for query rows tau * C_ch + c: [n, C_ch, notes]."""
        ch, notes = self.n_channels, self.size
        if self._gpu is not None:
            return self._inner_products_gpu(queries, n)
        labels = _subset_labels(n, ch, notes)
        out = np.empty((n * ch, notes), dtype=np.float32)
        # A few hundred rows: OpenMP threads only add wake-up and barrier latency (p99 of
        # tens of ms on a busy 2-core host). The setting is per calling thread and lives
        # in faiss's own libgomp (torch's is separate).
        faiss.omp_set_num_threads(1)
        self._index.compute_distance_subset(
            n * ch, faiss.swig_ptr(queries), notes, faiss.swig_ptr(out), faiss.swig_ptr(labels)
        )
        return out.reshape(n, ch, notes)

    def _inner_products_gpu(self, queries: np.ndarray, n: int) -> np.ndarray:
        ch, total = self.n_channels, int(self._index.ntotal)
        if total > GPU_MAX_K:
            raise ValueError(f"a GPU address index holds at most {GPU_MAX_K} rows, has {total}")
        sims, ids = self._index.search(queries, total)
        full = np.zeros((n * ch, total), dtype=np.float32)
        np.put_along_axis(full, ids, sims, axis=1)
        channel = np.tile(np.arange(ch), n)
        cols = np.arange(0, total, ch)[None, :] + channel[:, None]
        return np.take_along_axis(full, cols, axis=1).reshape(n, ch, total // ch)


def inner_products_by_rows(queries: np.ndarray, rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """queries [m, d] . rows[labels[i, j]] for labels [m, k] (-inf where a label is < 0):
    the faiss routine ``compute_distance_subset`` runs for a CPU index (so the same float32
    values), over rows [r, d] gathered from several users' indexes, in one call."""
    m, k = labels.shape
    out = np.empty((m, k), dtype=np.float32)
    if m == 0 or k == 0:
        return out
    q = np.ascontiguousarray(queries, dtype=np.float32)
    y = np.ascontiguousarray(rows, dtype=np.float32)
    ids = np.ascontiguousarray(labels, dtype=np.int64)
    if len(y) == 0:  # every label is < 0
        out.fill(-np.inf)
        return out
    faiss.omp_set_num_threads(1)  # as in UserAddressIndex._inner_products
    faiss.fvec_inner_products_by_idx(  # type: ignore[attr-defined]  # not in faiss's stubs
        faiss.swig_ptr(out), faiss.swig_ptr(q), faiss.swig_ptr(y), faiss.swig_ptr(ids),
        q.shape[1], m, k,
    )  # fmt: skip
    return out
