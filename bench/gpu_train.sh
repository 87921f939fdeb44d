#!/usr/bin/env bash
# Training throughput on one lent GPU (bench/bench_train.py): SASRec and the memory model on
# every training path, each fused path first checked against the eager chunked form.
#   bash bench/gpu_train.sh [SPLIT] [more bench_train.py arguments]
# Carry .gpu/whl (fla-core, einops) and .gpu/data (the splits); a tqdm wheel in .gpu/rank is
# used when present (the bench runs without it). Set GIT_COMMIT. Writes $OUT/train_gpu.json
# and $OUT/train_gpu.log; about 3 minutes on an H200 (--budget-s bounds it).
set -u
S=/tmp/recmem-train-site
WHEELS=(.gpu/whl/*.whl)
TQDM=(.gpu/rank/tqdm-*.whl)
[ -e "${TQDM[0]}" ] && WHEELS+=("${TQDM[@]}")
python3 -m pip install -q --no-index --no-deps --no-compile --target $S "${WHEELS[@]}" || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench/bench_train.py --split "${1:-.gpu/data/ml-1m-split.npz}" --device cuda \
  --json "$OUT/train_gpu.json" "${@:2}" 2>&1 | tee "$OUT/train_gpu.log"
