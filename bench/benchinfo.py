"""What every benchmark records about where it ran (imported by the scripts in bench/)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

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


def machine() -> str:
    """Host name, architecture and CPU count (a GPU benchmark appends the device's name)."""
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark's result as indented JSON (folders made as needed) and print it."""
    text = json.dumps(result, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(text)
