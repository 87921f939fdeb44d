#!/usr/bin/env bash
# Rank on a lent H200 (nvidia-h200: 16 cores, no internet), one call:
#   OLD=.gpu/old OLD_COMMIT=... GIT_COMMIT=... OUT=... bash bench/gpu_rank_ab.sh
# Carried (ignored paths): .gpu/rank (faiss-cpu, grpcio, protobuf, kafka-python ... wheels for
# Python 3.12), .gpu/whl (fla-core, einops), OLD (a git archive of the old commit's recmem,
# streams, models, offline_eval, proto and bench).
# Output under $OUT:
#   rankbatch_engine_h200_ab.json  bench/experiments/rankbatch_engine.py: the engine process's
#                                  CPU and wall time per RankBatch request, OLD and this tree
#                                  alternating, on the GPU
#   frontends_h200_sasrec.json     bench/bench_frontends.py --systems memory,sasrec: the one
#                                  process and N front ends, memory against SASRec served the
#                                  same way, c = 64 and 128, R = 0 and 2
#   frontends_h200_aio.json        the same cells, memory only, server.frontend_mode = aio
# Sizes (env): FRONTENDS (0,4,8), CLIENT_PROCS (6), CELL_S (3).
set -u
OUT=${OUT:?set OUT to the output folder}
OLD=${OLD:?set OLD to the old tree}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "cores $(nproc)"
timeout 200 python3 bench/experiments/rankbatch_engine.py --device cuda --root old="$OLD" \
  --root-commit old="${OLD_COMMIT:-old}" --root-commit new="$GIT_COMMIT" --seconds 3 \
  --rounds 2 --json "$OUT/rankbatch_engine_h200_ab.json" >"$OUT/rankbatch.log" 2>&1
echo "rankbatch_engine: exit $?"; tail -n 12 "$OUT/rankbatch.log"
frontends() {  # frontends NAME ARGS...
  local name=$1; shift
  timeout "${FRONTENDS_TIMEOUT_S:-240}" python3 bench/bench_frontends.py --device cuda \
    --frontends "${FRONTENDS:-0,4,8}" --concurrency 64,128 --replay 0,2 \
    --seconds "${CELL_S:-3}" --rounds 1 --client-procs "${CLIENT_PROCS:-6}" "$@" \
    --json "$OUT/frontends_h200_$name.json" >"$OUT/frontends_$name.log" 2>&1
  echo "frontends $name: exit $?"; tail -n 20 "$OUT/frontends_$name.log"
}
frontends sasrec --systems memory,sasrec
FRONTENDS=${AIO_FRONTENDS:-4,8} frontends aio --set server.frontend_mode=aio
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
