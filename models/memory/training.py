"""The fused training paths, guarded so that they can never stop a training.

``memory.train_backend`` picks the scan of a training step (``ops.memory_scan`` with
``training=True``):

- ``chunk``: the eager exact chunked form (chunk.py), autograd; any device.
- ``triton``: our fused forward and backward kernels (triton_train.py), both rules; CUDA.
- ``fla_chunk`` (``fla``): fla's ``chunk_kda`` with its backward (fla_gated.py), the rule
  without momentum only; CUDA.
- ``recurrent``, ``reference``: the plain forms (tests).
- ``auto``: ``triton`` on CUDA once it has passed the check below for the layer's sizes,
  else ``chunk``.

The guard. A fused path runs inside ``GuardedScan``, an autograd function that keeps the
path's own graph: if the path raises in the forward pass, or later in its backward pass
(a kernel that does not compile on this machine, say), one warning is logged, the path is
off for the rest of the process, and the step's outputs or gradients come from the eager
chunked form on the same inputs. Before ``auto`` first uses a path on a device it checks
it (``path_checked``): a small problem of the layer's sizes (users across Proteus unlocks,
padding) through the path and through the eager form in float32; outputs and every input
gradient must agree to CHECK_TOL relative (Frobenius) error, or ``auto`` keeps the eager
form.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from models.memory.chunk import memory_scan_chunk
from models.memory.proteus import schedule_delta
from models.memory.triton_train import memory_scan_triton_train

log = logging.getLogger(__name__)

ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

TRAIN_BACKENDS = ("auto", "chunk", "triton", "fla_chunk", "fla", "recurrent", "reference")
FUSED = ("triton", "fla_chunk")
CHECK_TOL = 1e-3
"""Relative error a fused path may show against the eager form in ``path_checked``."""
CHECK_EVENTS = 133
"""Most events per user in a check's inputs (``check_inputs``)."""

_eager: ScanFn = memory_scan_chunk
"""The form every guard falls back to (typed loosely: it is called with a list of inputs)."""
_disabled: set[str] = set()
_checked: dict[tuple[Any, ...], bool] = {}


def check_train_backend(name: str, momentum: bool) -> None:
    """Reject a ``memory.train_backend`` that cannot train this rule, naming the field."""
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"memory.train_backend {name!r} is not one of {'|'.join(TRAIN_BACKENDS)}")
    if momentum and name in ("fla", "fla_chunk"):
        raise ValueError(
            "memory.train_backend fla_chunk covers only the rule without momentum "
            "(memory.momentum = false); use triton or chunk"
        )


def fused_scan(name: str) -> ScanFn:
    """The fused path's scan function (fla is imported here, on first use)."""
    if name == "triton":
        return memory_scan_triton_train
    if name == "fla_chunk":
        from models.memory.fla_gated import memory_scan_fla_chunk_train

        return memory_scan_fla_chunk_train
    raise ValueError(f"no fused training path {name!r}")


def _disable(name: str, stage: str, err: BaseException) -> None:
    if name not in _disabled:
        log.warning(
            "memory training path %s failed in its %s pass (%s: %s); training goes on "
            "with the eager chunked form", name, stage, type(err).__name__, err,
        )  # fmt: skip
    _disabled.add(name)


def path_disabled(name: str) -> bool:
    """Whether ``name`` failed earlier in this process (and is no longer tried)."""
    return name in _disabled


