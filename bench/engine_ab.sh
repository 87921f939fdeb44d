#!/usr/bin/env bash
# Old (a worktree of the commit before the engine loop) against new (this tree), alternating
# in the same minutes on this machine: rank latency (bench_rank.py, memory only) and ingest
# rate (bench_ingest.py, ML-100K). Usage: bench/engine_ab.sh OLD_TREE OUT_DIR [PAIRS]
set -euo pipefail
old=$1; out=$2; pairs=${3:-3}
new=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rank_args=(--concurrency 1,8 --replay 0,2 --shapes cand100,catalog --systems memory --seconds 3)
for i in $(seq 1 "$pairs"); do
  for side in old new; do
    tree=$old; [ "$side" = new ] && tree=$new
    (cd "$tree" && PYTHONPATH=$tree .venv/bin/python bench/bench_rank.py "${rank_args[@]}" \
      --json "$out/rank_${side}_$i.json" > "$out/rank_${side}_$i.log" 2>&1)
    (cd "$tree" && PYTHONPATH=$tree .venv/bin/python bench/bench_ingest.py --events 0 \
      --tag "${side}_$i" --out "$out" > "$out/ingest_${side}_$i.log" 2>&1)
  done
done
