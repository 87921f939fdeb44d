#!/usr/bin/env bash
# engine_apply.py in an old tree and a new one, alternating on this machine (old first in
# odd rounds, new first in even ones), each round under the benchmark lock; JSON per run.
# Usage: bench/experiments/engine_apply_ab.sh OLD_TREE NEW_TREE OUT_DIR [ROUNDS] [ENGINE_APPLY ARGS...]
# Trees are `git archive` copies with .venv linked; set OLD_COMMIT / NEW_COMMIT to record them.
set -euo pipefail
old=$1; new=$2; out=$3; rounds=${4:-3}; shift 4 || shift $#
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--device cpu --events 100000 --budget-s 40 --variant default: --variant no-archive:archive=off)
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  sides="old new"; [ $((i % 2)) -eq 0 ] && sides="new old"
  for side in $sides; do
    tree=$old; commit=${OLD_COMMIT:-}
    if [ "$side" = new ]; then tree=$new; commit=${NEW_COMMIT:-}; fi
    (cd "$tree" && GIT_COMMIT=$commit PYTHONPATH=$tree flock /tmp/recmem-bench.lock \
      .venv/bin/python bench/engine_apply.py "${args[@]}" --json "$out/engine_apply_ab_${side}_r$i.json" \
      > "$out/engine_apply_ab_${side}_r$i.log" 2>&1)
  done
done
