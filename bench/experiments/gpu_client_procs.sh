#!/usr/bin/env bash
# One call on a lent H200: the rank cells with the clients in 8 processes instead of 8
# threads of one (independent clients, as in production; the host has 16 cores), the
# replay cache off. Carried: .gpu/rank. Output: $OUT/rank_gpu_client_procs.json
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
python3 bench/bench_rank.py --device cuda --threads 1 --concurrency 1,8,32 --replay 0,2,4 \
  --shapes cand100 --systems memory --seconds 2 --client-procs 8 \
  --json "$OUT/rank_gpu_client_procs.json" 2>&1 | grep -E "^memory" | cut -c1-120
