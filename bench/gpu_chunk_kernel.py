"""The chunked Triton memory kernel against the sequential one and fla, on one GPU.

    python bench/gpu_chunk_kernel.py --json $OUT/chunk_kernel_h200.json --budget-s 200
    TRITON_INTERPRET=1 python bench/gpu_chunk_kernel.py --dry-run --json /tmp/chunk.json

Issue 14, item 4: the chunked kernel (models/memory/triton_chunk.py) should reach at least
2x the sequential kernel (memory_scan_triton; 69.5 M events/s at T = 64 when the issue was
written) at T = 64 on the momentum rule, and at least fla's ``chunk_gated_delta_rule`` on
the same shapes (the gated delta rule, eta None: fla has no momentum rule), in one run.

At the default dims (H = 2, K = V = 32, the config's schedule E = 16, N = 256) and T in
{16, 64, 256} with B = EVENTS // T users (2^21 user events per call, 4.2 M head-events),
every user T events long, pos0 uniform in [0, 2N) (half the users mid-schedule, so chunks
are also cut at mask changes), float32:

1. each chunked variant (``VARIANTS``: solve, float32 dot precision, warps, value columns
   per program) is checked against the sequential kernel BEFORE it is timed (max abs and relative Frobenius error
   of y, S, M on 1024 users with lengths 0..64, bar 1e-3; the float64 recurrent oracle's
   errors of both kernels are recorded too);
2. each path is timed on the same inputs with torch.cuda.Event (warm-up calls first, so
   Triton's compile and fla's autotune are outside the timed calls but inside the budget):
   ``sequential`` (memory_scan_triton), ``chunk/<variant>`` (memory_scan_triton_chunk),
   both rules, and ``fla_chunk_gdr`` (fla's chunk_gated_delta_rule on the same q, k, v
   with g = log(1 - alpha), beta = theta, L2 norm in kernel, scale 1, initial and final
   state; timing only: it has no Proteus mask) in float32, and in bfloat16 for reference;
3. the JSON (``--json``) is rewritten after every step: machine, date, git commit
   ($GIT_COMMIT), command, sizes, checks, events/s per path, the ratios chunked /
   sequential (T = 64) and chunked / fla (each T), and pass/fail of each goal. A failing
   path is recorded and the others still run; steps that would start after ``--budget-s``
   are skipped, and an alarm stops a step that runs past it. Order, most important first:
   T = 64 with the sequential kernel, three variants and fla float32; T = 16 and 256 with
   the two fastest variants; the issue's dims; the other variants; fla bfloat16.

``--dry-run`` runs the whole flow on CPU under TRITON_INTERPRET=1 at tiny sizes (fla is
tried, and recorded as skipped where it cannot run): a check of the script's logic, its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchinfo import git_commit, versions  # noqa: E402

SCHED = dict(n_blocks=16, horizon=256)  # the config defaults: Delta = 16
H, K, V = 2, 32, 32
DIMS = (H, K, V)
ISSUE_DIMS, ISSUE_USERS, ISSUE_T = (4, 64, 64), 8192, 64
"""Where the issue's 69.5 M events/s was measured (bench/results/memory_gpu_h200.json:
H = 4, K = V = 64, 8192 users x 64 events, through the slab ingest entry point)."""
ISSUE_TOP = 2
"""Chunked variants (the fastest passing ones at T = 64) also timed at the issue's dims."""
EVENTS = 1 << 21
"""User events per timed call (B = EVENTS // T users); times H head-events: 4.2 M."""
TS = (64, 16, 256)  # T = 64 first: the goal's shape
BAR = 1e-3
ISSUE_SEQUENTIAL_T64 = 69.5e6
"""The sequential kernel's events/s at T = 64 when the issue was written (H200)."""
VARIANTS = (
    "subst/tf32x3/1/32",
    "subst/tf32x3m/1/32",
    "doubling/tf32/1/32",
    "subst/tf32/1/32",
    "doubling/tf32x3m/1/32",
    "subst/tf32x3/2/32",
    "subst/tf32x3/1/16",
    "subst/tf32x3/4/32",
    "subst/tf32x3/4/16",
)
"""Chunked kernel launches: solve / float32 dot precision / num_warps / block_v. The first
is the entry point's default; the rest run while the budget lasts (each is one more
compile), roughly from the fewest SASS instructions per event (sm_90a, Triton 3.7, static
counts of the chunk loop, momentum, per head-event at V = 32: 437, 372, 250, 271, 376, 667,
663, 1146, 1693; the sequential kernel's event loop: 456). tf32x3m: three TF32 passes with
the operands split in the kernel (``triton_chunk.dot``), shared splits computed once. With M = 16 rows per dot, warps
beyond one mostly repeat the same [16, .] work; ptxas gives every variant 255 registers."""


