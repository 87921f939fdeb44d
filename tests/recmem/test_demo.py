"""The README's main job end to end: broker, training, serve, Kafka, gRPC ranking."""

from pathlib import Path

import pytest

from offline_eval.training import run_train
from recmem.config import Config
from recmem.demo import format_demo, run_demo


def child_pids() -> set[int]:
    """Live children of this process (Linux /proc), zombies excluded."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def tiny_demo_config(tmp_path: Path) -> Config:
    cfg = Config()
    cfg.data.dataset = "ml-100k"
    cfg.memory.n_layers = 1
    cfg.memory.n_heads = 2
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_blocks = 2
    cfg.memory.horizon = 64
    cfg.memory.backend = "recurrent"
    cfg.model.embed_dim = 16
    cfg.train.epochs = 1
    cfg.train.max_seconds = 30.0
    cfg.train.device = "cpu"
    cfg.archive.chunk_events = 16
    cfg.kafka.partitions = 2
    return cfg


@pytest.mark.timeout(420)
def test_demo_streams_ranks_and_cleans_up(tmp_path):
    cfg = tiny_demo_config(tmp_path)
    children_before = child_pids()
    result = run_demo(cfg, tmp_path / "model", run_train, n_users=2, k=5, ingest_timeout_s=300)
    assert result.produced == 100_000
    assert len(result.users) == 2
    for user in result.users:
        assert result.positions[user] > 0
        for label, items in result.rankings[user].items():
            assert len(items) == 5, label
            scores = [s for _, s in items]
            assert scores == sorted(scores, reverse=True)
            assert all(isinstance(t, str) and t for t, _ in items)
    # the heavy user has closed chunks, hence notes to replay: replay changes its scores
    heavy = result.users[0]
    replayed = f"replay R={cfg.archive.replay_notes}"  # the configured R by default
    assert result.rankings[heavy]["no replay"] != result.rankings[heavy][replayed]
    assert result.notes_replayed[heavy] > 0
    text = format_demo(result, "ml-100k")
    assert "ndcg@10" in text and heavy in text
    assert f"{replayed}, {result.notes_replayed[heavy]} notes replayed:" in text
    leftover = child_pids() - children_before
    assert not leftover, f"demo left processes running: {leftover}"
    # a second run reuses the trained model instead of training again
    model_file = tmp_path / "model" / "model.safetensors"
    mtime = model_file.stat().st_mtime_ns
    run_demo(cfg, tmp_path / "model", run_train, n_users=1, k=3, ingest_timeout_s=300)
    assert model_file.stat().st_mtime_ns == mtime