class GuardedScan(torch.autograd.Function):
    """(name, eager kwargs, q, k, v, theta, eta, alpha, S0, M0, pos0, lengths) ->
    (y, S[, M]) through the fused path ``name``, or the eager chunked form when it fails.
    Returns M only for the momentum rule."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, name: str, kwargs: dict[str, Any], *tensors: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        *inputs, pos0, lengths = tensors
        needs = ctx.needs_input_grad[2:10]
        with torch.enable_grad():
            leaves = [
                None if x is None else x.detach().requires_grad_(bool(need))
                for x, need in zip(inputs, needs, strict=True)
            ]
            outs = None
            if name not in _disabled:
                try:
                    outs = fused_scan(name)(*leaves, pos0, lengths, **_fused_kwargs(kwargs))
                except Exception as err:  # never stop a training: fall back
                    _disable(name, "forward", err)
            if outs is None:
                outs = _eager(*leaves, pos0, lengths, **kwargs)
        momentum = inputs[4] is not None and inputs[7] is not None
        y, S, M = outs
        kept = (y, S, M) if momentum and M is not None else (y, S)
        ctx.name, ctx.kwargs = name, kwargs
        ctx.inner = (kept, leaves, pos0, lengths)
        return tuple(x.detach() for x in kept if x is not None)

    @staticmethod
    def backward(ctx: Any, *douts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        kept, leaves, pos0, lengths = ctx.inner
        ctx.inner = None
        wanted = [x for x in leaves if x is not None and x.requires_grad]
        try:
            got = _grads(kept, wanted, douts)
        except Exception as err:  # never stop a training: fall back
            _disable(ctx.name, "backward", err)
            with torch.enable_grad():
                fresh = [None if x is None else x.detach().requires_grad_(x.requires_grad)
                         for x in leaves]  # fmt: skip
                y, S, M = _eager(*fresh, pos0, lengths, **ctx.kwargs)
                outs = (y, S, M)[: len(kept)] if M is not None else (y, S)
                got = _grads(outs, [x for x in fresh if x is not None and x.requires_grad], douts)
        it = iter(got)
        grads = [next(it) if x is not None and x.requires_grad else None for x in leaves]
        return (None, None, *grads, None, None)


def _grads(
    outs: tuple[torch.Tensor, ...],
    wanted: list[torch.Tensor],
    douts: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor | None, ...]:
    pairs = [(o, g) for o, g in zip(outs, douts, strict=True) if g is not None and o.requires_grad]
    if not wanted or not pairs:
        return tuple(None for _ in wanted)
    return torch.autograd.grad(
        [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
    )


def _fused_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The eager form's keyword arguments without its chunk size."""
    return {k: v for k, v in kwargs.items() if k != "chunk_size"}


def guarded_scan(name: str, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """``GuardedScan`` with the common backend signature: (y, S, M); M is M0 as given for
    the rule without momentum. ``kwargs`` are the eager form's (``chunk_size`` included)."""
    q, k, v, theta, eta, alpha, S0, M0, pos0, lengths = args
    out = GuardedScan.apply(name, kwargs, q, k, v, theta, eta, alpha, S0, M0, pos0, lengths)
    if eta is not None and M0 is not None:
        return out[0], out[1], out[2]
    return out[0], out[1], M0


def path_checked(
    name: str,
    device: torch.device,
    momentum: bool,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
    chunk_size: int = 16,
) -> bool:
    """Whether the fused path ``name`` agrees with the eager form on this device for a
    layer of these sizes (checked once per process and sizes; see the module docstring)."""
    if name in _disabled:
        return False
    key = (name, str(device), momentum, heads, key_dim, value_dim, n_blocks, horizon, qk_l2norm)
    if key not in _checked:
        try:
            err = check_against_eager(
                fused_scan(name), device, momentum, heads, key_dim, value_dim,
                n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm, chunk_size=chunk_size,
            )  # fmt: skip
            ok = err <= CHECK_TOL
            if ok:
                log.info("memory training path %s checked on %s: error %.1e", name, device, err)
            else:
                log.warning(
                    "memory training path %s differs from the eager form by %.1e on %s "
                    "(bar %.0e); training uses the eager chunked form", name, err, device,
                    CHECK_TOL,
                )  # fmt: skip
        except Exception as exc:  # a path that cannot run here is simply not used
            log.warning(
                "memory training path %s cannot run on %s (%s: %s); training uses the eager "
                "chunked form", name, device, type(exc).__name__, exc,
            )  # fmt: skip
            ok = False
        _checked[key] = ok
    return _checked[key]


def check_inputs(
    device: torch.device,
    momentum: bool,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    n_blocks: int,
    horizon: int,
    users: int = 4,
    events: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """Random inputs for a check: users starting at position 0, just before a Proteus
    unlock and past the horizon, one with a single event and one with none (padding); any
    further users start anywhere up to twice the horizon (at most 2**30) with 0 to T
    events. T is two unlock intervals, at most CHECK_EVENTS: the user starting 3 events
    before an unlock crosses it either way, and a schedule whose unlocks lie far apart
    (``memory.unlock = narrow``: 2**26 events) does not size the check by them."""
    delta = schedule_delta(n_blocks, horizon)
    T = events if events is not None else min(2 * delta + 5, CHECK_EVENTS)
    g = torch.Generator().manual_seed(seed)
    more = max(users - 4, 0)
    starts = [0, max(delta - 3, 0), horizon + 1, 1]
    starts += torch.randint(0, min(2 * horizon, 2**30) + 1, (more,), generator=g).tolist()
    lens = [T, max(T - 7, 0), 1, 0] + torch.randint(0, T + 1, (more,), generator=g).tolist()

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype).to(device)

    def gate(*shape: int) -> torch.Tensor:
        return torch.sigmoid(torch.randn(*shape, generator=g, dtype=dtype)).to(device)

    B, H, K, V = users, heads, key_dim, value_dim
    return dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, H, V),
        theta=gate(B, T, H),
        eta=gate(B, T, H) if momentum else None,
        alpha=gate(B, T, H) * 0.5,
        S0=rnd(B, H, K, V),
        M0=rnd(B, H, K, V) * 0.5,
        pos0=torch.tensor(starts[:B], dtype=torch.int64, device=device),
        lengths=torch.tensor(lens[:B], dtype=torch.int64, device=device),
    )


