#!/usr/bin/env bash
# One call on a lent H200 (nvidia-h200) for issue 14, each step bounded so the call fits a
# short device budget. Carried: .gpu/rank (faiss-cpu, grpcio, protobuf, kafka-python ...
# wheels for Python 3.12) and .gpu/whl (fla-core, einops). Output under $OUT:
#   frontends_gpu.json     bench/bench_frontends.py: Rank through N front-end processes
#                          (server.frontends) against the one-process server, same engine
#                          and run, closed loop at concurrency 64 and 128, R = 0 and 2
#   chunk_kernel_h200.json the chunked Triton memory kernel against the sequential one and
#                          fla's chunk_gated_delta_rule (CHUNK_BENCH, when the file exists)
#   *.log                  each step's output
# FRONTENDS (default "0,4,8"), CLIENT_PROCS (6), CELL_S (3) and CHUNK_S (150) size the run.
set -u
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
CHUNK_BENCH=${CHUNK_BENCH:-bench/gpu_chunk_kernel.py}
if [ -f "$CHUNK_BENCH" ]; then
  timeout $(( ${CHUNK_S:-150} + 60 )) python3 "$CHUNK_BENCH" --json "$OUT/chunk_kernel_h200.json" \
    --budget-s "${CHUNK_S:-150}" >"$OUT/chunk_kernel.log" 2>&1
  echo "chunk kernel bench: exit $?"; tail -n 15 "$OUT/chunk_kernel.log"
fi
timeout "${FRONTENDS_TIMEOUT_S:-200}" python3 bench/bench_frontends.py --device cuda \
  --frontends "${FRONTENDS:-0,4,8}" --concurrency 64,128 --replay 0,2 \
  --seconds "${CELL_S:-3}" --rounds 1 --client-procs "${CLIENT_PROCS:-6}" \
  --json "$OUT/frontends_gpu.json" >"$OUT/frontends.log" 2>&1
echo "frontends bench: exit $?"; tail -n 25 "$OUT/frontends.log"
