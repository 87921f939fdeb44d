"""What a training step costs under each unlock schedule, measured on the CPU as a proxy for
the GPU, where small memory models are bound by kernel launches and host synchronisations
(docs/memory.md, "The fast path"): per optimizer step of the real training loop
(``MemoryEpoch``, default model, TRAIN segments of 200 events),

- ``ops``: ATen operations dispatched (forward, backward, optimizer), and ``kernels``:
  those that are not views or metadata (on a GPU, each a kernel launch);
- ``host_reads``: reads of tensor values on the host inside ``advance`` (``.cpu()``,
  ``.tolist()``, ``.numpy()`` of a tensor not already copied, ``.item()`` and Python
  conversions, ``nonzero``, boolean indexing; on a GPU, each a synchronisation);
- ``cumprods``: ``cumprod`` calls inside ``advance``: with torch 2.11 (the H200 image) the
  backward of each checks its input for zeros on the host (models/train_step.py), one more
  synchronisation per call that the CPU's torch does not show;
- ``s_per_step``: CPU seconds per step (median and min over the timed steps; one thread).

for ``memory.unlock`` = uniform, surprise and drift, at the batch sizes of ML-100K (19
users) and ML-1M (125). ``--before REV`` measures the tree of commit REV too (``git
archive`` into a temporary folder; the same measurement in a subprocess with that tree
first on the path; old and new alternate), so before and after stand side by side:

    .venv/bin/python bench/unlock_cost.py --before 928777d \\
        --json bench/results/unlock_cost_cpu.json

Synthetic users of 401 events (two full segments each, the second starting mid-interval
at position 200), items uniform over 3,000.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # before anything imports tqdm

import argparse  # noqa: E402
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchinfo import git_commit
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("uniform", "surprise", "drift")
N_ITEMS = 3000
SEGMENTS = 2
"""Each user has SEGMENTS * train.segment_len + 1 events: SEGMENTS optimizer steps per batch."""

VIEWS = {
    "alias", "as_strided", "detach", "diagonal", "expand", "expand_as", "lift_fresh",
    "narrow", "permute", "reshape", "_reshape_alias", "select", "slice", "split",
    "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unflatten", "unfold",
    "unsqueeze", "_unsafe_view", "view", "view_as",
}  # fmt: skip
"""ATen operations that only make a new view of a tensor (no kernel on a GPU)."""
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"}


class OpCount(TorchDispatchMode):
    """Counts dispatched ATen operations, and those that read device values on the host
    while ``reading`` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.reading = False
        self.reads = 0
        self.cumprods = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if self.reading and (name in SYNC_OPS or _bool_index(name, args)):
            self.reads += 1
        if self.reading and name == "cumprod":
            self.cumprods += 1
        return func(*args, **(kwargs or {}))


def _bool_index(name: str, args: Any) -> bool:
    """Indexing with a boolean mask (a nonzero inside: a synchronisation on a GPU)."""
    if name != "index" or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


class HostReads(TorchFunctionMode):
    """Counts the host reads that dispatch no operation on the CPU: ``.cpu()``,
    ``.tolist()`` and ``.numpy()`` (not of a tensor ``.cpu()`` just made)."""

    def __init__(self, counter: OpCount) -> None:
        super().__init__()
        self.counter = counter
        self.copies: dict[int, torch.Tensor] = {}  # kept alive: ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if self.counter.reading and name in ("cpu", "tolist", "numpy"):
            if not (name == "numpy" and args and id(args[0]) in self.copies):
                self.counter.reads += 1
            if name == "cpu" and isinstance(out, torch.Tensor):
                self.copies[id(out)] = out
        return out


class StepControl:
    """The part of ``TrainControl`` the epoch uses: times every step, stops after ``steps``."""

    def __init__(self, steps: int) -> None:
        self.steps, self.step, self.stop = steps, 0, False
        self.times: list[float] = []
        self.t = time.perf_counter()

    def before_step(self) -> None:
        pass

    def after_step(self, loss: Any, n: int) -> bool:
        now = time.perf_counter()
        self.times.append(now - self.t)
        self.t, self.step = now, self.step + 1
        self.stop = self.step >= self.steps
        return self.stop


