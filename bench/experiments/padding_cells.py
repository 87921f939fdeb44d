"""Padded cells of the GPU engine step on the benchmark workload, computed offline (no
model, no broker): the first N workload events split over the partitions as the producer
keys them (murmur2 of the user id), P partitions per member, each member's events cut into
batches of ``--batch`` events in order (what one poll of ``kafka.max_poll_records`` holds),
and per batch the users B, the longest user T and the padded cells B x T of one piece, and
of the pieces ``state.piece_cells`` = C cuts (rows x each piece's longest length).

    .venv/bin/python bench/experiments/padding_cells.py [--events 600000] [--partitions 16]
        [--members 8] [--batch 4096] [--caps 0,262144,65536] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from recmem.config import Config
    from recmem.engine.engine import _cut
    from recmem.workload import workload_chunks
    from streams.partitioner import partition_for

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--events", type=int, default=600_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--caps", default="0,262144,65536")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    spec = Config().workload
    parts, n = [], 0
    for chunk in workload_chunks(spec):
        parts.append(np.asarray(chunk.user))
        n += len(parts[-1])
        if n >= args.events:
            break
    users = np.concatenate(parts)[: args.events]
    uniq = np.unique(users)
    part_of = {int(u): partition_for(f"u{u}", args.partitions) for u in uniq}
    part = np.array([part_of[int(u)] for u in users])
    caps = [int(c) for c in args.caps.split(",")]
    per = args.partitions // args.members
    cells: dict[int, list[int]] = {c: [] for c in caps}
    pieces: dict[int, list[int]] = {c: [] for c in caps}
    for m in range(args.members):
        mine = users[np.isin(part, np.arange(m * per, (m + 1) * per))]
        for i in range(0, len(mine), args.batch):
            _, counts = np.unique(mine[i : i + args.batch], return_counts=True)
            lengths = np.sort(counts)[::-1]
            rows = np.arange(len(lengths))
            for c in caps:
                cut = _cut(rows, lengths, len(rows), c)
                pieces[c].append(len(cut))
                cells[c].append(sum(len(p) * int(lengths[p[0]]) for p in cut))
    events = args.batch
    out = {
        "benchmark": "padding_cells",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": vars(args) | {"json": str(args.json)},
        "batches": len(cells[caps[0]]),
        "by_cap": {
            str(c): {
                "cells_per_event_median": round(float(np.median(cells[c])) / events, 1),
                "cells_per_event_p90": round(float(np.percentile(cells[c], 90)) / events, 1),
                "cells_max": int(max(cells[c])),
                "pieces_median": float(np.median(pieces[c])),
                "pieces_max": int(max(pieces[c])),
            }
            for c in caps
        },
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
