"""bench/capacity.py runs from its committed inputs and its model answers in the right
direction: more users or events never need fewer machines, and what bounds it is named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def capacity(tmp_path: Path, users: float, events: float) -> dict:
    out = tmp_path / f"cap-{users:g}-{events:g}.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "capacity.py"), "--users", str(users),
         "--events-per-s", str(events), "--json", str(out)],
        check=True, capture_output=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_capacity_model_from_committed_inputs(tmp_path: Path) -> None:
    small = capacity(tmp_path, 1e6, 1e4)
    assert small["inputs"]["bytes_per_user"] > 0 and small["commit"]
    m = small["model"]
    assert m["machines"] == max(
        m["machines_by_state_memory"], m["machines_by_events"], m["machines_by_checkpoint_writes"]
    )
    assert m["bound_by"] in (
        "state memory",
        "engine events/s",
        "Kafka consumption",
        "checkpoint writes",
    )
    assert m["partitions"] >= m["processes"] >= m["machines"] >= 1
    assert m["rebalance_after_losing_a_machine"]["restore_s"] > 0
    more_users = capacity(tmp_path, 1e8, 1e4)["model"]
    more_events = capacity(tmp_path, 1e6, 1e6)["model"]
    assert more_users["machines"] >= m["machines"] and more_users["state_tb"] > m["state_tb"]
    assert more_events["machines_by_events"] > m["machines_by_events"]
