"""Import-time layering that import-linter cannot see: what importing offline evaluation
pulls in at run time (scripts/test.sh runs the static contracts with lint-imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_fresh(code: str) -> None:
    """Run ``code`` in a new interpreter on this checkout (fails the test if it raises)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


def test_offline_evaluation_never_imports_grpc() -> None:
    code = (
        "import sys, offline_eval.runner, offline_eval.models_registry, "
        "offline_eval.notebank_eval; "
        "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kafka')));"
        "assert not bad, bad"
    )
    run_fresh(code)


def test_a_front_end_process_never_imports_torch_or_the_engine() -> None:
    """``server.frontends`` runs ``python -m recmem.server.frontend`` N times: each stays a
    light gRPC process (recmem.server's names and app.py's servicer load on first use)."""
    code = (
        "import sys, recmem.server.frontend, recmem.server.frontend_aio, recmem.server.app; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'faiss', 'kafka')"
        " or m.startswith(('recmem.engine', 'recmem.ranking', 'recmem.server.servicer')));"
        "assert not bad, bad"
    )
    run_fresh(code)
