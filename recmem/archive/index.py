"""FAISS address index of one user's notes.

Layout: one small exact inner-product index per user, one vector per note: the note's
per-channel unit addresses laid side by side, [rho_0 | rho_1 | ... | rho_{C_ch-1}]
(dimension C_ch * d_rho). A query for channel c is placed in block c and is zero
elsewhere, so its inner product with a note vector is exactly cos(u_c, rho_c): a channel
only ever matches the same channel's addresses, and a search touches this user's notes
only (no other user's vectors are scanned). Row i of the index is the user's i-th note in
chronological order; eviction rebuilds the index from the kept addresses (<= the cap).

A GPU index (GpuIndexFlatIP) is used when the installed faiss was built with GPU support
and sees a device; otherwise IndexFlatIP on the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)


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


def block_queries(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u [n, C_ch, d_rho] unit queries -> block-embedded rows [n * C_ch, C_ch * d_rho]
    (row tau * C_ch + c carries u[tau, c] in block c) and the channel of each row."""
    n, n_ch, dim = u.shape
    rows = np.zeros((n, n_ch, n_ch, dim), dtype=np.float32)
    ch = np.arange(n_ch)
    rows[:, ch, ch, :] = u
    return rows.reshape(n * n_ch, n_ch * dim), np.tile(ch, n)


class UserAddressIndex:
    """The address index of one user's notes (see the module docstring for the layout)."""

    def __init__(self, n_channels: int, address_dim: int, gpu: Any | None = None) -> None:
        self.n_channels = n_channels
        self.address_dim = address_dim
        self.dim = n_channels * address_dim
        self._gpu = gpu
        self._index = self._new()

    def _new(self) -> Any:
        if self._gpu is not None:
            return faiss.GpuIndexFlatIP(self._gpu, self.dim)
        return faiss.IndexFlatIP(self.dim)

    @property
    def size(self) -> int:
        return int(self._index.ntotal)

    def add(self, addresses: np.ndarray) -> None:
        """Append notes (chronologically after the present ones), addresses [n, C_ch, d_rho]."""
        if len(addresses):
            self._index.add(np.ascontiguousarray(addresses.reshape(len(addresses), self.dim)))

    def rebuild(self, addresses: np.ndarray) -> None:
        """Replace the contents with ``addresses`` [n, C_ch, d_rho] (after eviction or load)."""
        self._index.reset()
        self.add(addresses)

    def similarities(self, u: np.ndarray) -> np.ndarray:
        """cos(u[tau, c], rho_c of note i) for unit queries u [n, C_ch, d_rho]:
        [n, C_ch, notes] (exact: the search returns every note of the user)."""
        n, total = u.shape[0], self.size
        out = np.zeros((n * self.n_channels, total), dtype=np.float32)
        if total == 0 or n == 0:
            return out.reshape(n, self.n_channels, total)
        rows, _ = block_queries(u)
        if self._gpu is None:
            # A search here is a few hundred vectors: OpenMP threads only add wake-up and
            # barrier latency (p99 of tens of ms on a busy 2-core host). The setting is
            # per calling thread and lives in faiss's own libgomp (torch's is separate).
            faiss.omp_set_num_threads(1)
        sims, ids = self._index.search(rows, total)
        np.put_along_axis(out, ids, sims, axis=1)
        return out.reshape(n, self.n_channels, total)
