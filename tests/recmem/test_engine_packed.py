"""The packed engine step (``state.packed_advance``: one ``advance_packed`` per micro-batch)
against the per-bucket step it replaces, on real data: ML-100K events in ingest-sized
batches through two engines with the default model and a NoteBank each."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from proto.actions import ACTIONS
from recmem.archive import NoteBank
from recmem.config import Config, DataConfig
from recmem.datasets import load_dataset
from recmem.engine import Engine
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab
from streams.validate import ValidEvent

CACHE = Path(os.environ.get("RECMEM_TEST_CACHE", "~/.cache/recmem")).expanduser()
EVENTS, BATCH = 12_000, 4_000


@pytest.fixture(scope="module")
def ml100k() -> tuple[list[ValidEvent], list[str]]:
    frame = load_dataset("ml-100k", DataConfig(cache_dir=str(CACHE))).events
    items = sorted(frame["item_id"].unique().to_list())
    head = frame.head(EVENTS)
    cols = [head[c].to_list() for c in ("user_id", "item_id", "ts_ms", "action", "value")]
    events = [
        ValidEvent(u, i, t, ACTIONS.index(a) if isinstance(a, str) else int(a), v, None,
                   zlib.crc32(u.encode()) % 4, n)
        for n, (u, i, t, a, v) in enumerate(zip(*cols))
    ]  # fmt: skip
    return events, items


def ingest(tmp_path: Path, events: list[ValidEvent], items: list[str], packed: str) -> Engine:
    cfg = Config()
    cfg.state.packed_advance = packed
    torch.manual_seed(cfg.train.seed)
    vocab = ItemVocab(items, cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    mem = cfg.memory
    store = UserStateStore(
        StateLayout.from_config(mem, cfg.model), 4096, 4096, tmp_path / packed, device="cpu"
    )
    bank = NoteBank(cfg.archive, mem.key_dim, mem.n_layers * mem.n_heads, seed=cfg.train.seed)
    engine = Engine(model, vocab, store, cfg, bank=bank)
    for start in range(0, len(events), BATCH):
        engine.apply(events[start : start + BATCH])
    return engine


@pytest.fixture
def service_threads(monkeypatch):
    """As ``recmem serve`` and ``recmem ingest`` run: denormals flushed (``flush_denormals``:
    decayed states are denormal floats, about 100x slower to compute with) and one intra-op
    thread (``server.torch_threads``); restored afterwards."""
    from models.memory import recurrent

    monkeypatch.setattr(recurrent, "_process_flushes_denormals", True)
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)


def test_packed_step_equals_the_bucketed_step_on_ml100k(tmp_path, ml100k, service_threads):
    events, items = ml100k
    packed = ingest(tmp_path, events, items, "on")
    buckets = ingest(tmp_path, events, items, "off")
    assert packed.packs and not buckets.packs
    # padded cells are not computed: one cell per event
    assert packed.seconds["user_steps"] == EVENTS < buckets.seconds["user_steps"]
    users = sorted(buckets.partition_of)
    assert sorted(packed.partition_of) == users
    got, want = packed.snapshot(users), buckets.snapshot(users)
    assert torch.equal(got.pos, want.pos) and torch.equal(got.last_ts, want.last_ts)
    for name in ("win_items", "win_actions", "win_gaps", "win_ts"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # fp32 tolerance of the CPU paths (docs/memory.md, Tolerances): < 1e-5 relative
    for name in ("S", "M", "h"):
        a, b = getattr(got, name), getattr(want, name)
        assert ((a - b).norm() / b.norm()).item() < 1e-5, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the same notes (events, positions, serials) with the same addresses, and latest events
    assert packed.bank is not None and buckets.bank is not None
    n_notes = 0
    for u in users:
        mine, theirs = packed.bank.notes(u), buckets.bank.notes(u)
        assert [(n.serial, n.positions.tolist(), n.item_ids) for n in mine] == [
            (n.serial, n.positions.tolist(), n.item_ids) for n in theirs
        ], u
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a.addresses, b.addresses, atol=2e-3)
        n_notes += len(mine)
        assert packed.bank.pending_count(u) == buckets.bank.pending_count(u)
        assert (
            packed.recent_events(u, 8).items.tolist() == buckets.recent_events(u, 8).items.tolist()
        )
        qa, qb = packed.recent_queries(u, 8), buckets.recent_queries(u, 8)
        assert qa is not None and qb is not None
        torch.testing.assert_close(qa, qb, rtol=1e-4, atol=1e-5)
    assert n_notes > 200
