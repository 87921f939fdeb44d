"""The hop of a rank request through the engine loop, without gRPC or a model: closed-loop
callers (threads of this process) submit to an ``EngineLoop`` whose ranker spins for a fixed
time per batch, and time submit -> answer. Arms, alternating in each round: the loop as it
is (a SimpleQueue inbox), the loop with the ``queue.Queue`` inbox it had before, and
755df0e's ``MicroBatcher`` (the rank path before the engine loop, read from git).

    .venv/bin/python bench/experiments/loop_handoff.py [--rounds 4] [--seconds 1.5]
        [--rank-ms 0.5]

Prints p50 / p99 ms and requests/s per arm at 1 and 8 callers, then the medians over rounds.
"""

from __future__ import annotations

import argparse
import queue
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from recmem.engine.loop import EngineLoop  # noqa: E402


class SpinRanker:
    """Spins ``ms * (0.5 + 0.5 * size / 8)`` per batch and answers each query with itself."""

    n_items = 1

    def __init__(self, ms: float) -> None:
        self.s = ms / 1000.0

    def rank(self, queries: Sequence[Any]) -> list[Any]:
        until = time.perf_counter() + self.s * (0.5 + 0.5 * len(queries) / 8)
        while time.perf_counter() < until:
            pass
        return list(queries)


class QueueInboxLoop(EngineLoop):
    """The loop with the inbox it had before: a ``queue.Queue`` drained until Empty."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inbox = queue.Queue()  # type: ignore[assignment]

    def _take(self, block: bool, timeout: float | None = None) -> bool:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        self._sort(item)
        while True:
            try:
                self._sort(self._inbox.get_nowait())
            except queue.Empty:
                return True


def old_batcher() -> Any:
    """755df0e's ``recmem/server/batcher.py`` as a module (None outside a git checkout)."""
    try:
        src = subprocess.run(
            ["git", "show", "755df0e:recmem/server/batcher.py"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = types.ModuleType("old_batcher")
    sys.modules[mod.__name__] = mod  # dataclass and typing look their module up
    exec(compile(src, "755df0e:recmem/server/batcher.py", "exec"), mod.__dict__)  # noqa: S102 - this repository's own history
    return mod


def closed_loop(
    submit: Callable[[int], Future[Any]], callers: int, seconds: float
) -> tuple[float, float, float]:
    lat: list[list[float]] = [[] for _ in range(callers)]
    stop = time.perf_counter() + seconds

    def caller(i: int) -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            submit(i).result()
            lat[i].append(time.perf_counter() - t)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = np.concatenate([np.array(x) for x in lat]) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(ms) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rank-ms", type=float, default=0.5)
    args = ap.parse_args()
    old = old_batcher()
    p50s: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for callers in (1, 8):
            arms: dict[str, Callable[[int], Future[Any]]] = {}
            loop = EngineLoop(SpinRanker(args.rank_ms)).start()
            qloop = QueueInboxLoop(SpinRanker(args.rank_ms)).start()
            arms["loop"] = lambda i, lp=loop: lp.submit(i)
            arms["queue inbox"] = lambda i, lp=qloop: lp.submit(i)
            batcher = None
            if old is not None:
                batcher = old.MicroBatcher(SpinRanker(args.rank_ms).rank, 4.0, 64, adaptive=True)
                arms["755df0e batcher"] = batcher.submit
            line = []
            for name, submit in arms.items():
                p50, p99, rps = closed_loop(submit, callers, args.seconds)
                p50s.setdefault((callers, name), []).append(p50)
                line.append(f"{name} p50 {p50:.3f} p99 {p99:.3f} {rps:.0f}/s")
            loop.stop()
            qloop.stop()
            if batcher is not None:
                batcher.stop()
            print(f"{callers} callers: " + " | ".join(line), flush=True)
    for (callers, name), v in sorted(p50s.items()):
        print(f"{callers} callers, {name}: median p50 {np.median(v):.3f} ms over {len(v)} rounds")


if __name__ == "__main__":
    main()
