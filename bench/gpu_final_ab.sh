#!/usr/bin/env bash
# One lent-H200 call for a stop's closing A/B (old tree against this one):
#   OLD=.gpu/old OLD_COMMIT=... GIT_COMMIT=... OUT=... bash bench/gpu_final_ab.sh
# 1. bench/experiments/rankbatch_engine.py: the engine process's CPU per RankBatch request,
#    R = 0 and 2, OLD and this tree alternating -> $OUT/rankbatch_engine_h200_final_ab.json
# 2. bench/gpu_engine_ab.sh: Engine.apply alone, OLD and this tree alternating
#    (EVENTS, BUDGET, ROUNDS, VARIANTS as there) -> $OUT/engine_apply_h200_{old,new}_rN.json
# 3. bench/bench_frontends.py on this tree, 8 front ends, memory and SASRec, c = 128,
#    R = 0 and 2 -> $OUT/frontends_h200_final.json
# Carried: .gpu/rank, .gpu/whl (bench/gpu_site.sh), OLD (a git archive of the old commit's
# recmem, streams, models, offline_eval, proto, bench, configs, tests, pyproject.toml).
set -u
OUT=${OUT:?set OUT to the output folder}
OLD=${OLD:?set OLD to the old tree}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
echo "cores $(nproc)"
timeout "${RANKBATCH_TIMEOUT_S:-200}" python3 bench/experiments/rankbatch_engine.py --device cuda \
  --root old="$OLD" --root-commit old="${OLD_COMMIT:-old}" --root-commit new="$GIT_COMMIT" \
  --batch 64 --replay 0,2 --seconds 3 --rounds 2 --json "$OUT/rankbatch_engine_h200_final_ab.json" \
  >"$OUT/rankbatch_final.log" 2>&1
echo "rankbatch_engine: exit $?"; tail -n 14 "$OUT/rankbatch_final.log"
VARIANTS=${VARIANTS:-default:} bash bench/gpu_engine_ab.sh
timeout "${FRONTENDS_TIMEOUT_S:-150}" python3 bench/bench_frontends.py --device cuda \
  --frontends 8 --concurrency 128 --replay 0,2 --seconds 3 --rounds 1 --client-procs 6 \
  --systems memory,sasrec --json "$OUT/frontends_h200_final.json" >"$OUT/frontends_final.log" 2>&1
echo "frontends: exit $?"; grep -E "^round" "$OUT/frontends_final.log"
