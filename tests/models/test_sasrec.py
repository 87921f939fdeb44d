"""SASRec: causality, the 200-event window, batched scoring == per-request encoding, training."""

from __future__ import annotations

import numpy as np
import torch

from models.sasrec import SASRec, SASRecConfig, train_sasrec, training_windows, window_matrix
from recmem.config import TrainConfig
from tests.models.synth import cyclic_seqs

N_ITEMS = 30


def small(max_len: int = 6) -> SASRec:
    torch.manual_seed(0)
    return SASRec(N_ITEMS, 4, SASRecConfig(embed_dim=16, n_heads=2, max_len=max_len)).eval()


def test_causal_and_padding() -> None:
    model = small()
    w = torch.tensor([[34, 34, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    h = model(w)
    w2 = w.clone()
    w2[:, 4:] = torch.tensor([7, 8])
    h2 = model(w2)
    assert torch.allclose(h[:, :4], h2[:, :4], atol=1e-6)
    assert not torch.allclose(h[:, 4:], h2[:, 4:])
    assert torch.isfinite(h).all()


def test_window_matrix_left_pads() -> None:
    items = np.arange(10, 20)
    w = window_matrix(items, np.array([2, 9, 9]), np.array([0, 0, 8]), 4, pad=-1)
    assert w.tolist() == [[-1, 10, 11, 12], [16, 17, 18, 19], [-1, -1, 18, 19]]


def test_training_windows_tile_every_target_once() -> None:
    offsets = np.array([0, 7, 8, 11])
    starts, ends = training_windows(np.array([7, 1, 3]), offsets, 3)
    targets = []
    for s, e in zip(starts, ends):
        first_input = max(s, e - 3)
        targets.extend(range(first_input + 1, e + 1))
    assert sorted(targets) == [1, 2, 3, 4, 5, 6, 9, 10]


def test_user_vectors_use_last_window_only() -> None:
    model = small(max_len=6)
    seqs = cyclic_seqs(n_users=4, n_items=N_ITEMS, max_len=15, seed=2)
    rows = np.array([int(seqs.offsets[u + 1]) - 1 for u in range(4)] + [int(seqs.offsets[2]) + 1])
    got = model.user_vectors(seqs, rows, batch_size=2)
    for i, r in enumerate(rows):
        u = int(np.searchsorted(seqs.offsets, r, side="right") - 1)
        hist = torch.as_tensor(seqs.items[int(seqs.offsets[u]) : r + 1])
        assert torch.allclose(got[i], model.encode_history(hist), atol=1e-5)
        if len(hist) > 6:
            # Events older than the window do not matter.
            older = hist.clone()
            older[:-6] = (older[:-6] + 5) % N_ITEMS
            assert torch.allclose(model.encode_history(older), got[i], atol=1e-6)


def test_training_lowers_loss() -> None:
    model = small(max_len=10)
    seqs = cyclic_seqs(n_users=16, n_items=N_ITEMS, max_len=24)
    tcfg = TrainConfig(epochs=4, batch_size=8, lr=5e-3, device="cpu", warmup_steps=0, eval_every=2)
    result = train_sasrec(model, seqs, tcfg)
    losses = [float(h["train_loss"]) for h in result.history]  # type: ignore[arg-type]
    assert losses[-1] < losses[0] - 0.05
