"""The rank path's replay pass on a GPU: correctness against the CPU reference and time of
each form, on fresh random inputs.

    python3 bench/gpu_replay.py [--out DIR]     (DIR = $OUT, else bench/results)

Default configuration (2 layers, 4 heads, K = V = 64, momentum), a freshly initialised
model, random states at positions across the Proteus schedule. Checks, in float32 on the
device against float64 on the CPU:
- ``memory_readout_chunk`` (one-chunk read-out) against ``memory_scan_reference``'s y;
- ``replay_read`` eager and through ``GraphedReplay`` (CUDA graphs) against the CPU model's
  ``advance(...).state.h`` (float64).
Times per call (device synchronised), for B users x T events: the full ``advance`` (the
Triton scan, state written), eager ``replay_read`` and the graphed one. Writes
DIR/replay_gpu.json (machine, date, commit, errors, timings) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchinfo import git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from models.graphs import GraphedReplay
    from models.memory.naive import memory_scan_reference
    from models.memory.readout import memory_readout_chunk
    from models.recommender import MemoryRecommender
    from models.state import MemoryState
    from recmem.config import Config

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Config()
    n_items = 3706
    torch.manual_seed(0)
    cpu_model = MemoryRecommender(n_items, cfg.model.n_oov_buckets, cfg.memory, cfg.model).eval()
    model = copy.deepcopy(cpu_model).to(dev).eval()
    ref_model = copy.deepcopy(cpu_model).double().eval()
    L, H, K, V, D = 2, 4, 64, 64, cfg.model.embed_dim
    g = torch.Generator().manual_seed(1)

    def state(B: int) -> MemoryState:
        st = MemoryState.zeros(B, L, H, K, V, True, D)
        st.S = torch.randn(B, L, H, K, V, generator=g) * 0.1
        st.M = torch.randn(B, L, H, K, V, generator=g) * 0.01
        st.pos = torch.randint(0, 400, (B,), generator=g)
        st.last_ts = torch.full((B,), 1_600_000_000_000)
        st.h = torch.randn(B, D, generator=g)
        return st

    def events(B: int, T: int) -> tuple[torch.Tensor, ...]:
        items = torch.randint(0, n_items, (B, T), generator=g)
        actions = torch.randint(0, 6, (B, T), generator=g)
        ts = 1_600_000_000_000 + torch.cumsum(
            torch.randint(60_000, 600_000, (B, T), generator=g), 1
        )
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = T
        return items, actions, ts, lengths

    def to(x: Any, where: Any, dtype: Any = None) -> Any:
        if isinstance(x, MemoryState):
            return x.map(lambda t: to(t, where, dtype))
        if dtype is not None and x.is_floating_point():
            return x.to(where, dtype)
        return x.to(where)

    graphed = GraphedReplay(model, max_batch=64)
    t0 = time.perf_counter()
    shapes = graphed.capture_all(model.init_state(1, dev)) if graphed.capture else 0
    capture_s = time.perf_counter() - t0
    errors: dict[str, float] = {}
    with torch.inference_mode():
        # the one-chunk read-out, random inputs across the schedule
        worst = 0.0
        for B, T in [(3, 9), (8, 24), (5, 40), (16, 64)]:
            q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
            v = torch.randn(B, T, H, V, generator=g)
            th, eta = torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
            al = torch.rand(B, T, H, generator=g) * 0.3
            S0, M0 = torch.randn(B, H, K, V, generator=g), torch.randn(B, H, K, V, generator=g)
            pos, ln = (
                torch.randint(0, 300, (B,), generator=g),
                torch.randint(0, T + 1, (B,), generator=g),
            )
            kw = dict(n_blocks=16, horizon=256, qk_l2norm=True)
            ins = [q, k, v, th, eta, al, S0, M0, pos, ln]
            y_ref = memory_scan_reference(
                *(x.double() if x.is_floating_point() else x for x in ins), **kw
            )[0]
            y = memory_readout_chunk(*(to(x, dev) for x in ins), **kw)
            worst = max(worst, float((y.double().cpu() - y_ref).abs().max() / y_ref.abs().max()))
        errors["readout_chunk_vs_reference_rel"] = worst
        worst_e = worst_g = 0.0
        for B, T in [(1, 9), (8, 24), (5, 17), (32, 40), (64, 64)]:
            st, ev = state(B), events(B, T)
            want = ref_model.advance(*ev, to(st, "cpu", torch.float64)).state.h
            eager = model.replay_read(*(to(x, dev) for x in ev), to(st, dev))
            got = graphed(*(to(x, dev) for x in ev), to(st, dev))
            scale = float(want.abs().max())
            worst_e = max(worst_e, float((eager.double().cpu() - want).abs().max()) / scale)
            worst_g = max(worst_g, float((got.double().cpu() - want).abs().max()) / scale)
        errors["replay_read_eager_vs_cpu_float64_rel"] = worst_e
        errors["replay_read_graphed_vs_cpu_float64_rel"] = worst_g

        def timed(fn: Any) -> float:
            for _ in range(3):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / args.calls * 1e3

        rows = []
        for B in (1, 8, 32, 64):
            for T in (9, 24, 40):
                st, ev = to(state(B), dev), tuple(to(x, dev) for x in events(B, T))
                row = {
                    "users": B,
                    "events": T,
                    "advance_ms": timed(lambda ev=ev, st=st: model.advance(*ev, st)),
                    "replay_read_ms": timed(lambda ev=ev, st=st: model.replay_read(*ev, st)),
                    "graphed_ms": timed(lambda ev=ev, st=st: graphed(*ev, st)),
                }
                rows.append(row)
                print(
                    f"B={B:3d} T={T:3d}: advance {row['advance_ms']:.3f} ms, read-out "
                    f"{row['replay_read_ms']:.3f} ms, graphed {row['graphed_ms']:.3f} ms",
                    flush=True,
                )
    print("errors:", errors)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "gpu_replay",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["bench/gpu_replay.py", *sys.argv[1:]]),
        "machine": {
            "device": str(dev),
            "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "graphs": {"shapes": shapes, "capture_seconds": capture_s, "calls": graphed.calls},
        "errors": errors,
        "timings": rows,
    }
    name = "replay_gpu.json" if dev.type == "cuda" else "replay_cpu.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
