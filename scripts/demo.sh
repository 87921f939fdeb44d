#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/recmem demo "$@"
