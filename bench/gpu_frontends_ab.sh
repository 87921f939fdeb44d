#!/usr/bin/env bash
# Front-end settings A/B on a lent H200 (16 cores), one call: bench/bench_frontends.py with
# memory and SASRec served the same way, once per variant per round, the variants' order
# reversed every other round; each cell records every role's cores busy.
#   GIT_COMMIT=... OUT=... VARIANTS="packed:server.frontend_packed=true rankbatch:server.frontend_packed=false" \
#     bash bench/gpu_frontends_ab.sh
# A variant is NAME:SECTION.FIELD=VALUE[,SECTION.FIELD=VALUE...]. Carried: .gpu/rank,
# .gpu/whl (bench/gpu_site.sh). Sizes (env): ROUNDS (2), FRONTENDS (4,8), CONCURRENCY (128),
# REPLAY (0,2), CLIENT_PROCS (6), CELL_S (3), SYSTEMS (memory,sasrec).
# Output: $OUT/frontends_h200_<name>_r<round>.json and .log.
set -u
OUT=${OUT:?set OUT to the output folder}
VARIANTS=${VARIANTS:?set VARIANTS}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
echo "cores $(nproc)"
read -r -a order <<<"$VARIANTS"
for r in $(seq 1 "${ROUNDS:-2}"); do
  run=("${order[@]}")
  if (( r % 2 == 0 )); then run=(); for ((i=${#order[@]}-1; i>=0; i--)); do run+=("${order[i]}"); done; fi
  for v in "${run[@]}"; do
    name=${v%%:*}; sets=()
    IFS=, read -r -a kv <<<"${v#*:}"
    for x in "${kv[@]}"; do sets+=(--set "$x"); done
    timeout "${FRONTENDS_TIMEOUT_S:-240}" python3 bench/bench_frontends.py --device cuda \
      --frontends "${FRONTENDS:-4,8}" --concurrency "${CONCURRENCY:-128}" \
      --replay "${REPLAY:-0,2}" --seconds "${CELL_S:-3}" --rounds 1 \
      --client-procs "${CLIENT_PROCS:-6}" --systems "${SYSTEMS:-memory,sasrec}" "${sets[@]}" \
      --json "$OUT/frontends_h200_${name}_r$r.json" >"$OUT/frontends_${name}_r$r.log" 2>&1
    echo "round $r $name: exit $?"; grep -E "^round" "$OUT/frontends_${name}_r$r.log"
  done
done
