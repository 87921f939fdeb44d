#!/usr/bin/env bash
# Old (a worktree of the commit before the engine loop, 755df0e) against new (this tree),
# alternating in the same minutes on this machine: rank latency (bench_rank.py, memory only)
# and ingest rate (bench_ingest.py, ML-100K). The ingest arms: old `recmem ingest`
# (PipelinedSink, no NoteBank), old `recmem serve`'s ingest (the engine with the recent-event
# tails and the NoteBank, IngestService on the consumer's thread, as LockedSink ran it), and
# new `recmem ingest` (engine loop, NoteBank on, as serve ingests).
# Usage: bench/engine_ab.sh OLD_TREE OUT_DIR [PAIRS] [PARTS]   PARTS: rank,ingest (default both)
# NEW_SET="section.field=value ..." applies overrides to the new side only (both benchmarks),
# e.g. the old tree's default model, so that only the engine differs between the arms:
#   NEW_SET="$(bench/engine_ab.sh --old-model)" bench/engine_ab.sh OLD_TREE OUT 3
# ORDER=alternate runs new first in every second pair (default: old first in every pair).
set -euo pipefail
if [ "${1:-}" = --old-model ]; then  # 755df0e's default model in today's settings
  echo "model.hybrid=none model.request_time=none model.readout=linear model.dropout=0.1" \
    "memory.n_heads=4 memory.key_dim=64 memory.value_dim=64"
  exit 0
fi
old=$1; out=$2; pairs=${3:-3}; parts=${4:-rank,ingest}
new=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rank_args=(--concurrency 1,8 --replay 0,2 --shapes cand100,catalog --systems memory --seconds 3)
new_set=()
for kv in ${NEW_SET:-}; do new_set+=(--set "$kv"); done
# old serve's ingest composition, timed by the old bench_ingest.py
old_serve=$(cat <<'PY'
import sys, torch
sys.path.insert(0, "bench")
import bench_ingest
from pathlib import Path
from recmem.checkpoint import CheckpointStore
from recmem.ingest import IngestService
from recmem.server.serve import load_serving_model
from recmem.server.stack import build_rank_stack
from recmem.state_store import StateLayout

def build_service(cfg, *, init_model=False, device=None):
    dev = torch.device(device or "cpu")
    if cfg.server.torch_threads > 0:
        torch.set_num_threads(cfg.server.torch_threads)
    model, vocab, version, pop = load_serving_model(cfg, dev, init_model)
    stack = build_rank_stack(cfg, model, vocab, version, pop, dev)
    layout = StateLayout.from_config(cfg.memory, cfg.model)
    ckpts = CheckpointStore(Path(cfg.checkpoint.dir) / cfg.kafka.topic, layout, keep=cfg.checkpoint.keep)
    return IngestService(stack.engine, ckpts, cfg.checkpoint.interval_s)

bench_ingest.build_service = build_service
sys.argv = ["bench/bench_ingest.py", *sys.argv[1:]]
bench_ingest.main()
PY
)
for i in $(seq 1 "$pairs"); do
  sides="old new"
  if [ "${ORDER:-}" = alternate ] && [ $((i % 2)) -eq 0 ]; then sides="new old"; fi
  for side in $sides; do
    tree=$old; extra=()
    if [ "$side" = new ]; then tree=$new; extra=("${new_set[@]}"); fi
    if [[ $parts == *rank* ]]; then
      (cd "$tree" && PYTHONPATH=$tree .venv/bin/python bench/bench_rank.py "${rank_args[@]}" "${extra[@]}" \
        --json "$out/rank_${side}_$i.json" > "$out/rank_${side}_$i.log" 2>&1)
    fi
    if [[ $parts == *ingest* ]]; then
      (cd "$tree" && PYTHONPATH=$tree .venv/bin/python bench/bench_ingest.py --events 0 "${extra[@]}" \
        --tag "${side}_$i" --out "$out" > "$out/ingest_${side}_$i.log" 2>&1)
      if [ "$side" = old ]; then
        (cd "$old" && PYTHONPATH=$old .venv/bin/python -c "$old_serve" --events 0 --no-pipeline \
          --tag "oldserve_$i" --out "$out" > "$out/ingest_oldserve_$i.log" 2>&1)
      fi
    fi
  done
done
