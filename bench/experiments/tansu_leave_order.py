"""Does a consumer group on the embedded broker (tansu) form again after its two members
leave, depending on which leaves first? Per trial: two kafka-python members join a fresh
group, then stop (leave) one after the other, the leader first or the other member first;
then a third member joins and we wait up to 20 s for its assignment.

    PYTHONPATH=. .venv/bin/python bench/experiments/tansu_leave_order.py OUT.json \
        leader-first other-first [...]

Prints one line per trial and writes them to OUT.json."""

import json
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kafka import KafkaConsumer  # noqa: E402

from streams.admin import client_settings  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from tests.kafka_env import kafka_settings  # noqa: E402


def member(cfg, name: str, stop: threading.Event, out: dict) -> None:
    c = KafkaConsumer(
        group_id=cfg.group_id, client_id=name, session_timeout_ms=3000,
        heartbeat_interval_ms=500, enable_auto_commit=False, **client_settings(cfg),
    )  # fmt: skip
    c.subscribe([cfg.topic])
    out[name] = c
    while not stop.is_set():
        c.poll(timeout_ms=200)
    c.close(autocommit=False)  # sends LeaveGroup


def trial(broker: EmbeddedBroker, order: str) -> dict:
    tag = uuid.uuid4().hex[:8]
    cfg = kafka_settings(broker.bootstrap, 2, topic=f"t-{tag}", group_id=f"g-{tag}")
    out: dict = {}
    stops = {n: threading.Event() for n in ("a", "b")}
    threads = {n: threading.Thread(target=member, args=(cfg, n, stops[n], out)) for n in stops}
    for t in threads.values():
        t.start()
        time.sleep(0.3)
    began = time.monotonic()
    while not (len(out) == 2 and all(c.assignment() for c in out.values())):
        if time.monotonic() - began > 30:
            raise RuntimeError("the first two members never settled")
        time.sleep(0.1)
    leader = next(n for n, c in out.items() if c._coordinator._is_leader)
    other = "b" if leader == "a" else "a"
    for n in [leader, other] if order == "leader-first" else [other, leader]:
        stops[n].set()
        threads[n].join()
    stop, late = threading.Event(), {}
    t = threading.Thread(target=member, args=(cfg, "c", stop, late))
    t.start()
    began, assigned_after = time.monotonic(), None
    while time.monotonic() - began < 20:
        if "c" in late and late["c"].assignment():
            assigned_after = round(time.monotonic() - began, 1)
            break
        time.sleep(0.1)
    stop.set()
    t.join()
    return {"order": order, "new_member_assigned_after_s": assigned_after}


if __name__ == "__main__":
    results = []
    with EmbeddedBroker() as broker:
        for order in sys.argv[2:]:
            results.append(trial(broker, order))
            print(results[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
