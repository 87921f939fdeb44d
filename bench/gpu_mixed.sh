#!/usr/bin/env bash
# One call on a lent H200: rank latency while events arrive (bench_rank --ingest-rate),
# with the replay cache off and on. Carried: .gpu/rank. Output:
#   $OUT/rank_gpu_mixed_nocache.json, $OUT/rank_gpu_mixed_cache.json
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
RATE=${RATE:-1000}
for cache in 0 100000; do
  name=nocache; [ $cache != 0 ] && name=cache
  python3 bench/bench_rank.py --device cuda --threads 1 --concurrency 1,8,32 --replay 0,2 \
    --shapes cand100 --systems memory --seconds 2 --ingest-rate "$RATE" --replay-cache $cache \
    --json "$OUT/rank_gpu_mixed_$name.json" 2>&1 | grep -E "^memory" | sed "s/^/$name /" | cut -c1-120
  python3 -c "
import json; d=json.load(open('$OUT/rank_gpu_mixed_$name.json'))
for c in d['cells']: print('$name', c['concurrency'], c['replay_notes'], 'hits', round(c['replay_cache_hit_share'], 2), 'events', c['events_ingested'])"
done