def worker(unlock: str, batch: int, count_steps: int, time_steps: int) -> dict[str, Any]:
    """One schedule at one batch size, on the models package first on sys.path."""
    from models.config import MemoryConfig, ModelConfig, TrainConfig
    from models.recommender import MemoryRecommender
    from models.sequences import EventSeqs
    from models.train import MemoryEpoch

    tcfg = TrainConfig(batch_size=batch)
    length = SEGMENTS * tcfg.segment_len + 1
    users = batch * -(-(2 + count_steps + time_steps) // SEGMENTS)
    rng = np.random.default_rng(0)
    n = users * length
    seqs = EventSeqs(
        user_ids=[f"u{u}" for u in range(users)],
        offsets=np.arange(users + 1, dtype=np.int64) * length,
        items=rng.integers(0, N_ITEMS, n).astype(np.int64),
        actions=np.zeros(n, dtype=np.int64),
        ts_ms=1_000_000_000 + np.cumsum(rng.integers(1, 120_000, n)),
        part=np.zeros(n, dtype=np.int64),
        global_idx=np.arange(n, dtype=np.int64),
    )
    torch.manual_seed(0)
    model = MemoryRecommender(N_ITEMS, 64, MemoryConfig(unlock=unlock), ModelConfig())
    epoch = MemoryEpoch(model, seqs, seqs.lengths(), tcfg, torch.device("cpu"))
    model.train()
    epoch(0, StepControl(2))  # warm-up

    counter = OpCount()
    advance = MemoryRecommender.advance

    def counted_advance(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.reading = True
        try:
            return advance(self, *args, **kwargs)
        finally:
            counter.reading = False

    MemoryRecommender.advance = counted_advance  # type: ignore[method-assign]
    try:
        with counter, HostReads(counter):
            epoch(1, StepControl(count_steps))
    finally:
        MemoryRecommender.advance = advance  # type: ignore[method-assign]
    timed = StepControl(time_steps)
    epoch(2, timed)
    total = sum(counter.ops.values())
    kernels = sum(v for k, v in counter.ops.items() if k not in VIEWS)
    return {
        "ops_per_step": total / count_steps,
        "kernels_per_step": kernels / count_steps,
        "host_reads_per_step": counter.reads / count_steps,
        "cumprods_per_step": counter.cumprods / count_steps,
        "s_per_step_median": statistics.median(timed.times),
        "s_per_step_min": min(timed.times),
        "steps_timed": len(timed.times),
        "top_ops": dict(
            Counter({k: v / count_steps for k, v in counter.ops.items()}).most_common(8)
        ),
    }


def run_worker(tree: Path, unlock: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """``worker`` in a subprocess with ``tree`` first on the path."""
    cmd = [
        sys.executable, __file__, "--worker", "--tree", str(tree), "--unlock", unlock,
        "--batch", str(batch), "--count-steps", str(args.count_steps),
        "--time-steps", str(args.time_steps), "--threads", str(args.threads),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"worker failed ({tree}, {unlock}, {batch}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--before", help="also measure the tree of this commit")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/unlock_cost_cpu.json")
    ap.add_argument("--batches", default="19,125", help="users per step, comma-separated")
    ap.add_argument("--count-steps", type=int, default=2)
    ap.add_argument("--time-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--unlock", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        sys.path.insert(0, str(args.tree))
        print(json.dumps(worker(args.unlock, args.batch, args.count_steps, args.time_steps)))
        return

    began = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {
        "bench": "unlock_cost",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join([".venv/bin/python", "bench/unlock_cost.py", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "note": "CPU shared with other jobs: seconds are rough; op counts are exact",
        },
        "setup": {
            "model": "default configuration (L=2, H=2, K=V=32, E=16, N=256: Delta=16)",
            "segment_len": 200,
            "user_events": SEGMENTS * 200 + 1,
            "n_items": N_ITEMS,
            "count_steps": args.count_steps,
            "time_steps": args.time_steps,
        },
        "trees": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": ROOT}
        if args.before:
            old = Path(tmp) / "before"
            old.mkdir()
            archive = subprocess.run(
                ["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            sha = subprocess.run(
                ["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True
            )
            result["before_commit"] = sha.stdout.strip()
            trees = {"before": old, "after": ROOT}
        for batch in batches:
            for unlock in SCHEDULES:
                for name, tree in trees.items():
                    got = run_worker(tree, unlock, batch, args)
                    result["trees"].setdefault(name, {}).setdefault(str(batch), {})[unlock] = got
                    print(
                        f"{name:6s} B={batch:3d} {unlock:8s} ops {got['ops_per_step']:8.0f} "
                        f"kernels {got['kernels_per_step']:7.0f} "
                        f"host reads {got['host_reads_per_step']:4.1f} "
                        f"cumprods {got['cumprods_per_step']:5.1f} "
                        f"s/step {got['s_per_step_median']:.2f} (min {got['s_per_step_min']:.2f})",
                        flush=True,
                    )
    result["ratios"] = ratios(result["trees"])
    result["wall_s"] = round(time.perf_counter() - began, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios"], indent=1))


def ratios(trees: dict[str, Any]) -> dict[str, Any]:
    """Kernels and median seconds per step: each schedule over uniform (same tree), and
    after over before (same schedule)."""
    out: dict[str, Any] = {}
    for name, per_batch in trees.items():
        for batch, per in per_batch.items():
            for unlock, got in per.items():
                key = f"{name} B={batch} {unlock}"
                uni = per["uniform"]
                out[key + " / uniform"] = {
                    "kernels": round(got["kernels_per_step"] / uni["kernels_per_step"], 2),
                    "s": round(got["s_per_step_median"] / uni["s_per_step_median"], 2),
                }
    if "before" in trees:
        for batch, per in trees["after"].items():
            for unlock, got in per.items():
                old = trees["before"][batch][unlock]
                out[f"B={batch} {unlock} after / before"] = {
                    "kernels": round(got["kernels_per_step"] / old["kernels_per_step"], 2),
                    "s": round(got["s_per_step_median"] / old["s_per_step_median"], 2),
                }
    return out


if __name__ == "__main__":
    main()
