"""Where ``Engine.apply``'s CPU-side Python goes, per event, without the model step and the
state store: each phase's seconds with the store's gather and scatter (``UserStateStore``)
and the latest events' write (``RecentEvents.observe``) timed apart and taken out, so that
grouping, duplicate keys, piece arrays, bookkeeping and the NoteBank's write path show
above the machine's noise. The engine is built as bench/engine_apply.py builds it (fresh
model, the workload's items as vocabulary, NoteBank on).

    PYTHONPATH=. .venv/bin/python bench/experiments/apply_phases.py [--events 40000]
        [--batch 4096] [--json PATH]

Figures (microseconds per applied event): ``event_batch`` (EventBatch.of of event objects,
which consumer processes do in their own process), ``plan`` (duplicate keys and grouping of
the columns), ``begin_arrays`` (begin without the store's gather), ``commit_book`` (commit
without the store's scatter and the latest events: partition bookkeeping),
``latest_events``, ``notes`` (commit_notes), and the store's ``store_gather`` /
``store_scatter`` for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402
from engine_apply import events_of  # noqa: E402

from models.recommender import MemoryRecommender  # noqa: E402
from recmem.archive import NoteBank  # noqa: E402
from recmem.config import load_config  # noqa: E402
from recmem.engine.engine import Engine  # noqa: E402
from recmem.producing import open_stream  # noqa: E402
from recmem.state_store import StateLayout, UserStateStore  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402
from streams.batch import EventBatch  # noqa: E402


def timed(seconds: dict[str, float], key: str, fn):  # type: ignore[no-untyped-def]
    """``fn`` with its seconds added to ``seconds[key]``."""

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=40_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = load_config(None, [], environ={})
    stream = open_stream("workload", cfg)
    events = events_of(stream, args.events + args.batch)
    torch.manual_seed(cfg.train.seed)
    vocab = ItemVocab(stream.item_ids.tolist(), cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    users = len({e.user_id for e in events})
    store = UserStateStore(layout, max(users, 1024), 0, Path("/tmp/apply-phases-spill"), "cpu")
    mem = cfg.memory
    bank = NoteBank(
        cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed,
        use_gpu=False, query_dim=model.route_dim,
    )  # fmt: skip
    engine = Engine(model, vocab, store, cfg, bank=bank)
    engine.apply(events[: args.batch])  # warm-up
    s = dict.fromkeys(
        ("event_batch", "plan", "begin", "commit", "notes", "store_gather", "store_scatter",
         "latest_events"), 0.0,
    )  # fmt: skip
    store.gather = timed(s, "store_gather", store.gather)  # type: ignore[method-assign]
    store.scatter = timed(s, "store_scatter", store.scatter)  # type: ignore[method-assign]
    engine.tails.observe = timed(s, "latest_events", engine.tails.observe)  # type: ignore[method-assign]
    done = 0
    for start in range(args.batch, len(events), args.batch):
        part = events[start : start + args.batch]
        t0 = time.perf_counter()
        b = EventBatch.of(part)
        t1 = time.perf_counter()
        plan = engine.plan(b)
        t2 = time.perf_counter()
        s["event_batch"] += t1 - t0
        s["plan"] += t2 - t1
        for rows in plan.pieces:
            t0 = time.perf_counter()
            piece = engine.begin(plan, rows)
            s["begin"] += time.perf_counter() - t0
            engine.compute(piece)
            t0 = time.perf_counter()
            engine.commit(piece)
            t1 = time.perf_counter()
            engine.commit_notes(piece)
            s["commit"] += t1 - t0
            s["notes"] += time.perf_counter() - t1
        done += plan.counts.events
    us = {k: v / done * 1e6 for k, v in s.items()}
    figures = {
        "event_batch": us["event_batch"],
        "plan": us["plan"],
        "begin_arrays": us["begin"] - us["store_gather"],
        "commit_book": us["commit"] - us["store_scatter"] - us["latest_events"],
        "latest_events": us["latest_events"],
        "notes": us["notes"],
        "store_gather": us["store_gather"],
        "store_scatter": us["store_scatter"],
    }
    figures = {k: round(v, 3) for k, v in figures.items()}
    print(figures, flush=True)
    result = {
        "benchmark": "apply_phases",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["python", "bench/experiments/apply_phases.py", *sys.argv[1:]]),
        "events": done,
        "users": users,
        "batch": args.batch,
        "us_per_event": figures,
    }
    if args.json:
        write_result(Path(args.json), result)


if __name__ == "__main__":
    main()