class StepTimeout(Exception):
    pass


def variant_kwargs(name: str) -> dict[str, Any]:
    solve, prec, warps, block_v = name.split("/")
    return dict(solve=solve, input_precision=prec, num_warps=int(warps), block_v=int(block_v))


def make_inputs(
    B: int, T: int, momentum: bool, device: str, seed: int, ragged: bool = False,
    dims: tuple[int, int, int] = DIMS,
) -> dict[str, Any]:  # fmt: skip
    H, K, V = dims
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: fast at 2M events
    pos0 = torch.randint(0, 2 * SCHED["horizon"], (B,), generator=g, device=device)
    if ragged:  # lengths 0..T, with 0, 1 and T present
        lengths = torch.randint(0, T + 1, (B,), generator=g, device=device)
        lengths[: min(B, 3)] = torch.tensor([0, 1, T], device=device)[: min(B, 3)]
    else:
        lengths = torch.full((B,), T, dtype=torch.int64, device=device)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    def uni(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=device)

    return dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, H, V),
        theta=uni(B, T, H),
        eta=uni(B, T, H) * 0.9 if momentum else None,
        alpha=uni(B, T, H) * 0.1,
        S0=rnd(B, H, K, V) * 0.3,
        M0=rnd(B, H, K, V) * 0.1 if momentum else None,
        pos0=pos0,
        lengths=lengths,
    )


def sequential(**inp: Any) -> Any:
    from models.memory.triton_momentum import memory_scan_triton

    return memory_scan_triton(**inp, **SCHED)


def chunked(variant: str) -> Callable[..., Any]:
    from models.memory.triton_chunk import memory_scan_triton_chunk

    kw = variant_kwargs(variant)
    return lambda **inp: memory_scan_triton_chunk(**inp, **SCHED, **kw)


