#!/usr/bin/env bash
# Creates .venv in the repository root (once) and installs recmem with its pinned
# dependencies into it. Safe to run again: a stamp file skips work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.recmem-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() {  # quiet pip with one harmless warning filtered out; fails when pip fails
  .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
echo "[bootstrap] installing dependencies (first run: about 2 minutes, 2.2 GB)"
# torch first and exactly: a looser request lets pip pick a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[dev]"
# torchrec's metadata asks for the CUDA fbgemm-gpu; we ship with fbgemm-gpu-cpu instead.
pip install --no-deps "torchrec==1.8.0"
.venv/bin/python -c "import torch, torchrec, fla, kafka, confluent_kafka, polars, grpc, faiss, boto3, moto" \
  || { echo "[bootstrap] import check failed" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[bootstrap] done"
