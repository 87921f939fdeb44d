#!/usr/bin/env bash
# The batched archive route computed on the rank device (CUDA, torch) against the numpy
# route of the tree in .gpu/old (a `git archive` of the commit before), on a lent H200, in
# one detached run (bench/gpu_detached.sh):
#   bash bench/gpu_detached.sh start 'bash bench/experiments/gpu_route_device.sh'
#   bash bench/gpu_detached.sh wait 560
# 1. the route tests on CUDA (tests/recmem/test_archive_bank.py, test_archive_routing.py);
# 2. engine CPU per RankBatch request, both trees alternating, answers compared
#    (bench/experiments/rankbatch_engine.py);
# 3. the Ranker's per-step split at B = 32, 64 and R = 2, each tree (bench/profile_rank.py);
# 4. 8 front ends, closed loop at c = 64 and 128, R = 2, trees in the order old new new old
#    (bench/bench_frontends.py, memory only, server.max_batch = 64 as
#    frontends_h200_window_default.json).
# Carried: .gpu/rank (with pytest), .gpu/whl, .gpu/old.
set -u
OUT=${OUT:?set OUT}
. bench/gpu_site.sh || exit 1
NEW=$PWD OLD=$PWD/.gpu/old
export PYTHONUNBUFFERED=1
export PYTHONPATH=$S:$NEW
python3 -m pytest -q -p no:cacheprovider tests/recmem/test_archive_bank.py \
  tests/recmem/test_archive_routing.py >"$OUT/tests_cuda.log" 2>&1
echo "tests: exit $? $(tail -n 1 "$OUT/tests_cuda.log")"
timeout 200 python3 bench/experiments/rankbatch_engine.py --device cuda --root old="$OLD" \
  --path rankbatch --batch 64 --replay 0,2 --seconds 3 --rounds 2 \
  --json "$OUT/rankbatch_engine_h200_route_device.json" >"$OUT/rankbatch.log" 2>&1
echo "rankbatch_engine: exit $?"
for t in new old; do
  root=$NEW; [ "$t" = old ] && root=$OLD
  (cd "$root" && PYTHONPATH=$S:$root timeout 150 python3 bench/profile_rank.py --device cuda \
    --threads 1 --batches 32,64 --replay 2 --calls 30 --tag "_route_device_$t" --out "$OUT" \
    >"$OUT/profile_$t.log" 2>&1)
  echo "profile_rank $t: exit $?"; grep "B=" "$OUT/profile_$t.log"
done
i=0
for t in old new new old; do
  i=$((i + 1)); root=$NEW; [ "$t" = old ] && root=$OLD
  (cd "$root" && PYTHONPATH=$S:$root timeout 240 python3 bench/bench_frontends.py \
    --device cuda --frontends 8 --concurrency 64,128 --replay 2 --seconds 3 --rounds 1 \
    --client-procs 6 --systems memory --set server.max_batch=64 \
    --json "$OUT/frontends_h200_route_${t}_$i.json" >"$OUT/frontends_${t}_$i.log" 2>&1)
  echo "frontends $t $i: exit $?"; tail -n 6 "$OUT/frontends_${t}_$i.log"
done
