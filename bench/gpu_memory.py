"""Memory paths on one GPU: copy bandwidth, correctness against float64, throughput.

    python3 bench/gpu_memory.py [--out DIR] [--tiny]

(a) device-to-device copy bandwidth (the HBM bound);
(b) every GPU path against the float64 oracle on fresh random inputs (thousands of users,
    positions across block boundaries, lengths 0..T incl. 0 and 1): relative error
    ||out - ref|| / ||ref|| on y, S, M in fp32, bar 1e-3. The oracle is the vectorised
    recurrent path in float64, itself checked against the one-event-at-a-time reference on
    a subsample of users;
(c) H=4, K=V=64, 8192 users x {1, 16, 64} events, state gathered from and written back to a
    slab of 65,536 users: events/s, GB/s of state traffic and its fraction of the copy bound.

Writes DIR/memory_gpu.json (DIR = $OUT, else bench/results) after every step, so a run cut
short keeps what it measured, and prints a short table last. Without CUDA it runs tiny
sizes on CPU and skips the GPU-only paths (a check of the script's logic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from benchinfo import git_commit, versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.memory.chunk import memory_scan_chunk  # noqa: E402
from models.memory.naive import memory_scan_reference  # noqa: E402
from models.memory.recurrent import memory_scan_recurrent  # noqa: E402
from models.memory.triton_momentum import memory_ingest_triton, memory_scan_triton  # noqa: E402

BAR = 1e-3
SCHED = dict(n_blocks=16, horizon=256)  # the config defaults: Delta = 16


def fla_scan(mode: str) -> Callable[..., Any]:
    from models.memory.fla_gated import memory_scan_fla_chunk, memory_scan_fla_recurrent

    return memory_scan_fla_chunk if mode == "chunk" else memory_scan_fla_recurrent


# name -> (momentum, needs CUDA, scan fn factory)
PATHS: dict[str, tuple[bool, bool, Callable[[], Callable[..., Any]]]] = {
    "recurrent_momentum": (True, False, lambda: memory_scan_recurrent),
    "recurrent_delta": (False, False, lambda: memory_scan_recurrent),
    "chunk_momentum": (True, False, lambda: memory_scan_chunk),
    "chunk_delta": (False, False, lambda: memory_scan_chunk),
    "triton_momentum": (True, True, lambda: memory_scan_triton),
    "triton_delta": (False, True, lambda: memory_scan_triton),
    "fla_chunk_kda_delta": (False, True, lambda: fla_scan("chunk")),
    "fla_fused_recurrent_delta": (False, True, lambda: fla_scan("recurrent")),
}


def make_inputs(B: int, T: int, H: int, K: int, V: int, momentum: bool, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    delta = SCHED["horizon"] // SCHED["n_blocks"]
    # Positions: random up to past N, a third placed just before a block boundary.
    pos0 = torch.randint(0, 2 * SCHED["horizon"], (B,), generator=g)
    near = torch.randint(1, SCHED["n_blocks"] + 1, (B,), generator=g) * delta - 1
    pos0 = torch.where(torch.arange(B) % 3 == 0, near, pos0)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[: B // 8] = 0
    lengths[B // 8 : B // 4] = 1
    lengths[B // 4 : B // 4 + 4] = T
    inp = dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, H, V),
        theta=torch.rand(B, T, H, generator=g),
        eta=torch.rand(B, T, H, generator=g) * 0.9 if momentum else None,
        alpha=torch.rand(B, T, H, generator=g) * 0.1,
        S0=rnd(B, H, K, V) * 0.3,
        M0=rnd(B, H, K, V) * 0.1 if momentum else None,
        pos0=pos0,
        lengths=lengths,
    )
    return {n: None if x is None else x.to(device) for n, x in inp.items()}


def cast(inp: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        n: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for n, x in inp.items()
    }


def rel(out: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    if out is None or ref is None:
        return None
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, n_bytes: int) -> dict[str, float]:
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    dt = (time.perf_counter() - t0) / reps
    return {
        "bytes_per_copy": n_bytes,
        "seconds": dt,
        "GBps_read_plus_write": 2 * n_bytes / dt / 1e9,
    }


def check_path(name: str, sizes: dict[str, int], device: str, seed: int) -> dict[str, Any]:
    momentum, _, factory = PATHS[name]
    fn = factory()
    inp = make_inputs(**sizes, momentum=momentum, device=device, seed=seed)
    exact = cast(inp, torch.float64)
    y_ref, S_ref, M_ref = memory_scan_recurrent(**exact, **SCHED)
    # The oracle against the definition, on a few users (incl. lengths 0, 1 and T).
    pick = torch.tensor([0, sizes["B"] // 8, sizes["B"] // 4, sizes["B"] - 1], device=device)
    sub = {n: None if x is None else x[pick] for n, x in exact.items()}
    y_n, S_n, _ = memory_scan_reference(**sub, **SCHED)
    oracle = max(rel(y_ref[pick], y_n) or 0.0, rel(S_ref[pick], S_n) or 0.0)
    y, S, M = fn(**cast(inp, torch.float32), **SCHED)
    err = {"y": rel(y, y_ref), "S": rel(S, S_ref), "M": rel(M, M_ref) if momentum else None}
    worst = max(e for e in err.values() if e is not None)
    pad = torch.arange(sizes["T"], device=device)[None, :] >= inp["lengths"][:, None]
    return {
        "rel_err": err,
        "oracle_vs_reference_rel_err": oracle,
        "padding_outputs_zero": bool(not y[pad].any()),
        "pass": bool(worst <= BAR and not y[pad].any()),
    }


def time_path(
    name: str, users: int, T: int, slab: int, device: str, reps: int, **launch: int
) -> dict[str, Any]:
    momentum, _, factory = PATHS[name]
    H, K, V = 4, 64, 64
    g = torch.Generator(device="cpu").manual_seed(T)
    S_slab = torch.zeros(slab, H, K, V, device=device)
    M_slab = torch.zeros(slab, H, K, V, device=device) if momentum else None
    slots = torch.randperm(slab, generator=g)[:users].to(device)
    pos0 = torch.randint(0, 512, (users,), generator=g).to(device)
    total = users * T
    ev = dict(
        q=torch.randn(total, H, K, device=device),
        k=torch.randn(total, H, K, device=device),
        v=torch.randn(total, H, V, device=device),
        theta=torch.rand(total, H, device=device),
        eta=torch.rand(total, H, device=device) * 0.9 if momentum else None,
        alpha=torch.rand(total, H, device=device) * 0.1,
    )
    lengths = torch.full((users,), T, device=device, dtype=torch.int64)
    cu = torch.arange(users + 1, device=device, dtype=torch.int64) * T

    if name.startswith("triton"):

        def step() -> None:
            memory_ingest_triton(
                **ev, cu_seqlens=cu, pos0=pos0, S_slab=S_slab, M_slab=M_slab, slots=slots,
                **SCHED, validate=False, **launch,
            )  # fmt: skip

    else:
        fn = factory()
        padded = {
            n: None if x is None else x.reshape(users, T, *x.shape[1:]) for n, x in ev.items()
        }

        def step() -> None:
            with torch.no_grad():
                S0 = S_slab[slots]
                M0 = None if M_slab is None else M_slab[slots]
                _, S, M = fn(**padded, S0=S0, M0=M0, pos0=pos0, lengths=lengths, **SCHED)
                S_slab[slots] = S
                if M_slab is not None and M is not None:
                    M_slab[slots] = M

    step()  # compile / autotune
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    state_bytes = users * H * K * V * 4 * 2 * (2 if momentum else 1)  # S (and M), read + write
    return {"users": users, "events_per_user": T, "seconds": dt, "events_per_s": total / dt,
            "state_bytes": state_bytes, "state_GBps": state_bytes / dt / 1e9}  # fmt: skip


def ieee_recheck(out_dir: Path, seconds: float) -> dict[str, Any]:
    """fla's chunk kernels multiply fp32 in TF32 by default; check them with IEEE fp32 dots."""
    sub = out_dir / "ieee"
    env = {**os.environ, "TRITON_F32_DEFAULT": "ieee"}
    cmd = [sys.executable, __file__, "--out", str(sub), "--checks-only", "fla_chunk_kda_delta"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(seconds, 1))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1500:])
    checks = json.loads((sub / "memory_gpu.json").read_text())["checks"]
    return {"env": "TRITON_F32_DEFAULT=ieee", **checks["fla_chunk_kda_delta"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--tiny", action="store_true", help="small sizes (default without CUDA)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what starts after this")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Triton launch shape")
    ap.add_argument("--checks-only", default="", help="comma-separated paths: checks, no timing")
    ap.add_argument(
        "--ieee-recheck",
        action="store_true",
        help="at the end, re-check fla chunk_kda in a subprocess with TRITON_F32_DEFAULT=ieee",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tiny = args.tiny or not cuda
    check_sizes = dict(B=64, T=20, H=2, K=16, V=8) if tiny else dict(B=4096, T=64, H=4, K=64, V=64)
    users, slab, reps = (16, 64, 2) if tiny else (8192, 65536, 5)
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", **versions()},
        "schedule": SCHED, "bar_rel_err": BAR, "check_sizes": check_sizes,
        "timing_sizes": {"users": users, "slab_users": slab, "H": 4, "K": 64, "V": 64, "reps": reps},
        "copy": None, "checks": {}, "timings": {},
    }  # fmt: skip

    def save() -> None:
        tmp = out_dir / "memory_gpu.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out_dir / "memory_gpu.json")

    def attempt(where: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
        if time.perf_counter() - t_start > args.budget_s:
            where[key] = {"skipped": "time budget spent"}
            return
        try:
            where[key] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others
            where[key] = {"error": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()[-1500:]}  # fmt: skip
        finally:
            if cuda:
                torch.cuda.empty_cache()
            save()
            print(f"[{time.perf_counter() - t_start:6.1f}s] {key}: {where[key]}", flush=True)

    attempt(result, "copy", lambda: copy_bandwidth(device, (1 << 20) if tiny else (2 << 30)))
    only = [n for n in args.checks_only.split(",") if n]
    for i, (name, (_, gpu_only, _)) in enumerate(PATHS.items()):
        if only and name not in only:
            continue
        if gpu_only and not cuda:
            result["checks"][name] = {"skipped": "needs CUDA"}
            continue
        attempt(result["checks"], name, lambda n=name, s=i: check_path(n, check_sizes, device, s))
    for name, (_, gpu_only, _) in PATHS.items():
        if only or (gpu_only and not cuda):
            continue
        for T in (1, 16, 64):
            attempt(result["timings"], f"{name}/T={T}",
                    lambda n=name, t=T: time_path(n, users, t, slab, device, reps))  # fmt: skip
    if (
        cuda and args.sweep and not only
    ):  # launch shapes of the Triton kernel (value columns per program, warps)
        result["triton_sweep"] = {}
        for T in (1, 64):
            for bv in (16, 32, 64):
                for nw in (1, 2, 4):
                    attempt(result["triton_sweep"], f"triton_momentum/T={T}/BV={bv}/warps={nw}",
                            lambda t=T, b=bv, w=nw: time_path("triton_momentum", users, t, slab,
                                                              device, 3, block_v=b, num_warps=w))  # fmt: skip
    if args.ieee_recheck and cuda:
        attempt(result["checks"], "fla_chunk_kda_delta_f32_ieee",
                lambda: ieee_recheck(out_dir, args.budget_s - (time.perf_counter() - t_start)))  # fmt: skip
    copy_bw = (result["copy"] or {}).get("GBps_read_plus_write")
    for r in [*result["timings"].values(), *result.get("triton_sweep", {}).values()]:
        if copy_bw and "state_GBps" in r:
            r["fraction_of_hbm_bound"] = r["state_GBps"] / copy_bw
    save()
    print(f"\ncopy bandwidth (read+write): {copy_bw} GB/s on {result['machine']['device']}")
    print(f"{'check':28s} {'y':>9s} {'S':>9s} {'M':>9s}  pass")
    for name, r in result["checks"].items():
        e = r.get("rel_err")
        if e is None:
            print(f"{name:28s} {str(r.get('skipped') or r.get('error'))[:60]}")
            continue
        fmt = [f"{v:9.2e}" if v is not None else f"{'-':>9s}" for v in (e["y"], e["S"], e["M"])]
        print(f"{name:28s} {' '.join(fmt)}  {r['pass']}")
    print(f"{'timing':34s} {'events/s':>12s} {'GB/s':>8s} {'of HBM':>7s}")
    for name, r in result["timings"].items():
        if "events_per_s" not in r:
            print(f"{name:34s} {str(r.get('skipped') or r.get('error'))[:60]}")
            continue
        frac = r.get("fraction_of_hbm_bound")
        frac_s = f"{frac:7.1%}" if frac is not None else "      -"
        print(f"{name:34s} {r['events_per_s']:12.3e} {r['state_GBps']:8.1f} {frac_s}")


if __name__ == "__main__":
    main()
