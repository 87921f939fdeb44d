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
# Plans (every run passes only the seed, plus the switch of the mechanism it measures; the
# recipe is the default):
#   smoke   ML-1M: SASRec and two memory heads for MAX_S (120) seconds each
#   final   the suite: the default memory model with 3 seeds on ML-1M and ML-100K; SASRec,
#           pop, MAG and the ablations (no request time, gap only, no hybrid) with seed 0;
#           the bytes curve on ML-1M; pop, SASRec, MAC and MAG on each of OTHER_SETS
#   smoke12  issue 12's mechanisms on ML-100K for MAX_S (60) seconds each: their CUDA paths
#            (about 4 minutes; run it first, then issue12)
#   notebank issue 12, NoteBank replay, 3 seeds: ML-1M: the default model trained once per
#            seed (recmem train), then on those weights, each in its own process: replay off,
#            today's replay, the gate fusion (replay off and on), lexical, candidate-aware
#            and learned routing; ML-100K: the same plus the low-rank fusion and joint
#            training, one worker per seed
#   proteus  issue 12, Proteus schedules, 3 seeds: static, surprise, drift, narrow, random
#            block order on ML-1M (uniform is the notebank plan's base), and with uniform
#            and reverse order on ML-100K
#   reg      the regularisation grid of the default recipe, seed 0: dropout 0.2 and 0.3,
#            weight decay 0.1, a slower learning-rate decay (decay_patience 4) and dropout 0.2
#            with it, on synthetic, ML-100K and ML-1M (the default too on ML-100K)
#   recipe   the suite again after the grid's pick became the default recipe: the memory
#            model with 3 seeds and SASRec with seed 0 on ML-1M, ML-100K and synthetic, the
#            memory model on completejourney (pop does not train: the final plan's stands)
#   readout  model.readout = identity (the read-out head's last linear map removed), 3 seeds
#            on ML-1M, ML-100K and synthetic, and seed 0 on completejourney with SASRec
#            under the current recipe (the linear read-out's runs are the recipe plan's)
#   lossweight  train.loss_weight = target (every target the same weight across steps), 3
#            seeds on ML-1M, ML-100K and synthetic, seed 0 on completejourney, against the
#            readout plan's runs of the default (step)
#   fastsuite  the suite on the fused training path (the defaults since 2026-12-01): the
#            default model and train.loss_weight = target side by side, 3 seeds on ML-1M,
#            ML-100K and synthetic, seed 0 on completejourney; with issue 12's Proteus
#            controls on the new default: static (E = 1) on ML-1M and every schedule on
#            ML-100K, 3 seeds
#   fastsuite2  ML-1M (3 seeds) and completejourney (seed 0) again with both loss weights and
#            fewer trainings at once (8), so that they reach their early stop (in fastsuite
#            30 trainings shared the GPU and ML-1M's stopped at the guard)
#   narrow   issue 12's narrow schedule on ML-100K against uniform, 3 seeds, on the fused
#            path (it could not run there before cb880fa)
#   round3   the default against SASRec, seed 0, trained equally long: ML-1M to both early
#            stops and completejourney (4 at once); then drift against static on ML-1M, 3 seeds
#   round3b  ML-1M: the default with seeds 1 and 2 and narrow with 3 seeds (round3 has static)
#   staticsuite  static against uniform on ML-100K, synthetic (3 seeds) and completejourney
#   final12  staticsuite and NoteBank replay on today's default (ML-1M and ML-100K, 3 seeds)
#   issue12  notebank and proteus at once (docs/archive.md and docs/memory.md, "How to run
#            the ablation"); trainings stop at MAX_S (600) seconds
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

MAC='memory-proteus'  # the default: model.hybrid = mac, model.request_time = gap_clock
MAG='memory-proteus[model.hybrid=mag]'
NO_TIME='memory-proteus[model.request_time=none]'
GAP_ONLY='memory-proteus[model.request_time=gap]'
NO_HYBRID='memory-proteus[model.hybrid=none]'
SMALL='memory-proteus[memory.n_heads=4;memory.key_dim=16;memory.value_dim=16]'
LARGE='memory-proteus[memory.n_heads=4;memory.key_dim=64;memory.value_dim=64]'

