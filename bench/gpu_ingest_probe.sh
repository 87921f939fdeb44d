#!/usr/bin/env bash
# Where the host's ingest stops, in one detached run on a lent H200 (bench/gpu_detached.sh):
#   GIT_COMMIT=... OLD=.gpu/old OLD_COMMIT=... OUT=... bash bench/gpu_ingest_probe.sh
# 0. with .gpu/test (pytest wheels) carried: $GPU_TESTS (the engine loop's and CUDA graphs' tests);
# 1. bench/broker_fanout.py: what the embedded broker serves to 1 / 4 / 16 raw readers per
#    client (the ceiling the members ingest under; FANOUT_EVENTS=0 skips it);
# 1b. with $APPLY_VARIANTS: bench/engine_apply.py (the engine's step alone, one process, the
#    first APPLY_EVENTS (1,000,000) events) with those variants;
# 2. bench/gpu_host_ab.sh twice, old tree then new and new then old (8 kafka-python
#    members, ingest only): the A/B of a change to the engine, in one call;
# 3. bench/gpu_host_variants.sh on the new tree with $VARIANTS (ingest only; each run
#    records the GPU's utilization over its 10-90 % window).
# Carried: .gpu/rank, .gpu/whl, .gpu/bin (bench/gpu_site.sh), OLD (a git archive of the old
# commit's bench configs models offline_eval proto pyproject.toml recmem streams tests).
# Sizes (env): EVENTS (2,000,000 of the workload), FANOUT_EVENTS (1,000,000), RUN_S (200: the
# bound of each host_members run). Output under $OUT: broker_fanout_h200.json,
# ab1/ and ab2/ (host_members_h200_{old,new}.json), host_members_h200_<variant>.json, logs.
set -u
OUT=${OUT:?set OUT to the output folder}
. bench/gpu_site.sh || exit 1
export PYTHONUNBUFFERED=1 TMPDIR=${TMPDIR:-/dev/shm} GIT_COMMIT=${GIT_COMMIT:-unknown}
EVENTS=${EVENTS:-2000000}
if [ -d .gpu/test ]; then  # the GPU tests first (pytest wheels carried in .gpu/test)
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/test/*.whl
  PYTHONPATH=$S:$PWD timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider \
    ${GPU_TESTS:-tests/recmem/test_engine_loop.py tests/models/test_graphs.py} >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -n 5 "$OUT/gpu_tests.log"
fi
if [ "${FANOUT_EVENTS:-1000000}" != 0 ]; then
  PYTHONPATH=$S:$PWD timeout -s INT -k 20 300 python3 bench/broker_fanout.py \
    --events "${FANOUT_EVENTS:-1000000}" --procs 1,4,16 --set kafka.broker_bin_dir=.gpu/bin \
    --json "$OUT/broker_fanout_h200.json" >"$OUT/fanout.log" 2>&1
  echo "fanout: exit $?"; tail -n 8 "$OUT/fanout.log"
fi
if [ -n "${APPLY_VARIANTS:-}" ]; then
  vs=(); for v in $APPLY_VARIANTS; do vs+=(--variant "$v"); done
  PYTHONPATH=$S:$PWD timeout -s INT -k 20 300 python3 bench/engine_apply.py --device cuda \
    --events "${APPLY_EVENTS:-1000000}" --budget-s 20 "${vs[@]}" \
    --json "$OUT/engine_apply_h200.json" >"$OUT/engine_apply.log" 2>&1
  echo "engine_apply: exit $?"; tail -n 8 "$OUT/engine_apply.log"
fi
if [ -n "${OLD:-}" ]; then
  for r in "ab1 old-new" "ab2 new-old"; do
    set -- $r; mkdir -p "$OUT/$1"
    OUT=$OUT/$1 ORDER=$2 MEMBERS=8 EVENTS=$EVENTS RANK_S=0 TREE_S=${RUN_S:-200} \
      bash bench/gpu_host_ab.sh
  done
fi
if [ -n "${VARIANTS:-}" ]; then
  EVENTS=$EVENTS RANK_S=0 VARIANT_S=${RUN_S:-200} bash bench/gpu_host_variants.sh
fi
