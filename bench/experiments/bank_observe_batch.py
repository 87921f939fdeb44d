"""``NoteBank.observe_batch`` alone on workload-shaped batches, for one source tree (run it
once per tree to compare two commits; nothing else of the engine runs).

    .venv/bin/python bench/experiments/bank_observe_batch.py --root DIR [--events 200000]
        [--batch 4096] [--json PATH]

The first ``--events`` events of the benchmark workload (Zipf users), cut into batches of
``--batch`` and grouped by user as the engine groups them (users longest first, right-padded
[B, T] arrays, positions counting on from each user's earlier events), with packed k and q
[N, L, H, K] float32 tensors at the default model dims (what the engine passes on the CPU).
Item ids: a list per user as the engine built them before ItemIdRows, or one ItemIdRows
where the tree has it; their making is timed with the call ("ids+observe"). The batches
are made before timing; the bank is the tree's ``NoteBank`` with the default archive
settings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", required=True, help="source tree whose recmem to time")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    root = str(Path(args.root).resolve())
    sys.path.insert(0, root)
    import numpy as np
    import torch

    import recmem.archive as archive
    from recmem.config import load_config
    from recmem.producing import open_stream

    assert archive.__file__.startswith(root), archive.__file__
    torch.set_num_threads(1)
    cfg = load_config(None, [], environ={})
    mem = cfg.memory
    L, H, K = mem.n_layers, mem.n_heads, mem.key_dim
    stream = open_stream("workload", cfg)
    users_l, items_l, ts_l, act_l = [], [], [], []
    got = 0
    for c in stream.chunks(1 << 16):
        take = min(len(c.user), args.events - got)
        users_l.append(c.user[:take])
        items_l.append(c.item[:take])
        ts_l.append(c.ts_ms[:take])
        act_l.append(c.action[:take])
        got += take
        if got >= args.events:
            break
    user, item = np.concatenate(users_l), np.concatenate(items_l).astype(np.int64)
    ts, act = np.concatenate(ts_l).astype(np.int64), np.concatenate(act_l).astype(np.int64)
    names = np.empty(len(stream.item_ids), dtype=object)
    names[:] = [str(i) for i in stream.item_ids.tolist()]
    rng = np.random.default_rng(0)
    seen: dict[int, int] = {}
    batches = []
    for s in range(0, len(user), args.batch):
        u, it, t, a = (x[s : s + args.batch] for x in (user, item, ts, act))
        order = np.argsort(u, kind="stable")
        uniq, first, lens = np.unique(u[order], return_index=True, return_counts=True)
        by_len = np.argsort(-lens, kind="stable")
        uniq, first, lens = uniq[by_len], first[by_len], lens[by_len]
        B, T = len(uniq), int(lens.max())
        idx = np.zeros((B, T), dtype=np.int64)
        valid = np.arange(T)[None, :] < lens[:, None]
        idx[valid] = order[np.concatenate([np.arange(f, f + n) for f, n in zip(first, lens)])]
        before = np.array([seen.get(x, 0) for x in uniq.tolist()], dtype=np.int64)
        for x, n in zip(uniq.tolist(), lens.tolist()):
            seen[x] = seen.get(x, 0) + n
        N = int(lens.sum())
        batches.append(
            dict(
                users=[f"user-{x}" for x in uniq.tolist()],
                items=np.where(valid, it[idx], 0),
                actions=np.where(valid, a[idx], 0),
                ts=np.where(valid, t[idx], 0),
                pos=before[:, None] + np.arange(1, T + 1)[None, :],
                lens=lens.astype(np.int64),
                k=torch.from_numpy(rng.normal(size=(N, L, H, K)).astype(np.float32)),
                q=torch.from_numpy(rng.normal(size=(N, L, H, K)).astype(np.float32)),
            )
        )
    flat_ids = hasattr(archive, "ItemIdRows")

    def item_ids(items: np.ndarray, lens: np.ndarray):  # type: ignore[no-untyped-def]
        flat = names[items[np.arange(items.shape[1])[None, :] < lens[:, None]]]
        if flat_ids:
            return archive.ItemIdRows(flat, lens)
        # the engine's list per user (Engine._item_ids before ItemIdRows)
        return [part.tolist() for part in np.split(flat, np.cumsum(lens)[:-1])]

    bank = archive.NoteBank(
        cfg.archive, K, L * H, seed=0, use_gpu=False, query_dim=K
    )  # fmt: skip
    call_s = total_s = 0.0
    notes = 0
    for b in batches:
        t0 = time.perf_counter()
        ids = item_ids(b["items"], b["lens"])
        t1 = time.perf_counter()
        notes += bank.observe_batch(
            b["users"], b["items"], ids, b["actions"], b["ts"], b["pos"], b["lens"],
            b["k"], b["q"], packed=True,
        )  # fmt: skip
        t2 = time.perf_counter()
        call_s += t2 - t1
        total_s += t2 - t0
    commit = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or os.environ.get("GIT_COMMIT", "unknown")
    out = {
        "benchmark": "bank_observe_batch",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "root": root,
        "commit": commit,
        "command": " ".join(["python", "bench/experiments/bank_observe_batch.py", *sys.argv[1:]]),
        "item_ids": "ItemIdRows" if flat_ids else "list per user",
        "events": int(sum(int(b["lens"].sum()) for b in batches)),
        "batches": len(batches),
        "users_per_batch": round(float(np.mean([len(b["users"]) for b in batches])), 1),
        "users": len(seen),
        "notes": notes,
        "observe_batch_s": round(call_s, 3),
        "ids_plus_observe_s": round(total_s, 3),
        "ms_per_batch": round(1000 * total_s / len(batches), 2),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
