"""What every benchmark records about where it ran (imported by the scripts in bench/)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """$GIT_COMMIT when set (a copy of the tree on a lent GPU, whose .git may be stale),
    else HEAD of the checkout."""
    if os.environ.get("GIT_COMMIT", "unknown") != "unknown":
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        out = None
    commit = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    return commit or os.environ.get("GIT_COMMIT", "unknown")
