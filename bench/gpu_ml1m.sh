#!/usr/bin/env bash
# ML-1M on a lent GPU machine (2 GPUs, nvidia-h200-x2): the model comparison of issue 3/5,
# the E/N ablation, `recmem train` for issue 2's metrics.json, and the fla chunk_kda
# fp32 re-check, all at once (the trainings are launch-bound, so several share a GPU).
#
# The work outlives one device call (10 minutes at most), so it runs detached:
#   bash bench/gpu_ml1m.sh start            # first call: unpack wheels, copy the tree, start
#   bash bench/gpu_ml1m.sh wait SECONDS     # same or next call: wait, then pack $OUT/results.tgz
# Needs the prepared split (recmem eval --dataset ml-1m --prepare-split .gpu/data/ml1m-split.npz)
# the fla-core + einops wheels in .gpu/whl and faiss-cpu, grpcio, protobuf in .gpu/rank
# (carried: .gpu/data, .gpu/whl, .gpu/rank).
set -u
W=/tmp/recmem-ml1m
SPLIT=$W/ml1m-split.npz
COMMON=(--set train.batch_size=32 --set train.lr=1e-3 --set train.max_seconds="${MAX_S:-720}")
COMPARISON='pop,sasrec[train.batch_size=128],memory-static,memory-proteus,memory-proteus-notebank'
ABLATION='memory-proteus[memory.n_blocks=2],memory-proteus[memory.n_blocks=4],memory-proteus[memory.n_blocks=8],memory-proteus[memory.n_blocks=32],memory-proteus[memory.horizon=64],memory-proteus[memory.horizon=1024]'

case "${1:-}" in
start)
  mkdir -p $W/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .gpu/whl/*.whl .gpu/rank/*.whl || exit 1
  cp .gpu/data/ml1m-split.npz .gpu/data/ml1m-split.json $W/ || exit 1
  # run from a copy (SRC: e.g. a `git archive HEAD` snapshot): later calls replace the tree here
  rm -rf $W/src && mkdir -p $W/src && cp -r "${SRC:-.}"/. $W/src/
  cd $W/src && setsid nohup bash bench/gpu_ml1m.sh run >$W/driver.log 2>&1 </dev/null &
  sleep 20; cat $W/driver.log; nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used --format=csv
  ;;
run)
  export PYTHONPATH=$W/site:$W/src PYTHONUNBUFFERED=1
  cd $W/src
  date -u +%FT%TZ >$W/started
  python3 -c 'import torch; print("GPUs:", torch.cuda.device_count())'
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 20 >$W/smi.csv &
  SMI=$!
  pids=()
  (for mode in ieee tf32x3; do
     CUDA_VISIBLE_DEVICES=1 TRITON_F32_DEFAULT=$mode python3 bench/gpu_memory.py \
       --checks-only fla_chunk_kda_delta,fla_fused_recurrent_delta --out $W/fla-$mode >$W/fla-$mode.log 2>&1
   done) &
  pids+=($!)
  python3 -m recmem.cli eval --split "$SPLIT" --models "$COMPARISON" --jobs 3 --out $W/ml-1m \
    "${COMMON[@]}" >$W/comparison.log 2>&1 &
  pids+=($!)
  python3 -m recmem.cli eval --split "$SPLIT" --models "$ABLATION" --jobs 6 --out $W/ablation \
    "${COMMON[@]}" >$W/ablation.log 2>&1 &
  pids+=($!)
  CUDA_VISIBLE_DEVICES=1 python3 -m recmem.cli train --config configs/ml-1m-gpu.toml \
    --split "$SPLIT" --out $W/train "${COMMON[@]}" >$W/train.log 2>&1 &
  pids+=($!)
  wait "${pids[@]}"
  kill $SMI
  date -u +%FT%TZ >$W/DONE
  ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ ! -f $W/DONE ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  ls $W; tail -n 3 $W/*.log; tail -n 4 $W/smi.csv
  [ -f $W/DONE ] && echo "ALL DONE" || echo "STILL RUNNING"
  tar czf "$OUT/results.tgz" -C $W --exclude=./src --exclude=./site --exclude='*split*' . && ls -la "$OUT"
  ;;
*)
  echo "usage: bench/gpu_ml1m.sh start | wait [SECONDS]" >&2; exit 2
  ;;
esac
