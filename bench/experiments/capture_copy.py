"""Time a checkpoint capture (old: store.read in slices + MemoryState.cat; new:
ingest.capture, which reads into one buffer) and the file write, on a CPU engine after
the workload's first N events (4 partitions, every partition captured in full twice).

    PYTHONPATH=. .venv/bin/python bench/experiments/capture_copy.py N

Writes checkpoints under /dev/shm/capt-ck; prints per capture and totals."""

import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import engine_apply as ea  # noqa: E402
import torch  # noqa: E402

from models.recommender import MemoryRecommender  # noqa: E402
from recmem import ingest  # noqa: E402
from recmem.archive import NoteBank  # noqa: E402
from recmem.checkpoint.store import CheckpointStore  # noqa: E402
from recmem.config import load_config  # noqa: E402
from recmem.engine.engine import Engine  # noqa: E402
from recmem.producing import open_stream  # noqa: E402
from recmem.state_store import MemoryState, StateLayout, UserStateStore, state_to_numpy  # noqa: E402
from recmem.vocab import ItemVocab  # noqa: E402

n = int(sys.argv[1])
cfg = load_config(None, [], environ={})
stream = open_stream("workload", cfg)
events = ea.events_of(stream, n, partitions=4)
torch.manual_seed(0)
vocab = ItemVocab(stream.item_ids.tolist(), cfg.model.n_oov_buckets)
model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
layout = StateLayout.from_config(cfg.memory, cfg.model)
users = len({e.user_id for e in events})
store = UserStateStore(
    layout, max(users, 1024), 0, Path("/dev/shm/capt-spill"), torch.device("cpu")
)
mem = cfg.memory
bank = NoteBank(
    cfg.archive,
    mem.key_dim,
    mem.n_layers * mem.n_heads,
    seed=0,
    use_gpu=False,
    query_dim=model.route_dim,
)
engine = Engine(model, vocab, store, cfg, bank=bank)
t = time.perf_counter()
for s in range(0, len(events), 4096):
    engine.apply(events[s : s + 4096])
print(f"{users} users, apply {time.perf_counter() - t:.1f}s", flush=True)
res = {"users": users, "old": [], "new": [], "write_copy": [], "write_view": []}
root = Path("/dev/shm/capt-ck")
shutil.rmtree(root, ignore_errors=True)
ck = CheckpointStore(root, layout)
for _rep in range(2):
    for p in range(4):
        every = engine.users_of(p)
        t0 = time.perf_counter()
        states = [store.read(every[s : s + 1024]) for s in range(0, len(every), 1024)]
        st_old = MemoryState.cat(states)
        arr = engine.export_arrays(every)
        t1 = time.perf_counter()
        del states
        g = ingest.capture(engine, p, True)
        try:
            while True:
                next(g)
        except StopIteration as e:
            c = e.value
        t2 = time.perf_counter()
        same = all(
            torch.equal(a, b)
            for a, b in zip(st_old.to_fields().values(), c.state.to_fields().values())
        )
        # writer: old (state_to_numpy copy) vs new (views)
        t3 = time.perf_counter()
        x = state_to_numpy(c.state)
        del x
        t4 = time.perf_counter()
        path = ck.write(p, c.users, c.state, 1, model_version="m", settings={}, notes=c.arrays)
        t5 = time.perf_counter()
        res["old"].append(t1 - t0)
        res["new"].append(t2 - t1)
        res["write_copy"].append(t4 - t3)
        res["write_view"].append(t5 - t4)
        print(
            f"p{p}: {len(every)} users capture old {t1 - t0:.3f} new {t2 - t1:.3f} same={same}; state_to_numpy copy {t4 - t3:.3f}; write (views) {t5 - t4:.3f}",
            flush=True,
        )
        del st_old, c
print(json.dumps({k: (round(sum(v), 3) if isinstance(v, list) else v) for k, v in res.items()}))
