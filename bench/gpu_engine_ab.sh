#!/usr/bin/env bash
# bench/engine_apply.py in an old source tree and in this one, alternating, on a lent H200
# (one call; the old tree is a `git archive` of the old commit's recmem, streams, models,
# offline_eval, proto and bench/{engine_apply,benchinfo}.py, carried as OLD):
#   OLD=.gpu/old OLD_COMMIT=... GIT_COMMIT=... OUT=... bash bench/gpu_engine_ab.sh
# Sizes (env): EVENTS (1,000,000 of the workload), BUDGET (30 s per variant), ROUNDS (2),
# VARIANTS ("default: no-archive:archive=off").
# Output: $OUT/engine_apply_h200_{old,new}_rN.json.
set -u
OUT=${OUT:?set OUT to the output folder}
OLD=${OLD:?set OLD to the old tree}
. bench/gpu_site.sh || exit 1
export PYTHONUNBUFFERED=1
variants=()
for v in ${VARIANTS:-default: no-archive:archive=off}; do variants+=(--variant "$v"); done
run() {  # run TREE COMMIT TAG
  (cd "$1" && PYTHONPATH=$S:$PWD GIT_COMMIT=$2 python3 bench/engine_apply.py \
    --events "${EVENTS:-1000000}" --budget-s "${BUDGET:-30}" --device cuda "${variants[@]}" \
    --json "$OUT/engine_apply_h200_$3.json" >"$OUT/engine_apply_$3.log" 2>&1)
  echo "$3: exit $?"; grep -E 'events/s' "$OUT/engine_apply_$3.log"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  if [ $((r % 2)) = 1 ]; then
    run "$OLD" "${OLD_COMMIT:-old}" "old_r$r"; run "$PWD" "${GIT_COMMIT:-new}" "new_r$r"
  else
    run "$PWD" "${GIT_COMMIT:-new}" "new_r$r"; run "$OLD" "${OLD_COMMIT:-old}" "old_r$r"
  fi
done
