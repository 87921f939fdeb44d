#!/usr/bin/env bash
# The batched archive route on the rank device (`archive.route_device = rank`: CUDA, torch)
# against the same torch route on the CPU (the default) and against the numpy route of the
# tree in .gpu/old (a `git archive` of de12611, before the torch route), on a lent H200, in
# one detached run (bench/gpu_detached.sh):
#   bash bench/gpu_detached.sh start 'GIT_COMMIT=<sha> EVENTS="100 300 1000" bash bench/experiments/gpu_route_device.sh'
# (the commit written literally: the device's copy of .git may be stale)
#   bash bench/gpu_detached.sh wait 560
# 1. the route tests on CUDA (tests/recmem/test_archive_bank.py, test_archive_routing.py);
# 2. per EVENTS (mean events per user: more notes per user), engine CPU per RankBatch request
#    at B = 64, R = 2 for old / new (route on the CPU) / gpu (route on the rank device),
#    alternating, answers compared (bench/experiments/rankbatch_engine.py);
# 3. per EVENTS, the Ranker's per-step split at B = 64, R = 2 for each (bench/profile_rank.py);
# 4. with FRONTENDS=1: 8 front ends, closed loop at c = 64 and 128, R = 2, in the order
#    old gpu gpu old (bench/bench_frontends.py, memory only, server.max_batch = 64).
# Carried: .gpu/rank (with pytest), .gpu/whl, .gpu/old.
set -u
OUT=${OUT:?set OUT}
. bench/gpu_site.sh || exit 1
NEW=$PWD OLD=$PWD/.gpu/old GPU_SET=archive.route_device=rank
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
export PYTHONPATH=$S:$NEW
python3 -m pytest -q -p no:cacheprovider tests/recmem/test_archive_bank.py \
  tests/recmem/test_archive_routing.py >"$OUT/tests_cuda.log" 2>&1
echo "tests: exit $? $(tail -n 1 "$OUT/tests_cuda.log")"
for e in ${EVENTS:-300}; do
  timeout 300 python3 bench/experiments/rankbatch_engine.py --device cuda --root old="$OLD" \
    --root gpu="$NEW" --tree-set gpu:$GPU_SET --path rankbatch --batch 64 --replay 2 \
    --events "$e" --seconds 3 --rounds 2 \
    --json "$OUT/rankbatch_engine_h200_route_device_e$e.json" >"$OUT/rankbatch_e$e.log" 2>&1
  echo "rankbatch_engine events $e: exit $?"
  for t in old new gpu; do
    root=$NEW sets=(); [ "$t" = old ] && root=$OLD; [ "$t" = gpu ] && sets=(--set $GPU_SET)
    (cd "$root" && PYTHONPATH=$S:$root timeout 200 python3 bench/profile_rank.py --device cuda \
      --threads 1 --events "$e" --batches 64 --replay 2 --calls 40 "${sets[@]}" \
      --tag "_route_device_${t}_e$e" --out "$OUT" >"$OUT/profile_${t}_e$e.log" 2>&1)
    echo "profile_rank $t events $e: exit $? $(grep 'B=' "$OUT/profile_${t}_e$e.log")"
  done
done
[ "${FRONTENDS:-0}" = 1 ] || exit 0
i=0
for t in old gpu gpu old; do
  i=$((i + 1)) root=$NEW sets=(); [ "$t" = old ] && root=$OLD; [ "$t" = gpu ] && sets=(--set $GPU_SET)
  (cd "$root" && PYTHONPATH=$S:$root timeout 240 python3 bench/bench_frontends.py \
    --device cuda --frontends 8 --concurrency 64,128 --replay 2 --seconds 3 --rounds 1 \
    --client-procs 6 --systems memory --set server.max_batch=64 "${sets[@]}" \
    --json "$OUT/frontends_h200_route_${t}_$i.json" >"$OUT/frontends_${t}_$i.log" 2>&1)
  echo "frontends $t $i: exit $?"; tail -n 4 "$OUT/frontends_${t}_$i.log"
done
