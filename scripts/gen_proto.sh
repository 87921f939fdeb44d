#!/usr/bin/env bash
# Regenerates the Python code for every proto/recmem/v1/*.proto (messages, type stubs, gRPC
# stubs). Run from anywhere: scripts/gen_proto.sh
# scripts/gen_proto.sh --check regenerates into a temporary directory and fails when the
# committed generated files differ (CI runs this through scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
protos=(proto/recmem/v1/*.proto)

generate() {  # generate OUT_DIR
  # -I . makes the generated imports read "from proto.recmem.v1 import ...", which never
  # clashes with the recmem Python package.
  "$PY" -m grpc_tools.protoc -I . --python_out="$1" --pyi_out="$1" --grpc_python_out="$1" \
    "${protos[@]}"
}

if [ "${1:-}" = "--check" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  generate "$tmp"
  stale=0
  for f in "$tmp"/proto/recmem/v1/*; do
    rel=${f#"$tmp"/}
    if ! cmp -s "$f" "$rel"; then
      echo "gen_proto: $rel is missing or out of date; run scripts/gen_proto.sh and commit" >&2
      stale=1
    fi
  done
  for f in proto/recmem/v1/*_pb2*.py proto/recmem/v1/*_pb2*.pyi; do
    [ -e "$f" ] || continue
    if [ ! -e "$tmp/$f" ]; then
      echo "gen_proto: $f has no .proto source any more; delete it" >&2
      stale=1
    fi
  done
  [ $stale -eq 0 ] && echo "gen_proto: generated code is up to date"
  exit $stale
fi

generate .
echo "gen_proto: regenerated code for ${protos[*]}"
