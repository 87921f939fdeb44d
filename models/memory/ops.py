"""One entry point for the memory scan, dispatching to the path that fits the device.

Every backend has the signature of ``naive.memory_scan_reference``:
(q, k, v, theta, eta, alpha, S0, M0, pos0, lengths, *, n_blocks, horizon, qk_l2norm)
-> (y, S, M). ``eta=None`` selects the gated delta rule (no momentum).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.memory.naive import memory_scan_reference
from models.memory.recurrent import memory_scan_recurrent

ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

BACKENDS: dict[str, ScanFn] = {
    "reference": memory_scan_reference,
    "recurrent": memory_scan_recurrent,
}


def resolve_backend(name: str, device: torch.device, training: bool) -> str:
    """The backend ``auto`` stands for on this device; other names pass through."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "chunk" if training and "chunk" in BACKENDS else "recurrent"
    return "chunk" if training and "chunk" in BACKENDS else "recurrent"


def memory_scan(*args: Any, backend: str = "auto", training: bool = False, **kwargs: Any):
    q = args[0] if args else kwargs["q"]
    name = resolve_backend(backend, q.device, training)
    if name not in BACKENDS:
        raise ValueError(
            f"memory backend {name!r} is not available here (have: {sorted(BACKENDS)})"
        )
    return BACKENDS[name](*args, **kwargs)