run_train() {  # run_train NAME SPLIT SEED [extra args]: one recmem train, in the foreground
  local name=$1 split=$2 seed=$3
  shift 3
  python3 -m recmem.cli train --dataset "split:$SPLITS/$split-split.npz" --out "$W/out/$name" \
    --set train.seed="$seed" "$@" >"$W/logs/$name.log" 2>&1
}

pack() {  # pack NAME GLOB...: the evaluations whose folders match go back in $OUT/NAME.tgz
  echo "$*" >>$W/packs
}

# issue 12: NoteBank replay. The fusion trains for REPLAY_STEPS steps after the base training
# with the base frozen (train.replay_freeze, the default), so replay off is the base model.
G="model.replay_fusion=gate;train.replay_steps=${REPLAY_STEPS:-200}"
LOWRANK="model.replay_fusion=lowrank;train.replay_steps=${REPLAY_STEPS:-200}"
NB_CORE="memory-proteus,memory-proteus-notebank,memory-proteus[$G],memory-proteus-notebank[$G]"
NB_ROUTES=(
  "memory-proteus-notebank[$G;archive.routing=lexical]"
  "memory-proteus-notebank[$G;archive.routing=candidates]"
  "memory-proteus-notebank[$G;model.route_dim=32]"
)
NB_EXTRA="memory-proteus-notebank[$LOWRANK],memory-proteus[$G;train.replay_freeze=false]"
NB_EXTRA="$NB_EXTRA,memory-proteus-notebank[$G;train.replay_freeze=false]"
# issue 12: Proteus schedules (uniform is the default model)
PR_1M="memory-proteus[memory.n_blocks=1],memory-proteus[memory.unlock=surprise]"
PR_1M="$PR_1M,memory-proteus[memory.unlock=drift],memory-proteus[memory.unlock=narrow]"
PR_1M="$PR_1M,memory-proteus[memory.block_order=random]"
PR_100K="memory-proteus,$PR_1M,memory-proteus[memory.block_order=reverse]"

nb_ml1m_seed() {  # nb_ml1m_seed SEED [extra]: the base of one seed, then each variant on it
  local s=$1
  shift
  run_train "base-ml-1m-s$s" ml-1m "$s" "$@" || return 1
  local ck=(--set eval.checkpoint="$W/out/base-ml-1m-s$s" --set train.seed="$s")
  PIDS=()
  run_eval "nb-ml-1m-s$s-core" ml-1m 1 "$NB_CORE" "${ck[@]}"
  local i=0 m
  for m in "${NB_ROUTES[@]}"; do
    run_eval "nb-ml-1m-s$s-route$i" ml-1m 1 "$m" "${ck[@]}"
    i=$((i + 1))
  done
  wait "${PIDS[@]}"
}

plan_notebank() {
  local cap=(--set train.max_seconds="${MAX_S:-600}") s
  for s in 0 1 2; do
    nb_ml1m_seed "$s" "${cap[@]}" &
    PIDS+=($!)
    pack "nb-ml-1m-s$s" "base-ml-1m-s$s" "nb-ml-1m-s$s-*"
  done
  local routes
  routes=$(IFS=,; echo "${NB_ROUTES[*]}")
  run_eval nb-ml-100k ml-100k 3 "$NB_CORE,$routes,$NB_EXTRA" --seeds 0,1,2 "${cap[@]}"
  pack ml-100k "*ml-100k*"
}

plan_proteus() {
  local cap=(--set train.max_seconds="${MAX_S:-600}")
  run_eval pr-ml-1m ml-1m "${PR_JOBS:-15}" "$PR_1M" --seeds 0,1,2 "${cap[@]}"
  run_eval pr-ml-100k ml-100k 7 "$PR_100K" --seeds 0,1,2 "${cap[@]}"
  pack pr-ml-1m pr-ml-1m
  pack ml-100k "*ml-100k*"
}

