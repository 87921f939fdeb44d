#!/usr/bin/env bash
# One call on a lent H200 (nvidia-h200): the rank path's latency with the replay pass in
# CUDA graphs. Carried: .gpu/rank (faiss-cpu, grpcio + health/reflection, protobuf wheels
# for Python 3.12). Output under $OUT:
#   replay_gpu.json              bench/gpu_replay.py: read-out vs reference, graphs vs eager
#   profile_rank_gpu_graphs.json bench/profile_rank.py in process, server.cuda_graphs on
#   profile_rank_gpu_eager.json  ... and off
#   rank_gpu.json                bench/bench_rank.py over gRPC (default configuration,
#                                the replay cache off as the bench keeps it by default)
#   rank_gpu_cache.json          ... replay cells at 100 candidates with the cache on
# MODES (default "graphs eager") picks the profile_rank runs; SKIP_REPLAY=1 skips the first.
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
[ "${SKIP_REPLAY:-0}" = 1 ] || python3 bench/gpu_replay.py --out "$OUT" 2>&1 | grep -v -i warn | tail -n 16
for mode in ${MODES:-graphs eager}; do
  flag=true; [ $mode = eager ] && flag=false
  python3 bench/profile_rank.py --device cuda --threads 1 --batches 1,8,32 --replay 0,2,4 \
    --calls 40 --set server.cuda_graphs=$flag --tag _$mode --out "$OUT" 2>&1 | grep "^B="
done
python3 bench/bench_rank.py --device cuda --threads 1 --budget-s "${RANK_S:-150}" \
  --json "$OUT/rank_gpu.json" 2>&1 | grep -E "^(memory|sasrec|server|\|)" | tail -n 40
python3 bench/bench_rank.py --device cuda --threads 1 --concurrency 1,8,32 --replay 2,4 \
  --shapes cand100 --systems memory --replay-cache 100000 --seconds 2 \
  --json "$OUT/rank_gpu_cache.json" 2>&1 | grep -E "^memory"