def errors(out: Any, ref: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, a, b in zip(("y", "S", "M"), out, ref, strict=True):
        if a is None or b is None:
            continue
        d = (a.double() - b.double()).flatten()
        res[name] = {
            "max_abs": float(d.abs().max()) if d.numel() else 0.0,
            "rel": float(d.norm() / b.double().norm().clamp_min(1e-30)),
        }
    return res


_REFERENCES: dict[tuple[Any, ...], Any] = {}


def check_variant(
    variant: str, momentum: bool, B: int, T: int, device: str,
    dims: tuple[int, int, int] = DIMS,
) -> dict[str, Any]:  # fmt: skip
    """The chunked variant against the sequential kernel (fp32) and both against the
    float64 recurrent oracle, on ragged users."""
    from models.memory.recurrent import memory_scan_recurrent

    key = (B, T, momentum, device, dims)
    if key not in _REFERENCES:  # the same inputs and references for every variant
        inp = make_inputs(B, T, momentum, device, seed=11, ragged=True, dims=dims)
        with torch.no_grad():
            exact = {
                n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for n, x in inp.items()
            }
            _REFERENCES[key] = (inp, sequential(**inp), memory_scan_recurrent(**exact, **SCHED))
    inp, seq, oracle = _REFERENCES[key]
    with torch.no_grad():
        out = chunked(variant)(**inp)
    from models.memory import triton_chunk

    launch = dict(triton_chunk.LAST_LAUNCH)
    vs_seq = errors(out, seq)
    worst = max(e["rel"] for e in vs_seq.values())
    pad = torch.arange(T, device=device)[None, :] >= inp["lengths"][:, None]
    return {
        "users": B,
        "T": T,
        "dims_HKV": list(dims),
        "vs_sequential": vs_seq,
        "worst_rel_vs_sequential": worst,
        "chunk_vs_float64_oracle": errors(out, oracle),
        "sequential_vs_float64_oracle": errors(seq, oracle),
        "padding_outputs_zero": bool(not out[0][pad].any()),
        "pass": bool(worst <= BAR and not out[0][pad].any()),
        "kernel": launch,
    }


def time_call(fn: Callable[[], Any], cuda: bool, warmup: int, reps: int) -> dict[str, Any]:
    with torch.no_grad():
        t0 = time.perf_counter()
        fn()  # compile / autotune
        if cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
    times.sort()
    return {"first_call_s": first, "seconds": times[len(times) // 2], "all_s": times}


def fla_fn(inp: dict[str, Any], dtype: torch.dtype) -> Callable[[], Any]:
    """fla's chunk_gated_delta_rule on the same shapes (timing only: no Proteus mask)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v = (inp[n].to(dtype) for n in ("q", "k", "v"))
    g = torch.log1p(-inp["alpha"]).float()
    beta = inp["theta"].to(dtype)
    S0 = inp["S0"].float()

    def run() -> Any:
        return chunk_gated_delta_rule(
            q, k, v, g, beta, scale=1.0, initial_state=S0, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    return run


def rate(result: dict[str, Any], T: int, name: str) -> float | None:
    r = result["timings"].get(f"T={T}", {}).get(name, {})
    return r.get("events_per_s") if isinstance(r, dict) else None


def best_chunk(result: dict[str, Any], T: int, rule: str) -> tuple[str | None, float | None]:
    """The fastest chunked variant of ``rule`` at T among those that passed their check."""
    best: tuple[str | None, float | None] = (None, None)
    for variant in result["variants"]:
        if not result["checks"].get(f"{variant}/{rule}", {}).get("pass"):
            continue
        r = rate(result, T, f"chunk/{variant}/{rule}")
        if r is not None and (best[1] is None or r > best[1]):
            best = (variant, r)
    return best


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Events/s per path and T, the goal ratios, and pass/fail (None: not measured)."""
    table = {
        key: {n: r.get("events_per_s") for n, r in paths.items() if isinstance(r, dict)}
        for key, paths in result["timings"].items()
    }
    s: dict[str, Any] = {"events_per_s": table, "best_chunk": {}, "ratios": {}, "goals": {}}
    default = result["variants"][0]
    for T in result["config"]["Ts"]:
        for rule in ("momentum", "delta"):
            variant, r = best_chunk(result, T, rule)
            seq = rate(result, T, f"sequential/{rule}")
            s["best_chunk"][f"T={T}/{rule}"] = {"variant": variant, "events_per_s": r}
            s["ratios"][f"T={T}/{rule}/chunk_best_over_sequential"] = r / seq if r and seq else None
            d = rate(result, T, f"chunk/{default}/{rule}")
            s["ratios"][f"T={T}/{rule}/chunk_default_over_sequential"] = (
                d / seq if d and seq else None
            )
        fla = rate(result, T, "fla_chunk_gdr/float32")
        fla_dtype = "float32"
        if fla is None:
            fla, fla_dtype = rate(result, T, "fla_chunk_gdr/bfloat16"), "bfloat16"
        _, r = best_chunk(result, T, "delta")
        s["ratios"][f"T={T}/delta/chunk_best_over_fla"] = r / fla if r and fla else None
        s["ratios"][f"T={T}/fla_dtype_compared"] = fla_dtype if fla else None
        s["goals"][f"T={T}: chunk (delta) >= fla chunk_gated_delta_rule"] = (
            r >= fla if r and fla else None
        )
    ratio = s["ratios"].get("T=64/momentum/chunk_best_over_sequential")
    s["goals"]["T=64: chunk (momentum) >= 2x sequential, same run"] = (
        ratio >= 2 if ratio is not None else None
    )
    issue = result["timings"].get("issue_dims", {})
    rates = {n: r.get("events_per_s") for n, r in issue.items() if isinstance(r, dict)}
    chunk_rates = [r for n, r in rates.items() if n.startswith("chunk/") and r]
    best_issue = max(chunk_rates, default=None)
    seq_issue = rates.get("sequential/momentum")
    s["issue_dims"] = {
        "dims_HKV": list(ISSUE_DIMS), "users": ISSUE_USERS, "T": ISSUE_T, "events_per_s": rates,
        "chunk_best_over_sequential": best_issue / seq_issue if best_issue and seq_issue else None,
        "chunk_best_over_issue_figure": best_issue / ISSUE_SEQUENTIAL_T64 if best_issue else None,
    }  # fmt: skip
    s["goals"]["issue dims (H=4, K=V=64), T=64: chunk (momentum) >= 2x 69.5 M events/s"] = (
        best_issue >= 2 * ISSUE_SEQUENTIAL_T64 if best_issue is not None else None
    )
    return s


RULES = (("momentum", True), ("delta", False))
Make = Callable[[], Callable[[], Any]]
"""Builds one timed call (inputs prepared outside the timing)."""


def plan(
    data: dict[str, Any], variants: list[str], *, seq: bool, fla: tuple[torch.dtype, ...]
) -> list[tuple[str, Make]]:
    """What to time at one T, in order: the sequential kernel (``seq``), the first chunked
    variant, fla at the ``fla`` dtypes, the other variants; both rules each."""

    def chunk_entry(variant: str, rule: str) -> tuple[str, Make]:
        def make() -> Callable[[], Any]:
            fn, inp = chunked(variant), data[rule]
            return lambda: fn(**inp)

        return f"chunk/{variant}/{rule}", make

    def seq_entry(rule: str) -> tuple[str, Make]:
        return f"sequential/{rule}", lambda: lambda: sequential(**data[rule])

    def fla_entry(dtype: torch.dtype) -> tuple[str, Make]:
        return f"fla_chunk_gdr/{str(dtype).split('.')[-1]}", lambda: fla_fn(data["delta"], dtype)

    chunks = [[chunk_entry(v, rule) for rule, _ in RULES] for v in variants]
    order = [seq_entry(rule) for rule, _ in RULES] if seq else []
    order += chunks[0] if chunks else []
    order += [fla_entry(d) for d in fla]
    return order + [e for c in chunks[1:] for e in c]


def both_rules(B: int, T: int, device: str) -> dict[str, Any]:
    return {rule: make_inputs(B, T, m, device, seed=T) for rule, m in RULES}


def fastest(timings: dict[str, Any], variant: str) -> float:
    """The variant's best events/s over both rules in ``timings`` (0 if none)."""
    rates = [timings.get(f"chunk/{variant}/{rule}", {}).get("events_per_s") for rule, _ in RULES]
    return max((r for r in rates if r), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the result")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip what starts after this")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="events per user, comma-separated")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        if not args.dry_run:
            sys.exit("no CUDA device: run with --dry-run (CPU, TRITON_INTERPRET=1, tiny sizes)")
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel is built
    device = "cuda" if cuda else "cpu"
    events = EVENTS if cuda else 64
    check_users, check_T = (1024, 64) if cuda else (4, 20)
    warmup, reps = (args.warmup, args.reps) if cuda else (0, 1)
    Ts = [int(t) for t in args.ts.split(",") if t]
    variants = [v for v in args.variants.split(",") if v]
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name() if cuda else "cpu (dry run, interpreter)",
            "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"), **versions(),
        },
        "dry_run": not cuda,
        "config": {
            "H": H, "K": K, "V": V, "schedule": SCHED, "Ts": Ts, "events_per_call": events,
            "users_per_T": {str(T): max(1, events // T) for T in Ts},
            "pos0": "uniform in [0, 2N)", "lengths": "all T (timing); 0..T (checks)",
            "dtype": "float32", "check_users": check_users, "check_T": check_T,
            "bar_rel_err": BAR, "warmup": warmup, "reps": reps, "budget_s": args.budget_s,
            "issue_sequential_T64_events_per_s": ISSUE_SEQUENTIAL_T64,
        },
        "variants": variants, "checks": {}, "timings": {}, "skipped": [], "summary": {},
    }  # fmt: skip

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        result["summary"] = summarise(result)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out_path)

    # The alarm stops a step that runs past the budget (between steps it only marks the
    # budget spent, so it never interrupts a write of the JSON).
    state = {"in_step": False, "stopped": False}

    def on_alarm(signum: int, frame: Any) -> None:
        state["stopped"] = True
        if state["in_step"]:
            raise StepTimeout(f"budget of {args.budget_s} s spent during this step")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, args.budget_s - 3.0))

    def attempt(where: dict[str, Any], key: str, fn: Callable[[], Any], label: str = "") -> Any:
        label = label or key
        if state["stopped"] or time.perf_counter() - t_start > args.budget_s - 5:
            where[key] = {"skipped": "time budget spent"}
            result["skipped"].append(label)
            save()
            return None
        try:
            state["in_step"] = True
            where[key] = fn()
        except StepTimeout as exc:
            where[key] = {"error": f"StepTimeout: {exc}"}
        except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others
            where[key] = {"error": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()[-1500:]}  # fmt: skip
        finally:
            state["in_step"] = False
        if cuda:
            torch.cuda.empty_cache()
        save()
        print(f"[{time.perf_counter() - t_start:6.1f}s] {label}: {brief(where[key])}", flush=True)
        return where[key]

    def timed(make: Make, B: int, T: int, heads: int = H) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            r = time_call(make(), cuda, warmup, reps)  # inputs prepared outside the timing
            r.update(users=B, T=T, events_per_s=B * T / r["seconds"],
                     head_events_per_s=B * T * heads / r["seconds"])  # fmt: skip
            return r

        return run

    def issue_phase() -> None:
        """The momentum rule at the dims of the issue's 69.5 M events/s: the sequential
        kernel and the fastest passing chunked variants at T = 64 (each checked first)."""
        heads = ISSUE_DIMS[0]
        B, T = (ISSUE_USERS, ISSUE_T) if cuda else (2, 20)
        label = "issue_dims"
        timings: dict[str, Any] = result["timings"].setdefault(label, {})
        inputs: dict[str, Any] = {}
        inp = attempt(inputs, "data", functools.partial(
            make_inputs, B, T, True, device, T, dims=ISSUE_DIMS), f"{label}/inputs")  # fmt: skip
        if inp is None or "error" in inp or "skipped" in inp:
            timings["inputs"] = inputs.get("data")
            return
        attempt(timings, "sequential/momentum",
                timed(lambda: lambda: sequential(**inp), B, T, heads), f"{label}/sequential")  # fmt: skip
        first = result["timings"].get(f"T={Ts[0]}", {})
        passing = [v for v in variants if result["checks"].get(f"{v}/momentum", {}).get("pass")]
        for variant in sorted(passing, key=lambda v: -fastest(first, v))[:ISSUE_TOP]:
            key = f"{variant}/momentum/issue_dims"
            check = attempt(result["checks"], key, functools.partial(
                check_variant, variant, True, max(4, check_users // 4), check_T, device, ISSUE_DIMS))  # fmt: skip
            if not (isinstance(check, dict) and check.get("pass")):
                continue
            fn = chunked(variant)
            attempt(timings, f"chunk/{variant}/momentum",
                    timed(lambda f=fn: lambda: f(**inp), B, T, heads), f"{label}/{variant}")  # fmt: skip

    checked: set[str] = set()
    datas: dict[int, Any] = {}

    def run_T(T: int, chosen: list[str], *, seq: bool, fla: tuple[torch.dtype, ...]) -> None:
        """Time ``chosen`` variants (each checked before its first timing) at T, with the
        sequential kernel and fla if asked; the inputs are made once per T."""
        B = max(1, events // T)
        timings: dict[str, Any] = result["timings"].setdefault(f"T={T}", {})
        if T not in datas:
            inputs: dict[str, Any] = {}
            datas[T] = attempt(inputs, "data", functools.partial(both_rules, B, T, device),
                               f"T={T}/inputs")  # fmt: skip
            if datas[T] is None or "error" in datas[T] or "skipped" in datas[T]:
                timings["inputs"] = inputs.get("data")
        data = datas[T]
        if data is None or "error" in data or "skipped" in data:
            return
        for name, make in plan(data, chosen, seq=seq, fla=fla):
            if name in timings:
                continue
            if name.startswith("chunk/"):
                key = name.removeprefix("chunk/")
                if key not in checked:  # the check comes before the variant's first timing
                    checked.add(key)
                    variant, rule = key.rsplit("/", 1)
                    attempt(result["checks"], key,
                            lambda v=variant, m=rule == "momentum": check_variant(
                                v, m, check_users, check_T, device))  # fmt: skip
            if name.startswith("fla") and not cuda:
                timings[name] = {"skipped": "fla's kernels need CUDA (dry run)"}
                try:
                    __import__("fla.ops.gated_delta_rule")
                except Exception as exc:  # noqa: BLE001
                    timings[name] = {"skipped": f"fla not importable: {type(exc).__name__}"}
                save()
                print(
                    f"[{time.perf_counter() - t_start:6.1f}s] T={T}/{name}: {brief(timings[name])}"
                )
                continue
            attempt(timings, name, timed(make, B, T), f"T={T}/{name}")

    def ranked() -> list[str]:
        """Variants by their events/s at the first T (passing ones first, then in order)."""
        first = result["timings"].get(f"T={Ts[0]}", {})
        ok = [v for v in variants if all(result["checks"].get(f"{v}/{r}", {}).get("pass")
                                         for r, _ in RULES)]  # fmt: skip
        return sorted(ok, key=lambda v: -fastest(first, v)) + [v for v in variants if v not in ok]

    # Most important first, the budget may run out: (1) T0 with the sequential kernel, the
    # first three variants and fla float32; (2) every other T with the two fastest; (3) the
    # issue's dims; (4) the other variants everywhere; (5) fla bfloat16.
    fp32, bf16 = (torch.float32,), (torch.bfloat16,)
    run_T(Ts[0], variants[:3], seq=True, fla=fp32)
    for T in Ts[1:]:
        run_T(T, ranked()[:2], seq=True, fla=fp32)
    issue_phase()
    for T in Ts:
        run_T(T, ranked(), seq=False, fla=())
    for T in Ts:
        run_T(T, [], seq=False, fla=bf16)
    datas.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)
    save()
    print(json.dumps(result["summary"], indent=1))


def brief(r: Any) -> str:
    if not isinstance(r, dict):
        return str(r)
    if all(x is None or isinstance(x, torch.Tensor | dict) for x in r.values()):
        return "inputs made"
    if "events_per_s" in r:
        return f"{r['events_per_s']:.3e} events/s ({r['seconds'] * 1e3:.2f} ms, first call {r['first_call_s']:.1f} s)"
    if "pass" in r:
        return f"pass={r['pass']} worst rel vs sequential {r['worst_rel_vs_sequential']:.2e}"
    return str(r.get("skipped") or r.get("error"))[:200]


if __name__ == "__main__":
    main()
