#!/usr/bin/env bash
# Last call on a lent 2-GPU machine (nvidia-h200-x2):
#   GPU 0: bench/bench_rank.py on CUDA, once with one torch intra-op thread in the server (what
#          `recmem serve` uses by default, server.torch_threads = 1) and once with torch's default;
#   GPU 1: memory-static and memory-proteus on ML-1M again with train.seed = 1 (is Proteus's
#          0.5 % lead over static in reports/ml-1m more than seed noise?), OMP_NUM_THREADS=4 so the
#          rank server's CPU is left alone; and NoteBank replay on the trained ML-1M model
#          (eval.checkpoint) with the current defaults (R = 2, 8 query events re-run) and R = 4.
# Carried: .gpu/whl, .gpu/rank, .gpu/data1m, .gpu/models, .gpu/src (git archive of HEAD).
# Output: $OUT/last.tgz.
set -u
SRC=${SRC:-.}
R=/tmp/last && mkdir -p $R/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $R/site .gpu/whl/*.whl .gpu/rank/*.whl || exit 1
cp -r .gpu/data1m .gpu/models $R/
cd "$SRC"
export PYTHONPATH=$R/site:$PWD PYTHONUNBUFFERED=1
(
  export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=4
  timeout "${SEED_TIMEOUT:-470}" python3 -m recmem.cli eval --split $R/data1m/ml1m-split.npz --jobs 2 \
    --models 'memory-static[train.seed=1],memory-proteus[train.seed=1]' --out $R/seed1 \
    --set train.batch_size=32 --set train.lr=1e-3 --set train.max_seconds="${SEED_MAX_S:-400}" >$R/seed1.log 2>&1
) &
BG=$!
(
  export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=4
  timeout "${SEED_TIMEOUT:-470}" python3 -m recmem.cli eval --split $R/data1m/ml1m-split.npz \
    --set eval.checkpoint=$R/models/ml1m --jobs 2 --out $R/nb \
    --models 'memory-proteus-notebank,memory-proteus-notebank[archive.replay_notes=4]' >$R/nb.log 2>&1
) &
BG2=$!
export CUDA_VISIBLE_DEVICES=0
python3 bench/bench_rank.py --device cuda --threads 1 --budget-s "${RANK_S:-110}" --json $R/rank_gpu.json >$R/rank.log 2>&1
echo "rank (1 thread) exit $?"; tail -n 22 $R/rank.log
python3 bench/bench_rank.py --device cuda --threads 0 --budget-s "${RANK_S:-110}" --json $R/rank_gpu_threads_default.json >$R/rank2.log 2>&1
echo "rank (torch default threads) exit $?"; tail -n 22 $R/rank2.log
wait $BG $BG2
tail -n 8 $R/seed1.log $R/nb.log
tar czf "$OUT/last.tgz" -C $R --exclude=./site --exclude=./data1m --exclude=./models .
ls -la "$OUT"
