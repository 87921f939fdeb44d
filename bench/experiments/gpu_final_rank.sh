#!/usr/bin/env bash
# One call on a lent H200 at the end of a round: the replay check (CUDA graph capture and
# correctness), the full gRPC rank benchmark, and the c=8 cells with a 1 ms batch window.
# Carried: .gpu/rank. Output: $OUT/replay_gpu.json, rank_gpu.json, rank_gpu_window1.json
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
python3 bench/gpu_replay.py --out "$OUT" 2>&1 | grep -E "errors|B= 8|B= 64 T= 40"
python3 bench/bench_rank.py --device cuda --threads 1 --budget-s "${RANK_S:-150}" \
  --json "$OUT/rank_gpu.json" 2>&1 | grep -E "^\|" | head -n 20
python3 bench/bench_rank.py --device cuda --threads 1 --concurrency 8 --replay 2,4 \
  --shapes cand100 --systems memory --seconds 2 --set server.batch_window_ms=1 \
  --json "$OUT/rank_gpu_window1.json" 2>&1 | grep -E "^memory" | cut -c1-120
