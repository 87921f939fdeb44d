"""The engine's two per-user structures alone, plain reference against the vectorised form:
``SeenEvents.keep`` (the duplicate policy) and ``RecentEvents.observe`` (the latest events
and their q~) on the benchmark workload's first events in batches of 4096 (Zipf users).

    .venv/bin/python bench/experiments/seen_tails_micro.py [--events 100000]
        [--batch 4096] [--rounds 5] [--json PATH]

Each round runs every batch through a fresh reference and a fresh fast instance of each
(the order of the two alternating between rounds), with the engine's defaults
(``state.dedupe_window`` 64, ``server.replay_query_events`` 8) and random q~ of the
default model's shape [L, H, K] = [2, 2, 32] in the packed form the CPU path uses.
Figures: microseconds per event of the whole sequence, per round, and their median, for a
fresh instance (``cold``: the first 100,000 events bring 44,196 new users, so the row
tables grow) and for a second pass of the same batches over it (``warm``: every user known;
``keep`` gets other keys, so that nothing is a duplicate); and the bytes per user each
form holds after one pass (tracemalloc, which counts numpy's buffers).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402
from engine_apply import events_of  # noqa: E402

from recmem.config import load_config  # noqa: E402
from recmem.engine.dedupe import SeenEvents, SeenEventsReference  # noqa: E402
from recmem.engine.engine import group_events  # noqa: E402
from recmem.engine.tails import RecentEvents, RecentEventsReference  # noqa: E402
from recmem.producing import open_stream  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402
from streams.batch import EventBatch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, [], environ={})
    stream = open_stream("workload", cfg)
    events = events_of(stream, args.events)
    vocab = ItemVocab(stream.item_ids.tolist(), cfg.model.n_oov_buckets)
    batches = [EventBatch.of(events[s : s + args.batch]) for s in range(0, len(events), args.batch)]
    grouped = [group_events(b, vocab) for b in batches]
    rng = torch.Generator().manual_seed(0)
    queries = [torch.randn(int(g.lengths.sum()), 2, 2, 32, generator=rng) for g in grouped]
    window, keep = cfg.state.dedupe_window, cfg.server.replay_query_events

    def feed_keep(seen: SeenEvents | SeenEventsReference, shift: int = 0) -> None:
        for b in batches:
            seen.keep(b.user_id, b.key + shift)

    def feed_observe(tails: RecentEvents | RecentEventsReference) -> None:
        for g, q in zip(grouped, queries):
            tails.observe(g.user_ids, g.items, g.actions, g.ts_ms, g.lengths, q, packed=True)

    def run(case: str, fast: bool) -> tuple[float, float]:
        """Seconds of a pass on a fresh instance and of a second pass over it."""
        if case == "keep":
            seen = (SeenEvents if fast else SeenEventsReference)(window)
            t0 = time.perf_counter()
            feed_keep(seen)
            t1 = time.perf_counter()
            feed_keep(seen, shift=1)  # every user known, other keys: no duplicates
        else:
            tails = (RecentEvents if fast else RecentEventsReference)(keep)
            t0 = time.perf_counter()
            feed_observe(tails)
            t1 = time.perf_counter()
            feed_observe(tails)
        return t1 - t0, time.perf_counter() - t1

    us: dict[str, dict[str, list[float]]] = {
        f"{c}_{p}": {"reference": [], "fast": []}
        for c in ("keep", "observe")
        for p in ("cold", "warm")
    }
    for r in range(args.rounds):
        for case in ("keep", "observe"):
            for fast in (False, True) if r % 2 == 0 else (True, False):
                name = "fast" if fast else "reference"
                cold, warm = run(case, fast)
                us[f"{case}_cold"][name].append(round(cold / len(events) * 1e6, 3))
                us[f"{case}_warm"][name].append(round(warm / len(events) * 1e6, 3))
    figures = {
        case: {
            name: {"us_per_event": v, "median_us_per_event": statistics.median(v)}
            for name, v in per.items()
        }
        for case, per in us.items()
    }
    for case, per in us.items():
        ref, new = statistics.median(per["reference"]), statistics.median(per["fast"])
        print(
            f"{case:13s} reference {ref:7.3f} us/event  fast {new:7.3f} us/event  x{ref / new:.1f}"
        )
    # memory: what each form holds after one pass (tracemalloc, numpy's buffers included)
    n_users = len({e.user_id for e in events})
    held: dict[str, dict[str, int]] = {"keep": {}, "observe": {}}
    for case in held:
        for fast in (False, True):
            gc.collect()
            tracemalloc.start()
            filled: object
            if case == "keep":
                filled = (SeenEvents if fast else SeenEventsReference)(window)
                feed_keep(filled)  # type: ignore[arg-type]
            else:
                filled = (RecentEvents if fast else RecentEventsReference)(keep)
                feed_observe(filled)  # type: ignore[arg-type]
            gc.collect()
            name = "fast" if fast else "reference"
            held[case][name] = round(tracemalloc.get_traced_memory()[0] / n_users)
            tracemalloc.stop()
            del filled
        print(f"{case:13s} bytes per user after one pass: {held[case]}")
    result = {
        "benchmark": "seen_tails_micro",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["python", "bench/experiments/seen_tails_micro.py", *sys.argv[1:]]),
        "events": len(events),
        "batch": args.batch,
        "batches": len(batches),
        "users": len({e.user_id for e in events}),
        "users_per_batch": float(np.mean([len(g.user_ids) for g in grouped])),
        "dedupe_window": window,
        "keep": keep,
        "torch_threads": 1,
        "figures": figures,
        "bytes_per_user": held,
    }
    if args.json:
        write_result(Path(args.json), result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
