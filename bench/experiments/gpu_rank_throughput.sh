#!/usr/bin/env bash
# Issue 14 on a lent H200, one call of about 6 minutes: Rank against RankBatch, the memory
# service against SASRec served the same way, at closed-loop concurrency 64 from 8 client
# processes, replay off and R = 2; then one server process against 4 front-end processes
# (server.frontends) on the same engine. Carried: .gpu/rank (grpcio, faiss-cpu, protobuf, ...).
# Output: $OUT/rank_batch_gpu.json, $OUT/frontends_gpu.json (copy them to bench/results/).
set -u
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
timeout "${BATCH_S:-200}" python3 bench/bench_rank.py --device cuda --concurrency 64 \
  --replay 0,2 --shapes cand100 --systems memory,sasrec --rank-batch 0,32 --client-procs 8 \
  --seconds 6 --budget-s 90 --json "$OUT/rank_batch_gpu.json" 2>&1 | grep -E "^\||rror" | head -n 30
timeout "${FRONT_S:-150}" python3 bench/bench_frontends.py --device cuda --frontends 0,4 \
  --concurrency 64 --replay 0,2 --client-procs 8 --seconds 5 --rounds 1 \
  --json "$OUT/frontends_gpu.json" 2>&1 | grep -vE "it/s|^\s*$" | tail -n 20
ls -la "$OUT"
