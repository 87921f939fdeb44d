"""Training throughput of SASRec and the memory model on each memory training path, in one
run, after checking every fused path against the eager chunked form on the device.

    python3 bench/bench_train.py --split .gpu/data/ml-1m-split.npz --device cuda \\
        --json $OUT/train_h200.json
    python3 bench/bench_train.py --synthetic --tiny --device cpu --json /tmp/train_cpu.json

Data: a prepared split (``recmem eval --dataset D --prepare-split PATH.npz``; read with
numpy only: each user's TRAIN prefix is trained on, as ``recmem eval`` does) or
``--synthetic`` sequences. Models: the default configuration (``recmem config``; ``--set
section.field=value`` overrides), the batch size the recipe derives from the number of
users, TRAIN segments of ``train.segment_len`` events.

1. Checks, per fused path (``--paths``), on the device: (a) the scan alone at the training
   shapes (batch x segment, the layer's H, K, V, the Proteus schedule; users across
   unlocks, padding), outputs and every input gradient, fused path and eager chunked form
   in float32 against the chunked form in float64: max abs difference and relative
   (Frobenius) error, plus the time of one forward + backward of each; (b) one training
   step of the model (dropout off, same weights, a real batch): the loss and every
   parameter gradient, fused against eager.
2. Timings, per path: ``--warmup`` optimizer steps (compilation, autotuning), then
   ``--steps`` steps of the real training loop (``MemoryEpoch``, ``SASRecEpoch``: the same
   batches for every memory path) with the device synchronised at both ends: next-item
   targets per second, steps per second, peak device memory.
3. While the budget lasts (``--no-sweep`` skips it): the Triton kernels' forward +
   backward at the training shapes for a few launch shapes (``SWEEP``).

Writes the JSON after every step (a run cut short keeps what it measured): machine, date,
commit, command, data, configuration, checks, paths, ratios against SASRec. Needs torch,
numpy and the repository; triton and fla for the fused paths (skipped, with the reason,
where they cannot run: on the CPU the Triton path runs only under TRITON_INTERPRET=1, fla
not at all). tqdm is optional.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # before anything imports tqdm

import argparse  # noqa: E402
import copy
import dataclasses
import json
import logging
import platform
import sys
import time
import types
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchinfo import git_commit, versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import tqdm  # noqa: F401
except ImportError:  # the GPU image may lack it; the training loops only draw bars with it

    class _NoBar:
        def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
            self.iterable = iterable

        def __iter__(self) -> Iterator[Any]:
            return iter(self.iterable)

        def set_postfix(self, *args: Any, **kwargs: Any) -> None:
            pass

    sys.modules["tqdm"] = types.SimpleNamespace(tqdm=_NoBar)  # type: ignore[assignment]

from models.memory import training  # noqa: E402
from models.memory.chunk import memory_scan_chunk  # noqa: E402
from models.memory.triton_train import memory_scan_triton_train  # noqa: E402
from models.recommender import MemoryRecommender, padded_batch  # noqa: E402
from models.sasrec import SASRec, SASRecConfig, SASRecEpoch  # noqa: E402
from models.sequences import EventSeqs  # noqa: E402
from models.train import MemoryEpoch, auto_batch_size, next_item_loss  # noqa: E402
from recmem.config import Config, set_value  # noqa: E402

log = logging.getLogger("bench_train")

PATHS = (
    "sasrec",
    "momentum:chunk",
    "momentum:triton",
    "delta:chunk",
    "delta:triton",
    "delta:fla_chunk",
    "momentum:triton+graphs",
)
"""sasrec, or RULE:TRAIN_BACKEND[+graphs] with RULE momentum (the default Titans rule) or
delta (memory.momentum = false); +graphs: train.cuda_graphs on (models/train_step.py; the
fused path has no cumprod, whose backward blocked the capture; see ``graph_captured``)."""


# ---------------------------------------------------------------- data


def load_split(path: Path) -> tuple[EventSeqs, np.ndarray, int, int]:
    """(sequences, TRAIN prefix length per user, n_items, n_oov) of a saved split."""
    meta = json.loads(path.with_suffix(".json").read_text())
    with np.load(path, allow_pickle=False) as z:
        seqs = EventSeqs(
            user_ids=[str(u) for u in z["user_ids"]],
            offsets=z["offsets"],
            items=z["items"],
            actions=z["actions"].astype(np.int64),
            ts_ms=z["ts_ms"],
            part=z["part"].astype(np.int64),
            global_idx=z["global_idx"],
        )
        n_items = len(z["vocab_items"])
    train = np.bincount(seqs.user_of_event()[seqs.part == 0], minlength=seqs.n_users)
    return seqs, train, n_items, int(meta["n_oov_buckets"])


def synthetic(users: int, mean_len: int, n_items: int, seed: int = 0) -> EventSeqs:
    """Random sequences: lengths geometric around ``mean_len`` (at least 2), items drawn
    from a Zipf-like popularity, one event per minute or so."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.geometric(1.0 / mean_len, size=users), 2)
    n = int(lengths.sum())
    pop = 1.0 / np.arange(1, n_items + 1) ** 0.8
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return EventSeqs(
        user_ids=[f"u{u}" for u in range(users)],
        offsets=offsets,
        items=rng.choice(n_items, size=n, p=pop / pop.sum()).astype(np.int64),
        actions=np.zeros(n, dtype=np.int64),
        ts_ms=1_000_000_000 + np.cumsum(rng.integers(1, 120_000, size=n)),
        part=np.zeros(n, dtype=np.int64),
        global_idx=np.arange(n, dtype=np.int64),
    )


