"""Stress the exit of a `recmem serve` member that was frozen (SIGSTOP) past its session
and resumed (SIGCONT), as tests/test_scaleout.py's fenced-member test does. Per round:
two members on a fresh group of the embedded broker (the first 10,000 ML-100K events,
default model dims), freeze member 1 for 6 s, resume it, wait for the group to settle,
SIGTERM both and record their exit codes (a SIGABRT shows as -6) and whether a log says
"terminate called".

    PYTHONPATH=. .venv/bin/python bench/experiments/freeze_exit.py ROUNDS OUT.json TMPDIR

Run it with PYTHONFAULTHANDLER=1 (the members inherit it: an abort dumps the Python
threads into their logs) and ``ulimit -c unlimited`` for core files."""

import json
import signal
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streams.broker import EmbeddedBroker  # noqa: E402
from tests.cluster import Cluster, ml100k_setup, scaleout_config  # noqa: E402
from tests.kafka_env import kafka_settings  # noqa: E402


def one_round(broker: EmbeddedBroker, tmp: Path) -> dict:
    tag = uuid.uuid4().hex[:8]
    kafka = kafka_settings(
        broker.bootstrap, 2, topic=f"events-{tag}", group_id=f"group-{tag}",
        session_timeout_ms=3000, heartbeat_interval_ms=200,
    )  # fmt: skip
    cfg = scaleout_config(tmp, kafka, dims="default")
    cfg.checkpoint.interval_s = 0.2
    cfg.checkpoint.full_every = 1
    ml100k_setup(cfg, limit=10_000)
    cluster = Cluster(cfg, tmp / "cluster", 2)
    rc: list[int | None] = [None, None]
    error = ""
    try:
        cluster.start_all()
        cluster.wait(lambda: cluster.settled(2), 240, "two members")
        cluster.signal(1, signal.SIGSTOP)
        time.sleep(6)
        cluster.signal(1, signal.SIGCONT)
        cluster.wait(lambda: cluster.settled(2), 120, "the resumed member to rejoin")
        rc = [cluster.stop(0), cluster.stop(1)]
    except AssertionError as e:
        error = str(e)[-1500:]
    finally:
        cluster.close()
    logs = [cluster.instances[i].log() for i in range(2)]
    return {"rc": rc, "error": error, "terminate": ["terminate called" in log for log in logs]}


if __name__ == "__main__":
    rounds, out, tmp = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    results = []
    with EmbeddedBroker() as broker:
        for r in range(rounds):
            results.append({"round": r, **one_round(broker, tmp / f"r{r}")})
            print(results[-1], flush=True)
            out.write_text(json.dumps(results, indent=1))