plan_issue12() {
  plan_notebank
  plan_proteus
}

plan_smoke12() {  # every new mechanism once on ML-100K, briefly (REPLAY_STEPS=20): CUDA paths
  local cap=(--set train.max_seconds="${MAX_S:-60}") routes
  routes=$(IFS=,; echo "${NB_ROUTES[*]}")
  run_eval smoke12-nb ml-100k 1 "$NB_CORE,$routes,$NB_EXTRA" "${cap[@]}"
  run_eval smoke12-pr ml-100k 6 "$PR_100K" "${cap[@]}"
}

plan_smoke() {  # the CUDA paths and training speed, before a long plan
  run_eval smoke-ml-1m ml-1m 4 "sasrec,$MAC,$NO_HYBRID" --set train.max_seconds="${MAX_S:-120}"
}

plan_seeds02() {  # ML-1M seeds 0 and 2 of the default model again (out of memory in "final")
  run_eval ml-1m-seeds02 ml-1m 2 "$MAC" --seeds 0,2 --set train.max_seconds="${MAX_S:-780}"
}

REG=(
  "memory-proteus[model.dropout=0.2]"
  "memory-proteus[model.dropout=0.3]"
  "memory-proteus[train.weight_decay=0.1]"
  "memory-proteus[train.decay_patience=4]"
  "memory-proteus[model.dropout=0.2;train.decay_patience=4]"
)

plan_reg() {  # the recipe's regularisation, seed 0 (ML-1M's default is in the final plan)
  local cap=(--set train.max_seconds="${MAX_S:-600}") grid
  grid=$(IFS=,; echo "${REG[*]}")
  run_eval reg-ml-1m ml-1m 5 "$grid" "${cap[@]}"
  run_eval reg-ml-100k ml-100k 6 "$MAC,$grid" "${cap[@]}"
  run_eval reg-synthetic synthetic 5 "$grid" "${cap[@]}"
}

plan_recipe() {  # the default recipe (after the grid), every trained model of the suite
  local cap=(--set train.max_seconds="${MAX_S:-600}") d
  for d in ml-1m ml-100k synthetic; do
    run_eval "recipe-$d-mem" "$d" 3 "$MAC" --seeds 0,1,2 "${cap[@]}"
    run_eval "recipe-$d-sasrec" "$d" 1 sasrec "${cap[@]}"
  done
  run_eval recipe-completejourney-mem completejourney 1 "$MAC" "${cap[@]}"
}

suite_variant() {  # suite_variant NAME SPEC [BESIDE]: SPEC with 3 seeds on ML-1M, ML-100K and
  # synthetic, seed 0 on completejourney (with the models BESIDE it, comma-separated)
  local name=$1 spec=$2 beside=${3:-} d
  local cap=(--set train.max_seconds="${MAX_S:-600}")
  for d in ml-1m ml-100k synthetic; do
    run_eval "$name-$d" "$d" 3 "$spec" --seeds 0,1,2 "${cap[@]}"
  done
  local jobs=1
  [ -n "$beside" ] && jobs=2
  run_eval "$name-completejourney" completejourney "$jobs" "${beside:+$beside,}$spec" "${cap[@]}"
}

plan_readout() {  # the read-out head without its last linear map, against the recipe plan
  suite_variant readout 'memory-proteus[model.readout=identity]' sasrec
}

plan_lossweight() {  # each target the same weight across optimizer steps, the suite again
  suite_variant lossweight 'memory-proteus[train.loss_weight=target]'
}