def outputs_and_grads(
    scan: ScanFn, inputs: dict[str, Any], seed: int = 1, **kwargs: Any
) -> list[torch.Tensor]:
    """(y, S[, M]) and the gradients of a fixed random weighting of them with respect to
    every float input, as one list."""
    names = [n for n in ("q", "k", "v", "theta", "eta", "alpha", "S0", "M0")
             if inputs[n] is not None and (n != "M0" or inputs["eta"] is not None)]  # fmt: skip
    leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in names}
    with torch.enable_grad():
        y, S, M = scan(**{**inputs, **leaves}, **kwargs)
        outs = [y, S] + ([M] if "M0" in leaves and M is not None else [])
        g = torch.Generator().manual_seed(seed)
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o) for o in outs]
        loss = torch.stack([(o * w).sum() for o, w in zip(outs, weights, strict=True)]).sum()
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    zeros = [torch.zeros_like(leaves[n]) for n in names]
    return [o.detach() for o in outs] + [
        z if gr is None else gr for gr, z in zip(grads, zeros, strict=True)
    ]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over the pairs of ||a - b|| / ||b|| (in float64; 0 where both are 0)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        diff = float((x.double() - y.double()).norm())
        ref = float(y.double().norm())
        worst = max(worst, diff / ref if ref > 0 else diff)
    return worst


def check_against_eager(
    scan: ScanFn,
    device: torch.device,
    momentum: bool,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    n_blocks: int,
    horizon: int,
    qk_l2norm: bool = True,
    chunk_size: int = 16,
) -> float:
    """Worst relative error of ``scan`` against the eager chunked form, outputs and input
    gradients, on ``check_inputs`` (float32 on ``device``)."""
    inputs = check_inputs(
        device, momentum, heads, key_dim, value_dim, n_blocks=n_blocks, horizon=horizon
    )
    kw = dict(n_blocks=n_blocks, horizon=horizon, qk_l2norm=qk_l2norm)
    fast = outputs_and_grads(scan, inputs, **kw)
    eager = outputs_and_grads(memory_scan_chunk, inputs, **kw, chunk_size=chunk_size)
    return relative_error(fast, eager)
