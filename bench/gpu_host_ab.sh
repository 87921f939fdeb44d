#!/usr/bin/env bash
# bench/host_members.py in an old source tree and in this one, one after the other, on a
# lent H200 (nvidia-h200: 16 cores, no internet), one call:
#   OLD=.gpu/old OLD_COMMIT=... GIT_COMMIT=... OUT=... bash bench/gpu_host_ab.sh
# Carried (ignored paths): .gpu/rank (kafka-python, crc32c, protobuf, grpcio, faiss-cpu,
# prometheus-client, tqdm wheels), .gpu/whl (fla-core, einops), .gpu/bin (the tansu wheel),
# OLD (a git archive of the old commit's recmem, streams, models, offline_eval, proto, bench,
# tests).
# Both trees get the same wheels. Sizes (env): MEMBERS (1,8), EVENTS (600,000 of the
# 10M-event workload), PARTITIONS (16), REPLAY (0), RANK_S (3), CLIENT_PROCS (4), TREE_S
# (270: the bound of each tree's pass), ORDER (new-old | old-new). Output: $OUT/host_members_h200_{new,old}.json.
set -u
OUT=${OUT:?set OUT to the output folder}
OLD=${OLD:?set OLD to the old tree}
. bench/gpu_site.sh || exit 1
export PYTHONUNBUFFERED=1 TMPDIR=${TMPDIR:-/dev/shm}
BIN=$PWD/.gpu/bin
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "cores $(nproc)"
run() {  # run TREE COMMIT TAG
  (cd "$1" && PYTHONPATH=$S:$PWD GIT_COMMIT=$2 timeout -s INT -k 20 "${TREE_S:-270}" \
    python3 bench/host_members.py --members "${MEMBERS:-1,8}" --events "${EVENTS:-600000}" \
    --partitions "${PARTITIONS:-16}" --concurrency 64 --replay "${REPLAY:-0}" \
    --rank-seconds "${RANK_S:-3}" --client-procs "${CLIENT_PROCS:-4}" \
    --set kafka.broker_bin_dir="$BIN" --json "$OUT/host_members_h200_$3.json" \
    >"$OUT/host_$3.log" 2>&1)
  echo "$3: exit $?"; grep -E '^\[' "$OUT/host_$3.log" | tail -n 12
  grep -E 'Error|Traceback' "$OUT/host_$3.log" | tail -n 5
}
if [ "${ORDER:-new-old}" = old-new ]; then
  run "$OLD" "${OLD_COMMIT:-old}" old; run "$PWD" "${GIT_COMMIT:-new}" new
else
  run "$PWD" "${GIT_COMMIT:-new}" new; run "$OLD" "${OLD_COMMIT:-old}" old
fi
