#!/usr/bin/env bash
# The identity read-out (model.readout default since e1d6587) on a lent H200, one call of
# about 7 minutes: the CUDA tests of the graphed passes and of the fused training kernels,
# training throughput of every memory training path against SASRec with each fused path
# checked against the eager chunked form (bench/bench_train.py, ML-1M), and the served Rank
# / RankBatch cells for the memory service. Carried: .gpu (whl, rank, data).
# Output: $OUT/train_gpu.json, $OUT/rank_batch_gpu_identity.json, $OUT/*.log.
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/whl/*.whl \
  .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_graphs.py \
  tests/models/test_memory_triton_train.py tests/models/test_memory_triton.py 2>&1 | tail -n 5
timeout 260 python3 bench/bench_train.py --split .gpu/data/ml-1m-split.npz --device cuda \
  --budget-s 200 --no-sweep --json "$OUT/train_gpu.json" >"$OUT/train_gpu.log" 2>&1
tail -n 8 "$OUT/train_gpu.log"
timeout 100 python3 bench/bench_rank.py --device cuda --concurrency 64 --replay 0,2 \
  --shapes cand100 --systems memory --rank-batch 0,32 --client-procs 8 --seconds 5 \
  --budget-s 80 --json "$OUT/rank_batch_gpu_identity.json" 2>&1 | grep -E "^\||rror" | head -n 12
