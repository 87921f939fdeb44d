#!/usr/bin/env bash
# The dataset suite on one lent H200 (issue 10): every model of a plan trained and evaluated
# at once (small models are launch-bound, so many share the GPU), detached so that the work
# can outlive one 10-minute device call:
#   bash bench/gpu_suite.sh start PLAN      # unpack wheels, copy the tree, start PLAN
#   bash bench/gpu_suite.sh wait SECONDS    # wait (same or next call), pack $OUT/results.tgz
# Carry .gpu/whl (fla-core, einops), .gpu/rank (faiss-cpu, grpcio, protobuf, kafka-python,
# prometheus-client, tqdm), .gpu/data (splits: recmem eval --dataset D --prepare-split
# .gpu/data/D-split.npz) and .gpu/src (git archive HEAD | tar -x -C .gpu/src). Set GIT_COMMIT.
#
# Plans (every run passes only the seed; the recipe is the default):
#   smoke   ML-1M, SASRec and two memory heads for MAX_S (120) seconds each
#   sweep   head variants (hybrid x request time) and SASRec on every split, seed 0
#   final   the suite comparison, 3 seeds on ML-1M and ML-100K, the bytes curve on ML-1M
set -u
W=/tmp/recmem-suite
SPLITS=$W/data

run_eval() {  # run_eval NAME SPLIT JOBS MODELS [extra args]: one recmem eval in the background
  local name=$1 split=$2 jobs=$3 models=$4
  shift 4
  python3 -m recmem.cli eval --split "$SPLITS/$split-split.npz" --models "$models" \
    --jobs "$jobs" --out "$W/out/$name" "$@" >"$W/logs/$name.log" 2>&1 &
  PIDS+=($!)
}

plan_sweep() {
  local heads='sasrec,memory-proteus[model.hybrid=none;model.request_time=none],memory-proteus[model.hybrid=mac;model.request_time=gap_clock],memory-proteus[model.hybrid=mag;model.request_time=gap_clock],memory-proteus[model.hybrid=mac;model.request_time=gap],memory-proteus[model.hybrid=mac;model.request_time=none],memory-proteus[model.hybrid=none;model.request_time=gap_clock]'
  local cap=(--set train.max_seconds="${MAX_S:-420}")
  for d in $SWEEP_SETS; do
    run_eval "sweep-$d" "$d" 7 "pop,$heads" "${cap[@]}"
  done
}

plan_smoke() {  # the CUDA paths and training speed, before a long plan
  run_eval smoke-ml-1m ml-1m 4 'sasrec,memory-proteus[model.hybrid=mac;model.request_time=gap_clock],memory-proteus[model.hybrid=mac;model.request_time=gap_clock;train.cuda_graphs=false],memory-proteus[model.hybrid=none;model.request_time=none]' \
    --set train.max_seconds="${MAX_S:-120}"
}

plan_final() {
  local cap=(--set train.max_seconds="${MAX_S:-900}")
  for d in $FINAL_SETS; do
    run_eval "final-$d" "$d" 4 "pop,sasrec,memory-static,memory-proteus" "${cap[@]}"
  done
}

case "${1:-}" in
start)
  plan=${2:?plan}
  rm -rf $W && mkdir -p $W/site $W/out $W/logs $W/data
  python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site \
    .gpu/whl/*.whl .gpu/rank/*.whl || exit 1
  cp .gpu/data/* $W/data/ || exit 1
  mkdir -p $W/src && cp -r .gpu/src/. $W/src/
  cd $W/src && setsid nohup bash bench/gpu_suite.sh run "$plan" >$W/driver.log 2>&1 </dev/null &
  sleep 30; cat $W/driver.log; tail -n 2 $W/logs/*.log
  nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv
  ;;
run)
  export PYTHONPATH=$W/site:$W/src PYTHONUNBUFFERED=1
  cd $W/src
  date -u +%FT%TZ >$W/started
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 20 >$W/smi.csv &
  SMI=$!
  PIDS=()
  "plan_$2"
  wait "${PIDS[@]}"
  kill $SMI
  date -u +%FT%TZ >$W/DONE
  ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ ! -f $W/DONE ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  for f in $W/logs/*.log; do echo "== $f"; tr '\r' '\n' <"$f" | grep -E "INFO|Error|error" | tail -n 4; done
  tail -n 3 $W/smi.csv
  [ -f $W/DONE ] && echo "ALL DONE" || echo "STILL RUNNING"
  tar czf "$OUT/results.tgz" -C $W --exclude=./src --exclude=./site --exclude=./data \
    --exclude='split.npz' . && ls -la "$OUT"
  ;;
*)
  echo "usage: bench/gpu_suite.sh start PLAN | wait [SECONDS]" >&2; exit 2
  ;;
esac
