#!/usr/bin/env bash
# Where the cores go when Rank is served through front ends on a lent H200 (16 cores), one
# call: bench/bench_frontends.py with memory and SASRec, N front ends, each cell's cores busy
# per role (clients, front ends, engine process, engine loop thread), once per client-process
# count, so a client-bound cell shows as one that gains from more client processes.
#   GIT_COMMIT=... OUT=... bash bench/gpu_frontends_roles.sh
# Carried: .gpu/rank, .gpu/whl (bench/gpu_site.sh). Sizes (env): FRONTENDS (4,8),
# CONCURRENCY (128), REPLAY (0,2), CLIENT_PROCS_LIST ("6 12"), CELL_S (3).
# Output: $OUT/frontends_h200_roles_c<P>.json and .log per client-process count P.
set -u
OUT=${OUT:?set OUT to the output folder}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
echo "cores $(nproc)"
for p in ${CLIENT_PROCS_LIST:-6 12}; do
  timeout "${FRONTENDS_TIMEOUT_S:-260}" python3 bench/bench_frontends.py --device cuda \
    --frontends "${FRONTENDS:-4,8}" --concurrency "${CONCURRENCY:-128}" \
    --replay "${REPLAY:-0,2}" --seconds "${CELL_S:-3}" --rounds 1 --client-procs "$p" \
    --systems memory,sasrec --json "$OUT/frontends_h200_roles_c$p.json" \
    >"$OUT/frontends_roles_c$p.log" 2>&1
  echo "client procs $p: exit $?"; grep -E "^round" "$OUT/frontends_roles_c$p.log"
done
