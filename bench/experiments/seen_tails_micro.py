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
``keep`` gets other keys, so that nothing is a duplicate).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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

    def run_keep(cls: type) -> tuple[float, float]:
        seen = cls(window)
        t = time.perf_counter()
        for b in batches:
            seen.keep(b.user_id, b.key)
        t1 = time.perf_counter()
        for b in batches:  # again, every user known (other keys: no duplicates)
            seen.keep(b.user_id, b.key + 1)
        return t1 - t, time.perf_counter() - t1

    def run_observe(cls: type) -> tuple[float, float]:
        tails = cls(keep)
        times = []
        for _ in range(2):  # the second pass: every user known
            t = time.perf_counter()
            for g, q in zip(grouped, queries):
                tails.observe(g.user_ids, g.items, g.actions, g.ts_ms, g.lengths, q, packed=True)
            times.append(time.perf_counter() - t)
        return times[0], times[1]

    cases = {
        "keep": (run_keep, {"reference": SeenEventsReference, "fast": SeenEvents}),
        "observe": (run_observe, {"reference": RecentEventsReference, "fast": RecentEvents}),
    }
    us: dict[str, dict[str, list[float]]] = {
        f"{c}_{p}": {"reference": [], "fast": []} for c in cases for p in ("cold", "warm")
    }
    for r in range(args.rounds):
        for case, (fn, classes) in cases.items():
            names = list(classes) if r % 2 == 0 else list(classes)[::-1]
            for name in names:
                cold, warm = fn(classes[name])
                us[f"{case}_cold"][name].append(round(cold / len(events) * 1e6, 3))
                us[f"{case}_warm"][name].append(round(warm / len(events) * 1e6, 3))
    figures = {
        case: {
            name: {"us_per_event": v, "median_us_per_event": statistics.median(v)}
            for name, v in per.items()
        }
        for case, per in us.items()
    }
    for case, per in figures.items():
        ref, fast = per["reference"]["median_us_per_event"], per["fast"]["median_us_per_event"]
        print(
            f"{case:13s} reference {ref:7.3f} us/event  fast {fast:7.3f} us/event  x{ref / fast:.1f}"
        )
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
    }
    if args.json:
        write_result(Path(args.json), result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
