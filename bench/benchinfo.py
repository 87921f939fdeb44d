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


def versions(modules: tuple[str, ...] = ("triton", "fla")) -> dict[str, str]:
    """Python's, torch's and each of ``modules``' version; a module that does not import is
    recorded with the reason, never raised."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in modules:
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - record, do not fail
            out[mod] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def machine_facts() -> dict[str, object]:
    """Where a benchmark ran: host, CPU model and count, memory, load, Python and torch."""
    import platform

    facts: dict[str, object] = {
        "host": platform.node(),
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                facts["memory_gb"] = round(int(line.split()[1]) / 1024**2, 1)
                break
    except OSError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return facts


def machine() -> str:
    """Host name, architecture and CPU count (a GPU benchmark appends the device's name)."""
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark's result as indented JSON (folders made as needed) and print it."""
    text = json.dumps(result, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(text)


def latency_percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 and the mean of latencies given in seconds, in milliseconds."""
    import numpy as np

    a = np.asarray(seconds) * 1000
    return {
        "n": len(seconds),
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p90_ms": round(float(np.percentile(a, 90)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "mean_ms": round(float(a.mean()), 3),
    }


def cpu_seconds(*pids: int | str) -> float:
    """User + system CPU seconds so far of the processes ``pids`` (all their threads), summed;
    a pid may be ``"self"``, or ``"self/task/TID"`` for one thread of this process. A process
    that has exited, or a machine without /proc, counts 0."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total
