"""``torch.compile`` for the packed CPU ingest step, one graph per function for every batch.

The packed step's sizes change with every micro-batch (events N, (chunk, user) pairs R,
the users of a chunk), so a plainly compiled function would recompile on every new size
and soon hit dynamo's recompile limit. Each function compiled here takes tensors whose
FIRST dimension is the only one that varies (events or rows); that dimension is marked
dynamic on every call, every other one (heads, K, V, the chunk width, the model's widths)
is a constant of the graph. So one graph serves every batch once it is compiled, and the
generated code keeps the static inner sizes (vectorised, unrolled loops). A call with a
first dimension under 2 runs the plain function instead: dynamo specialises sizes 0 and 1,
which would be a second graph.

With ``cpp_wrapper`` the whole graph runs in C++ with the GIL released (inductor's C++
wrapper), instead of a Python wrapper that calls each fused kernel holding the GIL: the
engine thread then leaves the GIL to the Kafka consumer's thread for the graph's whole
duration (docs/ingest.md, "Compiled step").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch._dynamo


class RowsDynamic:
    """``fn`` compiled once for all sizes of the first dimension of its tensor arguments
    (module docstring); ``fn`` itself (``plain``) for a call where one is under 2. Other
    arguments (a module, flags) are passed through; flags are constants of the graph."""

    def __init__(self, fn: Callable[..., Any], *, cpp_wrapper: bool) -> None:
        self.plain = fn
        self.compiled = torch.compile(
            fn, fullgraph=True, dynamic=None, options={"cpp_wrapper": cpp_wrapper}
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.shape[0] < 2 for t in tensors):
            return self.plain(*args, **kwargs)
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)
        return self.compiled(*args, **kwargs)


def scripted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as TorchScript: the same ATen operations in the same order (bit-identical
    results), run by TorchScript's interpreter in C++ with the GIL released for the whole
    call. For the chunk loop, whose many small in-place operations a compiled graph cannot
    express without rewriting whole tensors (``chunk_aligned.ChunkOps``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notice
        return cast(Callable[..., Any], torch.jit.script(fn))