plan_fastsuite() {  # the default and the target loss weight, in one run on the fused path
  local cap=(--set train.max_seconds="${MAX_S:-600}") d
  local both="$MAC,memory-proteus[train.loss_weight=target]"
  for d in ml-1m ml-100k synthetic; do
    run_eval "fs-$d" "$d" 6 "$both" --seeds 0,1,2 "${cap[@]}"
    pack "fs-$d" "fs-$d"
  done
  run_eval fs-completejourney completejourney 2 "$both" "${cap[@]}"
  pack fs-completejourney fs-completejourney
  run_eval pr-ml-1m-static ml-1m 3 'memory-proteus[memory.n_blocks=1]' --seeds 0,1,2 "${cap[@]}"
  pack pr-ml-1m-static pr-ml-1m-static
  run_eval pr-ml-100k ml-100k 7 "$PR_100K" --seeds 0,1,2 "${cap[@]}"
  pack pr-ml-100k pr-ml-100k
}

plan_fastsuite2() {  # fastsuite's ML-1M and completejourney, 8 trainings at once
  local cap=(--set train.max_seconds="${MAX_S:-600}")
  local both="$MAC,memory-proteus[train.loss_weight=target]"
  run_eval fs2-ml-1m ml-1m 6 "$both" --seeds 0,1,2 "${cap[@]}"
  run_eval fs2-completejourney completejourney 2 "$both" "${cap[@]}"
}

plan_narrow() {  # narrow against uniform on ML-100K, 3 seeds
  run_eval narrow-ml-100k ml-100k 6 'memory-proteus,memory-proteus[memory.unlock=narrow]' \
    --seeds 0,1,2 --set train.max_seconds="${MAX_S:-600}"
}

plan_round3() {  # the default against SASRec trained equally long (seed 0): ML-1M to both
  # early stops (their time to it) and completejourney, 4 trainings at once; when ML-1M's pair
  # is done, issue 12's best schedule (drift) against static on ML-1M, 3 seeds, with the
  # guard's remaining time
  local t0 cap=(--set train.max_seconds="${MAX_S:-1000}")
  t0=$(date +%s)
  run_eval r3-ml-1m ml-1m 2 "sasrec,$MAC" "${cap[@]}"
  local pair=${PIDS[-1]}
  run_eval r3-completejourney completejourney 2 "sasrec,$MAC" "${cap[@]}"
  pack r3-ml-1m r3-ml-1m
  pack r3-completejourney r3-completejourney
  pack r3-pr-ml-1m r3-pr-ml-1m
  wait "$pair"
  local left=$(( ${MAX_S:-1000} - ($(date +%s) - t0) - 60 ))
  run_eval r3-pr-ml-1m ml-1m 6 'memory-proteus[memory.n_blocks=1],memory-proteus[memory.unlock=drift]' \
    --seeds 0,1,2 --set train.max_seconds="$left"
}

plan_round3b() {  # round3's uniform (the default) with seeds 1 and 2, and narrow with 3 seeds,
  # on ML-1M: with round3's static and seed 0, every Proteus control at its early stop
  local cap=(--set train.max_seconds="${MAX_S:-430}")
  run_eval r3b-uniform ml-1m 2 'memory-proteus' --seeds 1,2 "${cap[@]}"
  run_eval r3b-narrow ml-1m 3 'memory-proteus[memory.unlock=narrow]' --seeds 0,1,2 "${cap[@]}"
}

plan_staticsuite() {  # issue 12: static (E = 1) against uniform Proteus (the default) on the
  # rest of the suite with today's recipe: 3 seeds on ML-100K and synthetic, seed 0 on
  # completejourney (ML-1M: round3 and round3b); decides whether Proteus stays the default.
  # 14 trainings at once: completejourney's need about MAX_S=980 (two device calls) to come
  # near their early stop, as in round3
  local cap=(--set train.max_seconds="${MAX_S:-600}") d
  local both="$MAC,memory-proteus[memory.n_blocks=1]"
  for d in ml-100k synthetic; do
    run_eval "st-$d" "$d" 6 "$both" --seeds 0,1,2 "${cap[@]}"
  done
  run_eval st-completejourney completejourney 2 "$both" "${cap[@]}"
}

