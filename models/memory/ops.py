"""One entry point for the memory scan, dispatching to the path that fits the device.

Every backend has the signature of ``naive.memory_scan_reference``:
(q, k, v, theta, eta, alpha, S0, M0, pos0, lengths, *, n_blocks, horizon, qk_l2norm)
-> (y, S, M). ``eta=None`` selects the gated delta rule (no momentum).

Backends: ``reference`` (the definition), ``recurrent`` (vectorised, one step per event),
``chunk`` (exact chunked form for training, takes ``chunk_size``), ``chunk_aligned`` (the
chunked form for inference with chunks aligned to the Proteus schedule, no autograd, takes
``chunk_size``), ``triton`` (our fused CUDA kernel, forward only), ``triton_chunk`` (our
chunked CUDA kernel, forward only; by name only, ``auto`` does not pick it), and on CUDA
machines with flash-linear-attention ``fla_chunk`` and ``fla_recurrent`` (gated delta rule
only; ``fla`` is an alias of ``fla_chunk``).

With ``training=True`` the names ``triton`` and ``fla_chunk`` stand for the fused paths
with a backward pass (``training.py``: ``triton_train.py``, fla's ``chunk_kda``), run
under a guard that falls back to the eager chunked form.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from models.memory.chunk import DEFAULT_CHUNK_SIZE, memory_scan_chunk
from models.memory.chunk_aligned import aligned_chunk_size, memory_scan_chunk_aligned
from models.memory.naive import memory_scan_reference
from models.memory.readout import READOUT_MAX_EVENTS, memory_readout_chunk
from models.memory.recurrent import at_last_event, flush_denormals, memory_scan_recurrent
from models.memory.training import FUSED, guarded_scan, path_checked
from models.memory.triton_chunk import memory_scan_triton_chunk
from models.memory.triton_momentum import memory_scan_triton

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "backend_names",
    "flush_denormals",
    "memory_readout",
    "memory_scan",
    "resolve_backend",
]

ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

BACKENDS: dict[str, ScanFn] = {
    "reference": memory_scan_reference,
    "recurrent": memory_scan_recurrent,
    "chunk": memory_scan_chunk,
    "chunk_aligned": memory_scan_chunk_aligned,
    "triton": memory_scan_triton,
    "triton_chunk": memory_scan_triton_chunk,
}
FLA_BACKENDS = ("fla_chunk", "fla_recurrent")
"""Registered in BACKENDS only on CUDA machines with flash-linear-attention."""
ALIASES = {"fla": "fla_chunk"}
TAKES_CHUNK_SIZE = ("chunk", "chunk_aligned")

CPU_CHUNK_MIN_EVENTS = 20
CPU_CHUNK_MIN_CELLS = 320
CPU_CHUNK_ALWAYS_EVENTS = 48
"""On the CPU without gradients, ``auto`` runs a batch of B users and T events in aligned
chunks when T >= CPU_CHUNK_ALWAYS_EVENTS, or T >= CPU_CHUNK_MIN_EVENTS and B * T >=
CPU_CHUNK_MIN_CELLS; narrower or smaller batches run one event at a time. The chunked
form touches the state once per chunk, not once per event, but pays a fixed set-up per call
and pads each user's first chunk; the thresholds are where the two paths measured level
(the engine's ML-100K calls, and single users to batches of 16 at 20-64 events)."""
CPU_CHUNK_MIN_SIZE = 4
"""... and only when the aligned chunk (a divisor of the schedule's Delta) is this wide."""


def _register_fla() -> None:
    """fla's kernels need CUDA; register them only where they can run."""
    if not torch.cuda.is_available():
        return
    if importlib.util.find_spec("fla") is None:
        log.info("flash-linear-attention is not installed: no fla backends")
        return
    from models.memory.fla_gated import memory_scan_fla_chunk, memory_scan_fla_recurrent

    BACKENDS.update(zip(FLA_BACKENDS, (memory_scan_fla_chunk, memory_scan_fla_recurrent)))


_register_fla()


def backend_names() -> list[str]:
    """Every name ``memory.backend`` may take: ``auto``, the backends (including those this
    machine cannot run, such as fla's on a CPU-only host) and their aliases."""
    return ["auto", *sorted({*BACKENDS, *FLA_BACKENDS, *ALIASES})]


def resolve_backend(
    name: str,
    device: torch.device,
    training: bool,
    *,
    length: int | None = None,
    users: int = 1,
    chunk: int = 1,
) -> str:
    """The backend ``auto`` stands for on this device; aliases resolve, other names pass.

    Training needs gradients: our fused kernels with their backward pass on CUDA (used once
    checked, ``training.path_checked``), the chunked form on CPU. Inference: our Triton kernel on
    CUDA (both variants); on CPU the aligned chunked form for batches of ``users`` users
    ``length`` events wide that are large enough (CPU_CHUNK_*) and whose aligned chunk size
    ``chunk`` is >= CPU_CHUNK_MIN_SIZE (no gradient wanted: ``length`` given), else the
    vectorised recurrent path.
    """
    if name != "auto":
        return ALIASES.get(name, name)
    if training:
        return "triton" if device.type == "cuda" else "chunk"
    if device.type == "cuda":
        return "triton"
    if length is not None and chunk >= CPU_CHUNK_MIN_SIZE:
        wide = length >= CPU_CHUNK_MIN_EVENTS and users * length >= CPU_CHUNK_MIN_CELLS
        if wide or length >= CPU_CHUNK_ALWAYS_EVENTS:
            return "chunk_aligned"
    return "recurrent"


def memory_scan(
    *args: Any,
    backend: str = "auto",
    training: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the scan on the backend ``backend`` resolves to; ``chunk_size`` goes to the
    chunked forms. ``auto`` picks per call, by the batch's width T, on the CPU."""
    q = args[0] if args else kwargs["q"]
    length = None
    if not (torch.is_grad_enabled() and any(_needs_grad(a) for a in (*args, *kwargs.values()))):
        length = q.shape[1]
    chunk = aligned_chunk_size(chunk_size, kwargs["n_blocks"], kwargs["horizon"])
    name = resolve_backend(
        backend, q.device, training, length=length, users=q.shape[0], chunk=chunk
    )
    if training and name in FUSED:
        return _fused_training_scan(name, backend == "auto", chunk_size, args, kwargs)
    if name not in BACKENDS:
        raise ValueError(
            f"memory backend {name!r} is not available here (have: {sorted(BACKENDS)})"
        )
    if name in TAKES_CHUNK_SIZE:
        kwargs["chunk_size"] = chunk_size
    return BACKENDS[name](*args, **kwargs)


SCAN_ARGS = ("q", "k", "v", "theta", "eta", "alpha", "S0", "M0", "pos0", "lengths")


def _fused_training_scan(
    name: str, checked: bool, chunk_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A fused training path under its guard; chosen by ``auto`` it must first pass
    ``path_checked`` for these sizes, else the eager chunked form runs."""
    kwargs = dict(kwargs)
    tensors = list(args) + [kwargs.pop(n) for n in SCAN_ARGS[len(args) :]]
    q, v, eta, M0 = tensors[0], tensors[2], tensors[4], tensors[7]
    kwargs["chunk_size"] = chunk_size
    momentum = eta is not None and M0 is not None
    if checked and not path_checked(
        name, q.device, momentum, q.shape[2], q.shape[3], v.shape[3], **kwargs
    ):
        return memory_scan_chunk(*tensors, **kwargs)
    y, S, M = guarded_scan(name, *tensors, **kwargs)
    return y, S, M


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


CPU_READOUT_MIN_EVENTS = 16
CPU_READOUT_MIN_USERS = 4
"""On the CPU ``memory_readout`` takes the one-chunk form for runs of T >= 16 events or
batches of B >= 4 users (``bench/bench_memory.py --readout``, memory_readout_cpu.json:
0.78x of the recurrent path at one user x 9 events, 1.09x at 1 x 24, 1.34x at 8 x 9, 1.67x
at 8 x 24, 2.5x at 32 x 24);
smaller calls walk the events. On CUDA it always does (no host synchronisation: the rank
path can capture it in a CUDA graph)."""


def memory_readout(
    *args: Any,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    last_only: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """y of ``memory_scan`` without the state after the events (no autograd): the rank
    path's replay on a throw-away copy. ``auto`` runs ``readout.memory_readout_chunk`` when
    the run is at most READOUT_MAX_EVENTS long and, on the CPU, wide enough (above); any
    other case, or an explicit backend, runs ``memory_scan`` and drops its state. With
    ``last_only`` only each user's output at its last event, [B, 1, H, V] (zeros for a user
    without events)."""
    q = args[0] if args else kwargs["q"]
    B, T = q.shape[:2]
    if backend == "auto" and T <= READOUT_MAX_EVENTS:
        wide = T >= CPU_READOUT_MIN_EVENTS or B >= CPU_READOUT_MIN_USERS
        if q.device.type == "cuda" or wide:
            return memory_readout_chunk(*args, last_only=last_only, **kwargs)
    with torch.no_grad():
        y = memory_scan(*args, backend=backend, chunk_size=chunk_size, **kwargs)[0]
    if not last_only:
        return y
    lengths = args[9] if len(args) > 9 else kwargs["lengths"]
    return at_last_event(y, lengths)[:, None]  # a user without events reads padding: 0
