#!/usr/bin/env bash
# One call on a lent 2-GPU machine (nvidia-h200-x2) after bench/gpu_ml1m.sh:
#   GPU 0: the gRPC rank latency benchmark (bench/bench_rank.py, GPU mode) alone on its GPU;
#   GPU 1: the torchrec/fbgemm CUDA probe, the fla chunk_kda check WITHOUT the
#          TRITON_F32_DEFAULT variable (the code now asks for tf32x3 itself), and NoteBank
#          replay on the trained ML-1M model (eval.checkpoint) with the current archive defaults.
# Carried: .gpu/whl (fla-core, einops), .gpu/rank (faiss-cpu, grpcio, protobuf), .gpu/trec
# (torchrec 1.6.1, fbgemm-gpu-cpu 1.6.0 and their pure-Python needs), .gpu/data1m (the ML-1M
# split), .gpu/models/ml1m (recmem train's output from bench/gpu_ml1m.sh), .gpu/src (a
# `git archive HEAD` snapshot to run). Everything lands in $OUT/final.tgz.
set -u
SRC=${SRC:-.}
R=/tmp/final && mkdir -p $R/site $R/trec
python3 -m pip install -q --no-index --no-deps --no-compile --target $R/site .gpu/whl/*.whl .gpu/rank/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target $R/trec .gpu/trec/*.whl || echo "torchrec wheels did not install"
cp -r .gpu/data1m .gpu/models $R/
cd "$SRC"
export PYTHONPATH=$R/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used --format=csv
(
  export CUDA_VISIBLE_DEVICES=1
  PYTHONPATH=$R/trec:$PYTHONPATH python3 bench/gpu_torchrec_probe.py --out $R/probe >$R/probe.log 2>&1
  env -u TRITON_F32_DEFAULT python3 bench/gpu_memory.py --checks-only fla_chunk_kda_delta \
    --out $R/fla-incode >$R/fla-incode.log 2>&1
  python3 -m recmem.cli eval --split $R/data1m/ml1m-split.npz --set eval.checkpoint=$R/models/ml1m \
    --models "${NB_MODELS:-memory-proteus,memory-proteus-notebank,memory-proteus-notebank[archive.replay_notes=1]}" \
    --jobs 3 --out $R/nb >$R/nb.log 2>&1
) &
BG=$!
python3 bench/bench_rank.py ${RANK_ARGS:---device cuda} --json $R/rank_gpu.json >$R/rank.log 2>&1
echo "rank bench exit $?"; tail -n 40 $R/rank.log
wait $BG
for f in probe.log fla-incode.log nb.log; do echo "== $f"; tail -n 12 $R/$f; done
tar czf "$OUT/final.tgz" -C $R --exclude=./site --exclude=./trec --exclude=./data1m --exclude=./models .
ls -la "$OUT"
