"""Host bytes per user of the NoteBank's open chunks (users with buffered events and no
notes yet), for one source tree: tracemalloc's count of everything the bank allocates
(numpy arrays, Python objects, the per-user dicts) after ``--users`` users each observed
``--events`` events (fewer than a chunk, so no note is written), divided by the users.

    .venv/bin/python bench/experiments/bank_pending_bytes.py --root DIR [--users 20000]
        [--events 1 2 16]

The item ids are shared strings (as the engine's vocabulary names are), so the figure
holds a pointer per event, not a string. Default model dims and archive settings.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", required=True)
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--events", type=int, nargs="+", default=[1, 2, 16])
    args = ap.parse_args()
    root = str(Path(args.root).resolve())
    sys.path.insert(0, root)
    import numpy as np

    import recmem.archive as archive
    from recmem.config import load_config

    assert archive.__file__.startswith(root), archive.__file__
    cfg = load_config(None, [], environ={})
    mem = cfg.memory
    L, H, K = mem.n_layers, mem.n_heads, mem.key_dim
    names = np.empty(1000, dtype=object)
    names[:] = [f"item-{i}" for i in range(1000)]
    users = [f"user-{u}" for u in range(args.users)]
    out = {}
    rng = np.random.default_rng(0)
    for n in args.events:
        B = 2048
        batches = []
        for b0 in range(0, len(users), B):
            ids = users[b0 : b0 + B]
            items = rng.integers(0, 1000, size=(len(ids), n))
            batches.append(
                (
                    ids, items, [list(names[row]) for row in items],
                    np.zeros((len(ids), n), np.int64), np.ones((len(ids), n), np.int64),
                    np.broadcast_to(np.arange(1, n + 1), (len(ids), n)),
                    np.full(len(ids), n),
                    rng.normal(size=(len(ids), n, L, H, K)).astype(np.float32),
                    rng.normal(size=(len(ids), n, L, H, K)).astype(np.float32),
                )
            )  # fmt: skip
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        bank = archive.NoteBank(cfg.archive, K, L * H, seed=0, use_gpu=False, query_dim=K)
        for b in batches:
            assert bank.observe_batch(*b) == 0
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert sum(bank.pending_count(u) for u in users[:100]) == 100 * n
        out[f"{n}_events"] = round((after - before) / len(users), 1)
        del bank, batches
    print(json.dumps({"root": root, "users": args.users, "bytes_per_user": out}, indent=1))


if __name__ == "__main__":
    main()
