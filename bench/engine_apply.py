"""The engine's ingest step alone, without Kafka: how many events per second
``Engine.apply`` takes on the benchmark workload, for several configurations in one run.

    .venv/bin/python bench/engine_apply.py [--dataset workload] [--events 500000]
        [--batch 4096] [--device auto] [--set S.F=V ...] [--budget-s 60]
        [--variant NAME:S.F=V,S.F=V ...] [--json PATH]

Each variant builds a fresh engine (freshly initialised model, the dataset's items as
vocabulary, a state store that holds every user on the device, the NoteBank unless the
variant says ``archive=off``) and applies the first M events in batches of ``--batch``
(the consumer's ``kafka.max_poll_records``), after one warm-up batch, until all are
applied or ``--budget-s`` has passed. This is the upper bound of end-to-end ingest
(bench/bench_ingest.py): no decoding, no broker, no checkpoints. Figures per variant:
events/s, the engine's seconds per phase (group, gather, advance, scatter, archive),
padded user-steps per event, users.

Variant syntax: ``NAME:section.field=value,section.field=value``, with ``archive=off`` (no
NoteBank) and ``batch=N`` (events per batch for this variant) allowed among them, or
``NAME:`` (the defaults). On a GPU the model step is followed by a synchronisation (as
the next phase's first copy to the host would wait for it anyway), so that ``advance``
holds the GPU's time and ``scatter`` only its own. Default variants: ``default``,
``no-archive``, ``buckets`` (state.length_buckets=on), ``packed`` (state.packed_advance=on).

Writes JSON (machine, date, commit, command, figures) to --json (default
bench/results/engine_apply_<device>.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchinfo import git_commit, machine, write_result  # noqa: E402

from models.recommender import MemoryRecommender  # noqa: E402
from recmem.archive import NoteBank  # noqa: E402
from recmem.config import load_config  # noqa: E402
from recmem.engine.engine import Engine  # noqa: E402
from recmem.producing import open_stream  # noqa: E402
from recmem.state_store import StateLayout, UserStateStore  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402
from streams.validate import ValidEvent  # noqa: E402

DEFAULT_VARIANTS = (
    "default:",
    "no-archive:archive=off",
    "buckets:state.length_buckets=on",
    "packed:state.packed_advance=on",
)


def events_of(stream, n: int, partitions: int = 16) -> list[ValidEvent]:  # type: ignore[no-untyped-def]
    """The stream's first ``n`` events as validated events (partition: user code mod
    ``partitions``; offsets count up)."""
    out: list[ValidEvent] = []
    for c in stream.chunks(1 << 16):
        users = stream.user_ids[c.user].tolist()
        items = stream.item_ids[c.item].tolist()
        parts = (c.user % partitions).tolist()
        for u, i, t, a, v, p in zip(
            users, items, c.ts_ms.tolist(), c.action.tolist(), c.value.tolist(), parts
        ):
            out.append(ValidEvent(u, i, t, a, v, None, p, len(out)))
            if len(out) == n:
                return out
    return out


def run_variant(
    name: str,
    overrides: list[str],
    args: argparse.Namespace,
    stream,
    events,
    dev,  # type: ignore[no-untyped-def]
) -> dict[str, object]:
    archive = "archive=off" not in overrides
    batches = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("batch=")]
    sets = [o for o in overrides if o != "archive=off" and not o.startswith("batch=")]
    cfg = load_config(None, [*args.set, *sets], environ={})
    torch.manual_seed(cfg.train.seed)
    vocab = ItemVocab(stream.item_ids.tolist(), cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    users = len({e.user_id for e in events})
    store = UserStateStore(layout, max(users, 1024), 0, Path(args.spill) / name, dev)
    mem = cfg.memory
    bank = (
        NoteBank(
            cfg.archive,
            mem.key_dim,
            mem.n_layers * mem.n_heads,
            seed=cfg.train.seed,
            use_gpu=False,
            query_dim=model.route_dim,
        )  # fmt: skip
        if archive
        else None
    )
    engine = Engine(model, vocab, store, cfg, bank=bank)
    if engine.compiles:
        engine.compile_step()
    if dev.type == "cuda":
        step = engine.compute

        def synced(piece):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            step(piece)
            torch.cuda.synchronize()
            piece.seconds["advance"] = time.perf_counter() - t

        engine.compute = synced  # type: ignore[method-assign]
    b = batches[-1] if batches else args.batch
    engine.apply(events[:b])  # warm-up: kernels compiled / tuned, allocator grown
    for k in engine.seconds:
        engine.seconds[k] = 0.0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    done = 0
    start = time.perf_counter()
    for s in range(b, len(events), b):
        engine.apply(events[s : s + b])
        done += len(events[s : s + b])
        if time.perf_counter() - start > args.budget_s:
            break
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    out = {
        "overrides": overrides,
        "batch": b,
        "events": done,
        "seconds": round(wall, 3),
        "events_per_s": round(done / max(wall, 1e-9)),
        "complete": done == len(events) - b,
        "users_resident": store.tier_counts()["device"],
        "padded_user_steps_per_event": round(engine.seconds["user_steps"] / max(done, 1), 2),
        "profile_seconds": {k: round(v, 3) for k, v in engine.seconds.items() if k != "user_steps"},
        "packed_step": engine.packs,
        "compiled_step": engine.compiles,
    }
    print(f"{name:12s} {out['events_per_s']:>9} events/s  {out['profile_seconds']}", flush=True)
    del engine, store, bank, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", default="workload", help="workload | a dataset | npz:PATH")
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--set", action="append", default=[], help="section.field=value (all)")
    ap.add_argument("--variant", action="append", default=[], help="NAME:S.F=V,S.F=V")
    ap.add_argument("--budget-s", type=float, default=60.0, help="per variant")
    ap.add_argument("--spill", default="/tmp/engine-apply-spill")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    cfg = load_config(None, args.set, environ={})
    stream = open_stream(args.dataset, cfg)
    t0 = time.perf_counter()
    events = events_of(stream, args.events)
    print(f"{len(events)} events, {len({e.user_id for e in events})} users "
          f"({time.perf_counter() - t0:.1f} s to make them); {dev}", flush=True)  # fmt: skip
    variants = {}
    for spec in args.variant or DEFAULT_VARIANTS:
        name, _, rest = spec.partition(":")
        overrides = [o for o in rest.split(",") if o]
        variants[name] = run_variant(name, overrides, args, stream, events, dev)
    result = {
        "benchmark": "engine_apply",
        "machine": machine() + (f", {torch.cuda.get_device_name(0)}" if dev.type == "cuda" else ""),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["python", "bench/engine_apply.py", *sys.argv[1:]]),
        "dataset": args.dataset,
        "events": len(events),
        "users": len({e.user_id for e in events}),
        "batch": args.batch,
        "device": str(dev),
        "torch": torch.__version__,
        "variants": variants,
    }
    path = args.json or str(
        Path(os.environ.get("OUT", ROOT / "bench" / "results")) / f"engine_apply_{dev.type}.json"
    )
    write_result(Path(path), result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
