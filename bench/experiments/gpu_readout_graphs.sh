#!/usr/bin/env bash
# The read-out under CUDA graphs (models/graphs.py GraphedReadout) on a lent H200, one call
# of about 3 minutes: the CUDA tests of tests/models/test_graphs.py, the Ranker alone
# (profile_rank.py) and the served Rank / RankBatch cells of gpu_rank_throughput.sh for the
# memory service. Carried: .gpu/rank. Output: $OUT/profile_rank_gpu_readout.json,
# $OUT/rank_batch_gpu_readout.json.
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/models/test_graphs.py 2>&1 | tail -n 3
timeout 60 python3 bench/profile_rank.py --device cuda --threads 1 --batches 32,64 --replay 0,2 \
  --calls 30 --tag _readout --out "$OUT" 2>&1 | grep -E "^B=|rror"
timeout 90 python3 bench/bench_rank.py --device cuda --concurrency 64 --replay 0,2 \
  --shapes cand100 --systems memory --rank-batch 0,32 --client-procs 8 --seconds 5 \
  --budget-s 70 --json "$OUT/rank_batch_gpu_readout.json" 2>&1 | grep -E "^\||rror" | head -n 12
