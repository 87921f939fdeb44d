"""``recmem demo``: the whole loop on the embedded default, on one machine.

1. train (or reuse) a small memory model on MovieLens-100K's TRAIN split;
2. start the embedded Kafka-compatible broker (tansu) on a free loopback port;
3. start ``recmem serve`` (consumer + engine + NoteBank + gRPC) as a child process;
4. stream every MovieLens-100K event into Kafka in time order;
5. wait until the service has applied the demo users' events, then rank for them through
   gRPC with and without NoteBank replay and print movie titles;
6. print the model's evaluation numbers, and stop everything it started.

The training function is passed in by the CLI (the composition root), so this module does
not depend on offline_eval.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from recmem.config import Config, dump_toml
from recmem.datasets import Dataset, load_dataset
from recmem.modelstore import MODEL_FILE, load_model
from recmem.producing import produce_dataset
from streams.admin import ensure_topics
from streams.broker import EmbeddedBroker, free_port

log = logging.getLogger(__name__)

TrainFn = Callable[[Config, Path], dict[str, Any]]


@dataclass
class DemoResult:
    users: list[str]
    rankings: dict[str, dict[str, list[tuple[str, float]]]]
    positions: dict[str, int]
    produced: int
    metrics: dict[str, Any]
    notes_replayed: dict[str, int] = field(default_factory=dict)
    """Per user, the notes the replay request replayed."""


def _same_training_config(out: Path, cfg: Config) -> bool:
    """A trained model in ``out`` made from the same memory/model/train/data settings."""
    metrics_file = out / "metrics.json"
    if not (out / MODEL_FILE).exists() or not metrics_file.exists():
        return False
    try:
        used = json.loads(metrics_file.read_text()).get("config", {})
    except (OSError, json.JSONDecodeError):
        return False
    want = cfg.to_dict()
    return all(used.get(sec) == want[sec] for sec in ("memory", "model", "train", "data"))


def ensure_model(cfg: Config, out: Path, train: TrainFn) -> dict[str, Any]:
    if _same_training_config(out, cfg):
        log.info("reusing the trained demo model in %s", out)
        return dict(json.loads((out / "metrics.json").read_text()))
    log.info("training the demo model into %s", out)
    return train(cfg, out)


def _serve_config(cfg: Config, work: Path, bootstrap: str, model_dir: Path) -> Config:
    serve = Config.from_dict(cfg.to_dict())
    serve.kafka.bootstrap_servers = bootstrap
    serve.kafka.group_id = "recmem-demo"
    serve.kafka.session_timeout_ms = 3000
    serve.kafka.heartbeat_interval_ms = 500
    serve.kafka.metrics_port = 0
    serve.checkpoint.dir = str(work / "checkpoints")
    serve.state.spill_dir = str(work / "spill")
    serve.server.host = "127.0.0.1"
    serve.server.port = free_port()
    serve.server.metrics_port = 0
    serve.server.model_dir = str(model_dir)
    return serve


def _wait_serving(channel: grpc.Channel, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"recmem serve exited with status {proc.returncode}")
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"recmem serve did not report SERVING within {timeout_s:.0f} s")


def _pick_users(data: Dataset, n: int) -> list[str]:
    counts = data.events.group_by("user_id").len().sort(["len", "user_id"], descending=True)
    users = counts["user_id"].to_list()
    # one heavy, one median and one light user: the memory at different Proteus positions
    picks = [users[0], users[len(users) // 2], users[int(len(users) * 0.9)]]
    return picks[:n]


def _wait_applied(stub: Any, pb: Any, expected: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    positions = dict.fromkeys(expected, 0)
    while time.monotonic() < deadline:
        for user in expected:
            try:
                reply = stub.InspectUser(pb.InspectUserRequest(user_id=user), timeout=5)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # restoring or moving: retry
                    raise
                continue
            positions[user] = int(reply.position)
        if all(positions[u] >= expected[u] for u in expected):
            return positions
        time.sleep(1.0)
    raise TimeoutError(
        f"ingest did not reach the demo users' last events: {positions} of {expected}"
    )


def run_demo(
    cfg: Config,
    out: Path,
    train: TrainFn,
    *,
    n_users: int = 3,
    k: int = 10,
    replay_notes: int | None = None,
    ingest_timeout_s: float = 420.0,
) -> DemoResult:
    """``replay_notes``: R of the replay requests (default ``archive.replay_notes``)."""
    from proto.recmem.v1 import rank_pb2, rank_pb2_grpc

    if replay_notes is None:
        replay_notes = cfg.archive.replay_notes

    metrics = ensure_model(cfg, out, train)
    data = load_dataset(cfg.data.dataset, cfg.data)
    titles = data.item_titles or {}
    users = _pick_users(data, n_users)
    per_user = data.events.filter(data.events["user_id"].is_in(users))
    expected = {u: int((per_user["user_id"] == u).sum()) for u in users}
    seen = {u: set(per_user.filter(per_user["user_id"] == u)["item_id"].to_list()) for u in users}
    # the model ranks its TRAIN catalog; the demo leaves out what each user already watched
    catalog = load_model(out, "cpu")[1].item_ids

    work = Path(tempfile.mkdtemp(prefix="recmem-demo-"))
    proc: subprocess.Popen[bytes] | None = None
    broker = EmbeddedBroker(bin_dir=cfg.kafka.broker_bin_dir)
    try:
        broker.start()
        serve_cfg = _serve_config(cfg, work, broker.bootstrap, out)
        ensure_topics(
            serve_cfg.kafka,
            {
                serve_cfg.kafka.topic: serve_cfg.kafka.partitions,
                serve_cfg.kafka.dead_letter_topic: 1,
            },
        )
        cfg_file = work / "serve.toml"
        cfg_file.write_text(dump_toml(serve_cfg.to_dict()))
        log_file = open(work / "serve.log", "wb")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen(
            [sys.executable, "-m", "recmem.cli", "serve", "--config", str(cfg_file)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        target = f"127.0.0.1:{serve_cfg.server.port}"
        with grpc.insecure_channel(target) as channel:
            _wait_serving(channel, proc, timeout_s=180)
            produced = produce_dataset(serve_cfg, data, serve_cfg.kafka.topic)
            stub = rank_pb2_grpc.RecMemStub(channel)
            positions = _wait_applied(stub, rank_pb2, expected, ingest_timeout_s)
            rankings: dict[str, dict[str, list[tuple[str, float]]]] = {}
            notes: dict[str, int] = {}
            for user in users:
                candidates = [i for i in catalog if i not in seen[user]]
                rankings[user] = {}
                for label, replay in (("no replay", False), (f"replay R={replay_notes}", True)):
                    reply = stub.Rank(
                        rank_pb2.RankRequest(
                            user_id=user,
                            candidate_item_ids=candidates,
                            k=k,
                            replay=rank_pb2.ReplayOptions(enabled=replay, notes=replay_notes),
                        ),
                        timeout=30,
                    )
                    rankings[user][label] = [
                        (titles.get(s.item_id, s.item_id), s.score) for s in reply.items
                    ]
                    if replay:
                        notes[user] = reply.notes_replayed
        return DemoResult(users, rankings, positions, produced, metrics, notes)
    except BaseException:
        if (work / "serve.log").exists():
            tail = (work / "serve.log").read_text(errors="replace")[-3000:]
            log.error("recmem serve log (last lines):\n%s", tail)
        raise
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


def format_demo(result: DemoResult, data_name: str) -> str:
    lines = [f"\nrecmem demo on {data_name}: {result.produced} events streamed through Kafka"]
    for user in result.users:
        lines.append(f"\nuser {user} (memory position {result.positions[user]}):")
        for label, items in result.rankings[user].items():
            n = result.notes_replayed.get(user)
            if label != "no replay" and n is not None:
                label += (
                    f", {n} notes replayed"
                    if n
                    else (", no notes yet (a note needs a full archive chunk): as without replay")
                )
            lines.append(f"  top {len(items)}, {label}:")
            lines.extend(
                f"    {i + 1:2d}. {title}  ({score:.3f})" for i, (title, score) in enumerate(items)
            )
    best = result.metrics.get("best_valid", {})
    if best:
        lines.append("\nevaluation (strict global time split, full ranking, VALID targets):")
        lines.extend(
            f"  {key:8s} {best[key]:.4f}"
            for key in ("hr@10", "ndcg@10", "mrr@10", "hr@50")
            if key in best
        )
    test = result.metrics.get("test", {}).get("overall", {})
    if test:
        lines.append("TEST targets:")
        lines.extend(
            f"  {key:8s} {test[key]:.4f}"
            for key in ("hr@10", "ndcg@10", "mrr@10", "hr@50")
            if key in test
        )
    return "\n".join(lines)
