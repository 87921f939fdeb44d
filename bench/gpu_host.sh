#!/usr/bin/env bash
# bench/host_members.py on a lent H200 (nvidia-h200: 16 cores, no internet), one call:
#   OUT=... bash bench/gpu_host.sh
# Carried (ignored paths): .gpu/rank (kafka-python, protobuf, grpcio, faiss-cpu,
# prometheus-client, tqdm wheels), .gpu/whl (fla-core, einops), .gpu/bin (the tansu wheel).
# Sizes (env): MEMBERS (1,4,8), EVENTS (1,000,000 of the 10M-event workload), PARTITIONS
# (16), CONCURRENCY (64), REPLAY (0,2), RANK_S (5; 0: ingest only), CLIENT_PROCS (4),
# BUDGET_S (540); CLIENTS: Kafka clients to run every N with, in order (e.g.
# kafka-python,confluent; default the configured one: kafka-python); SET: extra
# space-separated section.field=value overrides. librdkafka: the confluent_kafka wheel of
# .gpu/rank. Both clients, 1/8/12 members, ingest only, in one call:
#   OUT=... MEMBERS=1,8,12 CLIENTS=kafka-python,confluent RANK_S=0 EVENTS=600000 \
#     bash bench/gpu_host.sh
# Checkpoints go under $TMPDIR (default /dev/shm here: each pass's are removed after it).
set -u
OUT=${OUT:?set OUT to the output folder}
. bench/gpu_site.sh || exit 1
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
export TMPDIR=${TMPDIR:-/dev/shm}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "cores $(nproc)"; free -g | head -n 2
extra=()
for kv in ${SET:-}; do extra+=(--set "$kv"); done
timeout -s INT -k 20 "${BUDGET_S:-540}" python3 bench/host_members.py \
  --members "${MEMBERS:-1,4,8}" --events "${EVENTS:-1000000}" --partitions "${PARTITIONS:-16}" \
  --concurrency "${CONCURRENCY:-64}" --replay "${REPLAY:-0,2}" --rank-seconds "${RANK_S:-5}" \
  --client-procs "${CLIENT_PROCS:-4}" --set kafka.broker_bin_dir=.gpu/bin ${extra[@]+"${extra[@]}"} \
  --clients "${CLIENTS:-}" --json "$OUT/host_members_h200.json" >"$OUT/host.log" 2>&1
echo "host_members: exit $?"
grep -E '^\[' "$OUT/host.log" | tail -n 40
grep -E 'Error|Traceback' "$OUT/host.log" | tail -n 10
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
