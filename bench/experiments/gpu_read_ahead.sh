#!/usr/bin/env bash
# One call on a lent H200: does routing replay requests as the batcher dequeues them
# (server.read_ahead) pay on a many-core GPU host? Same-minute A/B, alternating, memory
# cells only. Carried: .gpu/rank. Output: $OUT/rank_gpu_read_ahead_{on,off}_{1,2}.json
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
for i in 1 2; do
  for mode in off on; do
    flag=false; [ $mode = on ] && flag=true
    python3 bench/bench_rank.py --device cuda --threads 1 --concurrency 1,8,32 --replay 2,4 \
      --shapes cand100,catalog --systems memory --seconds 2 --set server.read_ahead=$flag \
      --json "$OUT/rank_gpu_read_ahead_${mode}_$i.json" 2>&1 | grep -E "^memory" | sed "s/^/$mode /" | cut -c1-130
  done
done
