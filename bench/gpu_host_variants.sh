#!/usr/bin/env bash
# bench/host_members.py once per variant on a lent H200 (16 cores, no internet), one after
# the other in one call (through bench/gpu_detached.sh when it outlasts a call):
#   GIT_COMMIT=... OUT=... VARIANTS="default:8: cp1:8:kafka.consumer_processes=1" \
#     bash bench/gpu_host_variants.sh
# A variant is NAME:MEMBERS:SECTION.FIELD=VALUE[,SECTION.FIELD=VALUE...] (MEMBERS: a
# comma-free count or list as host_members' --members takes, with ';' for ','). Carried:
# .gpu/rank, .gpu/whl, .gpu/bin (bench/gpu_site.sh). Sizes (env): EVENTS (600,000 of the
# 10M-event workload), PARTITIONS (16), REPLAY (0), RANK_S (3), CLIENT_PROCS (4), VARIANT_S
# (300: the bound of each variant), PROFILE (1: py-spy member 0 over each ingest, summarised
# into $OUT/member_profile_h200.json; PYSPY_IDLE=1 keeps idle samples). Output: $OUT/host_members_h200_<name>.json and .log,
# the members' logs under $OUT/logs-<name>/ (their error lines and GPU memory also in the JSON).
set -u
OUT=${OUT:?set OUT to the output folder}
VARIANTS=${VARIANTS:?set VARIANTS}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
export TMPDIR=${TMPDIR:-/dev/shm} PYSPY=$S/bin/py-spy
echo "cores $(nproc)"
for v in $VARIANTS; do
  name=${v%%:*}; rest=${v#*:}; members=${rest%%:*}; members=${members//;/,}; sets=()
  IFS=, read -r -a kv <<<"${rest#*:}"
  for x in "${kv[@]}"; do [ -n "$x" ] && sets+=(--set "$x"); done
  prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile-member "$OUT/prof/$name")
  timeout -s INT -k 20 "${VARIANT_S:-300}" python3 bench/host_members.py --members "$members" \
    --events "${EVENTS:-600000}" --partitions "${PARTITIONS:-16}" --concurrency 64 \
    --replay "${REPLAY:-0}" --rank-seconds "${RANK_S:-3}" --client-procs "${CLIENT_PROCS:-4}" \
    --set kafka.broker_bin_dir=.gpu/bin "${sets[@]}" \
    --keep-logs "$OUT/logs-$name" "${prof[@]}" --json "$OUT/host_members_h200_$name.json" \
    >"$OUT/host_$name.log" 2>&1
  echo "$name: exit $?"; grep -E '^\[' "$OUT/host_$name.log" | cut -c1-400 | tail -n 6
  grep -E 'Error|Traceback' "$OUT/host_$name.log" | tail -n 5
  for f in "$OUT/prof/$name"/*.txt; do [ -e "$f" ] && mv "$f" "$OUT/prof/$name-$(basename "$f")"; done
done
if [ "${PROFILE:-0}" = 1 ] && ls "$OUT"/prof/*.txt >/dev/null 2>&1; then
  python3 bench/experiments/member_profile.py "$OUT"/prof/*.txt --json "$OUT/member_profile_h200.json" \
    --command "PROFILE=1 VARIANTS=\"$VARIANTS\" bash bench/gpu_host_variants.sh" >/dev/null
fi
