"""Parallel and combined evaluation runs for ``recmem eval``.

``run_parallel``: the requested models are split, per seed, into training groups (specs that
share one training, such as ``memory-proteus`` and ``memory-proteus-notebank`` with the same
settings, stay together); each (seed, group) runs as its own ``run_eval`` with that
``train.seed`` in a spawned worker process, at most ``jobs`` at a time, each worker pinned to
one GPU (``CUDA_VISIBLE_DEVICES``, the GPUs shared round-robin by the running workers) or,
without a GPU, to its share of the CPU threads. The workers write their parts under
``OUT/jobs/<i>/`` (summary.json, by_position.json, planted.json, ranks/, log.txt); the parent
moves the ranks files into ``OUT/ranks`` and merges the rest in the requested order. Small
models are launch-bound on a GPU, so several trainings on one GPU run nearly as fast as one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recmem.config import Config

log = logging.getLogger(__name__)

SHARED_TRAINING = ("memory-proteus", "memory-proteus-notebank")
"""Model names whose specs with equal memory/model/train settings share one training (and
whose replay variants, which differ only in REPLAY_FIELDS, share its base training)."""

REPLAY_FIELDS = {
    "model": ("replay_fusion", "replay_rank", "route_dim"),
    "train": ("replay_steps", "replay_share", "replay_freeze"),
}
"""The settings of replay-aware training (offline_eval/replay_training.py): they add
modules and a training stage after the base training, but leave the base alone."""


def base_training_key(cfg: Config) -> str:
    """What decides a memory model's base training: its memory, model and train sections
    without the replay settings."""
    sections = {s: dataclasses.asdict(getattr(cfg, s)) for s in ("memory", "model", "train")}
    for section, names in REPLAY_FIELDS.items():
        for name in names:
            sections[section].pop(name)
    return repr(sorted(sections.items()))


def replay_training_key(cfg: Config) -> str:
    """What decides the trained weights: the base and the replay settings, and with a replay
    stage the archive and query settings it routes with."""
    parts = {s: dataclasses.asdict(getattr(cfg, s)) for s in ("memory", "model", "train")}
    if cfg.train.replay_steps > 0:
        parts["archive"] = dataclasses.asdict(cfg.archive)
        parts["query_events"] = {"n": cfg.server.replay_query_events}
    return repr(sorted(parts.items()))


def training_groups(
    specs: dict[str, tuple[str, list[str]]], config_of: Callable[[list[str]], Config]
) -> list[list[str]]:
    """Specs in request order, grouped so that specs sharing a (base) training run together."""
    groups: dict[Any, list[str]] = {}
    for spec, (name, overrides) in specs.items():
        key: Any = spec
        if name in SHARED_TRAINING:
            key = ("shared", base_training_key(config_of(overrides)))
        groups.setdefault(key, []).append(spec)
    return list(groups.values())


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install means CPU workers, not a crash
        return 0


def _worker(
    cfg: Config,
    dataset: str,
    specs: list[str],
    seed: int | None,
    out: str,
    split_path: str,
    threads: int,
) -> None:
    """One group in a spawned process: plain ``run_eval`` into ``out``, logging to a file."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.FileHandler(Path(out) / "log.txt")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    import torch

    torch.set_num_threads(max(1, threads))
    from offline_eval.runner import run_eval, seeded_config

    try:
        run_eval(
            seeded_config(cfg, seed),
            dataset,
            specs,
            Path(out),
            split_path=Path(split_path),
            write_report=False,
            jobs=1,
        )
    except BaseException:
        log.exception("worker for %s failed", specs)
        raise


def run_parallel(
    cfg: Config,
    dataset: str,
    groups: list[tuple[int | None, list[str]]],
    out: Path,
    split_path: Path,
    jobs: int,
    *,
    poll_seconds: float = 0.5,
) -> dict[tuple[str, int | None], dict[str, Any]]:
    """Run each (seed, specs) group in a worker process (at most ``jobs`` at once); returns
    (spec, seed) -> unit (offline_eval.results), its ranks file moved into ``out/ranks``. A
    group whose worker fails gets units that say so (not available, the reason points at its
    log), the others stand."""
    from tqdm import tqdm

    from offline_eval.runner import _empty_entry

    ctx = mp.get_context("spawn")
    n_gpus = _gpu_count()
    threads = max(1, (os.cpu_count() or 1) // max(1, min(jobs, len(groups))))
    pending = list(enumerate(groups))
    running: dict[int, tuple[Any, int | None, float]] = {}
    per_gpu = [0] * n_gpus
    results: dict[tuple[str, int | None], dict[str, Any]] = {}
    bar = tqdm(total=len(groups), desc="eval jobs", unit="job")
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i, (seed, specs) = pending.pop(0)
                part = out / "jobs" / str(i)
                part.mkdir(parents=True, exist_ok=True)
                gpu = min(range(n_gpus), key=lambda g: per_gpu[g]) if n_gpus else None
                env = {"TQDM_DISABLE": "1"}
                if gpu is not None:
                    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
                    per_gpu[gpu] += 1
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    p = ctx.Process(
                        target=_worker,
                        args=(cfg, dataset, specs, seed, str(part), str(split_path), threads),
                        name=f"recmem-eval-{i}",
                    )
                    p.start()
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                running[i] = (p, gpu, time.perf_counter())
                log.info(
                    "job %d started (pid %d, %s): %s%s",
                    i,
                    p.pid,
                    f"GPU {gpu}" if gpu is not None else f"CPU, {threads} threads",
                    ", ".join(specs),
                    "" if seed is None else f", seed {seed}",
                )
            time.sleep(poll_seconds)
            for i in [i for i, (p, _, _) in running.items() if not p.is_alive()]:
                p, gpu, t0 = running.pop(i)
                p.join()
                if gpu is not None:
                    per_gpu[gpu] -= 1
                part = out / "jobs" / str(i)
                seed, specs = groups[i]
                for spec, unit in _collect(part, specs, p.exitcode, _empty_entry, out).items():
                    results[(spec, seed)] = {**unit, "seed": seed}
                log.info(
                    "job %d finished in %.0f s (exit %s)", i, time.perf_counter() - t0, p.exitcode
                )
                bar.update(1)
    finally:
        bar.close()
        for p, _, _ in running.values():  # interrupted: leave no orphans behind
            p.terminate()
            p.join(10)
    return results


def _collect(
    part: Path,
    specs: list[str],
    exitcode: int | None,
    empty_entry: Callable[[str], dict[str, Any]],
    out: Path,
) -> dict[str, dict[str, Any]]:
    """spec -> the unit a worker left in ``part`` (its ranks file moved to ``out``), or a
    not-available entry naming the log when the worker failed."""
    from offline_eval.results import units_of

    summary_path = part / "summary.json"
    if exitcode != 0 or not summary_path.is_file():
        reason = f"evaluation job failed (exit {exitcode}); see {part / 'log.txt'}"
        log.error("%s: %s", ", ".join(specs), reason)
        return {s: empty_entry(reason) for s in specs}
    models = json.loads(summary_path.read_text())["models"]
    by_pos = _load(part / "by_position.json")
    planted = _load(part / "planted.json")
    units = {}
    for s in specs:
        (unit,) = units_of(models[s], by_pos.get(s), planted.get(s))
        if unit["ranks"]:  # the same relative path under out as under part
            (out / unit["ranks"]).parent.mkdir(parents=True, exist_ok=True)
            os.replace(part / unit["ranks"], out / unit["ranks"])
        units[s] = unit
    return units


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