# ---------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def path_config(cfg: Config, path: str) -> Config:
    """The configuration of one memory path: RULE:BACKEND."""
    rule, backend = path.split(":")
    out = copy.deepcopy(cfg)
    out.memory.momentum = rule == "momentum"
    out.memory.train_backend, _, graphs = backend.partition("+")
    out.train.cuda_graphs = graphs == "graphs"
    return out


def backend_of(path: str) -> str:
    return path.split(":")[-1].partition("+")[0]


def unavailable(path: str, device: torch.device) -> str | None:
    """Why a path cannot run here (None: it can)."""
    backend = backend_of(path)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if path.endswith("+graphs") and device.type != "cuda":
        return "CUDA graphs need CUDA"
    if backend == "triton" and device.type != "cuda" and not interpret:
        return "needs CUDA (or TRITON_INTERPRET=1 on the CPU)"
    if backend == "fla_chunk":
        if device.type != "cuda":
            return "needs CUDA"
        try:
            import fla  # noqa: F401
        except ImportError as err:
            return f"fla not importable: {err}"
    return None


def errors(fast: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    return {
        "max_abs": max(float((a.double() - b.double()).abs().max()) for a, b in zip(fast, ref)),
        "rel": training.relative_error(fast, ref),
    }


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ---------------------------------------------------------------- checks


def check_scan(
    path: str, cfg: Config, device: torch.device, B: int, T: int, reps: int
) -> dict[str, Any]:
    """(a) the scan alone at the training shapes: fused and eager in float32 against the
    eager form in float64, and the time of one forward + backward of each."""
    m = cfg.memory
    momentum = path.startswith("momentum")
    fused = training.fused_scan(backend_of(path))
    sched = dict(n_blocks=m.n_blocks, horizon=m.horizon, qk_l2norm=m.qk_l2norm)
    inputs = training.check_inputs(
        device, momentum, m.n_heads, m.key_dim, m.value_dim,
        n_blocks=m.n_blocks, horizon=m.horizon, users=B, events=T,
    )  # fmt: skip
    exact = {k: v.double() if v is not None and v.is_floating_point() else v
             for k, v in inputs.items()}  # fmt: skip

    def eager(**kw: Any) -> Any:
        return memory_scan_chunk(**kw, chunk_size=m.chunk_size)

    truth = training.outputs_and_grads(eager, exact, **sched)
    got = training.outputs_and_grads(fused, inputs, **sched)
    base = training.outputs_and_grads(eager, inputs, **sched)
    return {
        "shape": {"B": B, "T": T, "H": m.n_heads, "K": m.key_dim, "V": m.value_dim},
        "fused_vs_eager_f32": errors(got, base),
        "fused_vs_eager_f64": errors(got, truth),
        "eager_f32_vs_eager_f64": errors(base, truth),
        "fwd_bwd_ms": {
            "fused": 1e3
            * timed(lambda: training.outputs_and_grads(fused, inputs, **sched), device, reps),
            "eager": 1e3
            * timed(lambda: training.outputs_and_grads(eager, inputs, **sched), device, reps),
        },  # fmt: skip
    }


def step_grads(
    model: MemoryRecommender, seqs: EventSeqs, users: np.ndarray, lengths: np.ndarray,
    seg: int, device: torch.device,
) -> list[torch.Tensor]:  # fmt: skip
    """Loss and every parameter gradient of the first segment of one batch (as
    ``MemoryEpoch`` trains it, without the optimizer step)."""
    items, actions, ts, lens = (x.to(device) for x in padded_batch(seqs, users, lengths, "cpu"))
    T = min(int(lens.max()) - 1, seg)
    in_len = torch.clamp(lens - 1, max=T)
    targets = items[:, 1 : T + 1]
    state = model.init_state(len(users), device)
    res = model.advance(
        items[:, :T], actions[:, :T], ts[:, :T], in_len, state, request_ts=ts[:, 1 : T + 1]
    )
    assert res.user is not None
    ok = (torch.arange(T, device=device)[None, :] < in_len[:, None]) & (targets < model.n_items)
    loss = next_item_loss(res.user[ok], targets[ok], model.item_weight())
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [loss.detach()] + [
        torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()
    ]


def check_model(
    path: str, cfg: Config, n_items: int, n_oov: int, seqs: EventSeqs, lengths: np.ndarray,
    batch: int, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """(b) one training step of the model: fused against eager, loss and gradients."""
    pcfg = path_config(cfg, path)
    pcfg.model.dropout = 0.0
    torch.manual_seed(0)
    model = MemoryRecommender(n_items, n_oov, pcfg.memory, pcfg.model).to(device).train()
    users = np.argsort(-lengths)[:batch]  # the longest users: several Proteus unlocks
    fused = step_grads(model, seqs, users, lengths[users], pcfg.train.segment_len, device)
    model.mem_cfg.train_backend = "chunk"
    eager = step_grads(model, seqs, users, lengths[users], pcfg.train.segment_len, device)
    per_param = [training.relative_error([a], [b]) for a, b in zip(fused[1:], eager[1:])]
    return {
        "loss_rel": training.relative_error(fused[:1], eager[:1]),
        "grad_rel_max": max(per_param),
        "grad_max_abs": errors(fused[1:], eager[1:])["max_abs"],
        "fell_back": training.path_disabled(backend_of(path)),
    }


SWEEP = [
    ((32, 4), (8, 2)),
    ((32, 4), (16, 4)),
    ((32, 4), (32, 8)),
    ((32, 4), (8, 1)),
    ((16, 2), (8, 2)),
    ((32, 2), (16, 2)),
]
"""((BV, warps) forward, (BV, warps) backward) of the Triton training kernels, timed at the
end when the budget allows; the first is the default (triton_train.FWD_LAUNCH, BWD_LAUNCH)."""


def sweep_point(
    cfg: Config, device: torch.device, B: int, T: int, reps: int,
    fwd: tuple[int, int], bwd: tuple[int, int],
) -> dict[str, Any]:  # fmt: skip
    """Forward + backward of the momentum scan on the Triton kernels at the training
    shapes, with this launch shape: milliseconds and the error against the eager form."""
    m = cfg.memory
    sched = dict(n_blocks=m.n_blocks, horizon=m.horizon, qk_l2norm=m.qk_l2norm)
    inputs = training.check_inputs(
        device, True, m.n_heads, m.key_dim, m.value_dim,
        n_blocks=m.n_blocks, horizon=m.horizon, users=B, events=T,
    )  # fmt: skip

    def fused(**kw: Any) -> Any:
        return memory_scan_triton_train(**kw, fwd=fwd, bwd=bwd)

    try:
        got = training.outputs_and_grads(fused, inputs, **sched)
        ref = training.outputs_and_grads(memory_scan_chunk, inputs, **sched)
        ms = 1e3 * timed(lambda: training.outputs_and_grads(fused, inputs, **sched), device, reps)
    except Exception as err:  # noqa: BLE001 - a launch shape that does not compile
        return {"error": f"{type(err).__name__}: {err}"}
    return {"fwd_bwd_ms": ms, **errors(got, ref)}


# ---------------------------------------------------------------- timings


class BenchControl:
    """The part of ``TrainControl`` the epochs use: counts steps, starts the clock after
    ``warmup`` steps (device synchronised), stops after ``warmup + steps``."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.step = 0
        self.stop = False
        self.targets = 0
        self.began = time.perf_counter()
        self.t0 = self.t1 = 0.0
        self.first_loss = self.last_loss = float("nan")

    def before_step(self) -> None:
        pass

    def after_step(self, loss: float | torch.Tensor, n: int) -> bool:
        self.step += 1
        if self.step == 1:
            self.first_loss = float(loss)
        if self.step == self.warmup:
            sync(self.device)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.t0 = time.perf_counter()
        elif self.step > self.warmup:
            self.targets += n
        if self.step >= self.warmup + self.steps:
            sync(self.device)
            self.t1 = time.perf_counter()
            self.last_loss = float(loss)
            self.stop = True
        return self.stop


def time_path(
    path: str, cfg: Config, n_items: int, n_oov: int, seqs: EventSeqs, lengths: np.ndarray,
    device: torch.device, warmup: int, steps: int,
) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(cfg.train.seed)
    if path == "sasrec":
        model: torch.nn.Module = SASRec(
            n_items, n_oov, SASRecConfig(embed_dim=cfg.model.embed_dim)
        ).to(device)
        epoch: Any = SASRecEpoch(model, seqs, lengths, cfg.train, device)  # type: ignore[arg-type]
        pcfg = cfg
    else:
        pcfg = path_config(cfg, path)
        model = MemoryRecommender(n_items, n_oov, pcfg.memory, pcfg.model).to(device)
        epoch = MemoryEpoch(model, seqs, lengths, pcfg.train, device)  # type: ignore[arg-type]
    model.train()
    control = BenchControl(warmup, steps, device)
    passes = 0
    while not control.stop:
        epoch(passes, control)
        passes += 1
    seconds = control.t1 - control.t0
    out = {
        "steps": control.steps,
        "targets": control.targets,
        "seconds": seconds,
        "targets_per_s": control.targets / seconds,
        "steps_per_s": control.steps / seconds,
        "ms_per_step": 1e3 * seconds / control.steps,
        "warmup_s": control.t0 - control.began,
        "loss_first": control.first_loss,
        "loss_last": control.last_loss,
        "peak_mem_mb": (torch.cuda.max_memory_allocated(device) / 2**20
                        if device.type == "cuda" else None),
        "batch_size": epoch.batch_size,
    }  # fmt: skip
    if path != "sasrec":
        out["fell_back"] = training.path_disabled(backend_of(path))
        static = getattr(epoch, "static", None)
        if static is not None:
            out["graph_captured"] = static.graph is not None
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--split", type=Path, help="a prepared split (.npz)")
    ap.add_argument("--synthetic", action="store_true", help="random sequences instead")
    ap.add_argument("--users", type=int, default=0, help="train on the first N users only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + str(PATHS))
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5, help="timed calls of the scan check")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip what starts after")
    ap.add_argument("--tiny", action="store_true", help="small model (a check of the script)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the Triton launch sweep")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("bench_train", "models.memory.training"):
        logging.getLogger(name).setLevel(logging.INFO)
    began = time.perf_counter()
    device = torch.device(args.device)
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}; have {PATHS}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")

    cfg = Config()
    if args.tiny:
        for dotted, value in (
            ("memory.key_dim", "8"), ("memory.value_dim", "8"), ("memory.n_blocks", "2"),
            ("memory.horizon", "16"), ("model.embed_dim", "16"), ("train.segment_len", "24"),
            ("train.batch_size", "6"),
        ):  # fmt: skip
            set_value(cfg, dotted, value, origin="--tiny")
    for item in args.set:
        dotted, value = item.split("=", 1)
        set_value(cfg, dotted.strip(), value.strip(), origin=f"--set {item}")
    if args.split is not None:
        seqs, lengths, n_items, n_oov = load_split(args.split)
        source = str(args.split)
    elif args.synthetic:
        n_items, n_oov = (200, 8) if args.tiny else (3000, 64)
        seqs = synthetic(48 if args.tiny else 6000, 30 if args.tiny else 165, n_items)
        lengths = seqs.lengths()
        source = "synthetic"
    else:
        ap.error("give --split PATH or --synthetic")
    if args.users:
        lengths = np.where(np.arange(seqs.n_users) < args.users, lengths, 0)
    batch = auto_batch_size(cfg.train, int((lengths >= 2).sum()))
    seg = cfg.train.segment_len

    result: dict[str, Any] = {
        "bench": "bench_train",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["python3", "bench/bench_train.py", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            **versions(),
        },
        "data": {
            "source": source,
            "users": int((lengths >= 2).sum()),
            "train_events": int(lengths.sum()),
            "n_items": n_items,
            "batch_size": batch,
            "segment_len": seg,
        },
        "config": {
            "memory": dataclasses.asdict(cfg.memory),
            "model": dataclasses.asdict(cfg.model),
            "train": dataclasses.asdict(cfg.train),
        },
        "settings": {"warmup": args.warmup, "steps": args.steps, "reps": args.reps},
        "checks": {},
        "paths": {},
        "skipped": {},
    }

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.json)

    def over_budget(what: str) -> bool:
        if time.perf_counter() - began > args.budget_s:
            result["skipped"][what] = f"over the {args.budget_s:.0f} s budget"
            save()
            return True
        return False

    # fla's kernels autotune and compile longest: their check and timing go last
    for path in paths:
        why = unavailable(path, device)
        if why is not None:
            result["skipped"][path] = why
    fused = [p for p in paths if backend_of(p) in training.FUSED and "+" not in p]
    order = [p for p in paths if "fla" not in p] + [p for p in paths if "fla" in p]
    for path in sorted(fused, key=order.index):
        if path in result["skipped"]:
            continue
        if "fla" in path:
            continue  # checked right before its timing
        if over_budget(f"check {path}"):
            break
        run_checks(path, cfg, device, batch, seg, args.reps, n_items, n_oov, seqs, lengths,
                   result)  # fmt: skip
        save()
    for path in order:
        if path in result["skipped"] or over_budget(path):
            continue
        if "fla" in path:
            run_checks(path, cfg, device, batch, seg, args.reps, n_items, n_oov, seqs, lengths,
                       result)  # fmt: skip
        log.info("timing %s", path)
        try:
            result["paths"][path] = time_path(
                path, cfg, n_items, n_oov, seqs, lengths, device, args.warmup, args.steps
            )
        except Exception as err:  # noqa: BLE001 - record it, time the other paths
            log.exception("timing %s failed", path)
            result["paths"][path] = {"error": f"{type(err).__name__}: {err}"}
        save()
    if not args.no_sweep and unavailable("momentum:triton", device) is None:
        result["triton_sweep"] = {}
        for fwd, bwd in SWEEP:
            name = f"fwd={fwd},bwd={bwd}"
            if over_budget(f"sweep {name}"):
                break
            result["triton_sweep"][name] = sweep_point(cfg, device, batch, seg, args.reps, fwd, bwd)
            save()
    base = result["paths"].get("sasrec", {}).get("targets_per_s")
    if base:
        result["ratios_to_sasrec"] = {
            p: r["targets_per_s"] / base for p, r in result["paths"].items() if "targets_per_s" in r
        }
    result["machine"]["triton_f32_default_at_end"] = os.environ.get("TRITON_F32_DEFAULT")
    result["wall_s"] = time.perf_counter() - began
    save()
    print(f"wrote {args.json} ({result['wall_s']:.0f} s)")
    for p, r in result["paths"].items():
        if "targets_per_s" in r:
            print(f"{p:18s} {r['targets_per_s']:10.0f} targets/s {r['ms_per_step']:8.1f} ms/step")
    for p, c in result["checks"].items():
        print(f"check {p:18s} {json.dumps(c)}")


def run_checks(
    path: str, cfg: Config, device: torch.device, batch: int, seg: int, reps: int,
    n_items: int, n_oov: int, seqs: EventSeqs, lengths: np.ndarray, result: dict[str, Any],
) -> None:  # fmt: skip
    log.info("checking %s", path)
    try:
        result["checks"][path] = {
            "scan": check_scan(path, path_config(cfg, path), device, batch, seg, reps),
            "model_step": check_model(path, cfg, n_items, n_oov, seqs, lengths, batch, device),
        }
    except Exception as err:  # noqa: BLE001 - record it, go on with the timings
        log.exception("checking %s failed", path)
        result["checks"][path] = {"error": f"{type(err).__name__}: {err}"}


if __name__ == "__main__":
    main()