plan_final12() {  # issue 12's last ablation on today's default: staticsuite's static against
  # uniform (ML-100K and synthetic 3 seeds, completejourney seed 0, guard MAX_S), and NoteBank
  # replay on ML-1M (3 seeds, each base to its early stop or NB_BASE_S, then the fusions on
  # its weights: core, lexical routing, low-rank and joint training) and ML-100K (3 seeds)
  local cap=(--set train.max_seconds="${MAX_S:-950}") d s
  local both="$MAC,memory-proteus[memory.n_blocks=1]"
  for d in ml-100k synthetic; do
    run_eval "st-$d" "$d" 6 "$both" --seeds 0,1,2 "${cap[@]}"
  done
  run_eval st-completejourney completejourney 2 "$both" "${cap[@]}"
  pack st "st-*"
  NB_ROUTES=("${NB_ROUTES[0]}" "$NB_EXTRA")  # lexical; the low-rank and joint fusions
  for s in 0 1 2; do
    nb_ml1m_seed "$s" --set train.max_seconds="${NB_BASE_S:-500}" &
    PIDS+=($!)
    pack "nb-ml-1m-s$s" "base-ml-1m-s$s" "nb-ml-1m-s$s-*"
  done
  run_eval nb-ml-100k ml-100k 3 "$NB_CORE,${NB_ROUTES[0]},$NB_EXTRA" --seeds 0,1,2 "${cap[@]}"
  pack nb-ml-100k nb-ml-100k
}

plan_final() {
  # seeds of the default memory model on ML-1M and ML-100K; everything else seed 0
  local cap=(--set train.max_seconds="${MAX_S:-780}")
  run_eval ml-1m-seeds ml-1m 3 "$MAC" --seeds 0,1,2 "${cap[@]}"
  run_eval ml-1m-s0 ml-1m 7 "pop,sasrec,$MAG,$NO_TIME,$NO_HYBRID,$SMALL,$LARGE" "${cap[@]}"
  run_eval ml-100k-seeds ml-100k 3 "$MAC" --seeds 0,1,2 "${cap[@]}"
  run_eval ml-100k-s0 ml-100k 2 "pop,sasrec,$MAG,$NO_TIME,$GAP_ONLY,$NO_HYBRID" "${cap[@]}"
  for d in $OTHER_SETS; do
    run_eval "$d" "$d" 2 "pop,sasrec,$MAC,$MAG" "${cap[@]}"
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
  # per-process GPU memory, for sizing how many trainings share the GPU
  nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv -l 20 >$W/apps.csv &
  APPS=$!
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # many processes share the GPU
  PIDS=()
  "plan_$2"
  wait "${PIDS[@]}"
  kill $SMI $APPS
  date -u +%FT%TZ >$W/DONE
  ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ ! -f $W/DONE ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  for f in $W/logs/*.log; do echo "== $f"; tr '\r' '\n' <"$f" | grep -E "INFO|Error|error" | tail -n 4; done
  tail -n 3 $W/smi.csv
  [ -f $W/DONE ] && echo "ALL DONE" || echo "STILL RUNNING"
  # one archive per evaluation, or per group a plan packs (files come back at most 16 MB
  # each, 8 in all)
  tar czf "$OUT/logs.tgz" -C $W --exclude=./src --exclude=./site --exclude=./data \
    --exclude=./out . 
  if [ -f $W/packs ]; then
    sort -u $W/packs | while read -r name globs; do
      (cd $W/out && shopt -s nullglob && eval "dirs=($globs)" && [ ${#dirs[@]} -gt 0 ] &&
        tar czf "$OUT/$name.tgz" --exclude='split.npz' --exclude='model.safetensors' "${dirs[@]}")
    done
  else
    for d in $W/out/*/; do
      tar czf "$OUT/$(basename "$d").tgz" -C $W/out --exclude='split.npz' "$(basename "$d")"
    done
  fi
  ls -la "$OUT"
  ;;
*)
  echo "usage: bench/gpu_suite.sh start PLAN | wait [SECONDS]" >&2; exit 2
  ;;
esac
