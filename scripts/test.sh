#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs lint, types, the generated-code check and the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PYTHONUNBUFFERED=1
echo "[test] ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "[test] mypy"; .venv/bin/mypy recmem streams models offline_eval
echo "[test] import layers"; .venv/bin/lint-imports
if [ -f scripts/gen_proto.sh ]; then echo "[test] generated code up to date"; bash scripts/gen_proto.sh --check; fi
echo "[test] pytest"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "[test] pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
