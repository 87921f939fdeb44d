"""Model checkpoints: reloaded models score identically; writes are atomic and checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from models.sasrec import SASRec, SASRecConfig
from models.train import train_memory_model
from recmem.config import Config
from recmem.modelstore import (
    MODEL_FILE,
    _read,
    _write,
    adopt_model_config,
    convert_legacy,
    load_model,
    save_model,
)
from recmem.vocab import ItemVocab
from tests.models.synth import cyclic_seqs


def small_cfg() -> Config:
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_heads = 2
    cfg.memory.n_blocks = 2
    cfg.memory.backend = "recurrent"
    cfg.model.embed_dim = 16
    cfg.train.epochs = 1
    cfg.train.batch_size = 8
    cfg.train.segment_len = 8
    cfg.train.device = "cpu"
    return cfg


@pytest.mark.parametrize("readout", ["linear", "identity"])
def test_trained_memory_model_round_trip(tmp_path: Path, readout: str) -> None:
    cfg = small_cfg()
    cfg.model.readout = readout
    vocab = ItemVocab([f"i{i}" for i in range(30)], 4)
    torch.manual_seed(0)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    seqs = cyclic_seqs(n_users=10, n_items=30, max_len=16)
    train_memory_model(model, seqs, cfg.train)
    save_model(tmp_path, model, vocab, cfg, {"split": {"n_train": 123}})
    assert not [p for p in tmp_path.iterdir() if p.name != MODEL_FILE]
    loaded, vocab2, cfg2, extra = load_model(tmp_path)
    assert isinstance(loaded, MemoryRecommender)
    assert vocab2.item_ids == vocab.item_ids and vocab2.n_oov == 4
    assert cfg2.memory == cfg.memory and cfg2.model == cfg.model
    assert extra["split"] == {"n_train": 123}
    assert extra["model_version"].startswith("memory-E2-N256-")
    rows = np.arange(seqs.n_events)
    model.eval()
    a = model.user_vectors(seqs, rows)
    b = loaded.user_vectors(seqs, rows)
    assert torch.equal(a, b)
    assert torch.equal(model.score(a), loaded.score(b))
    # Saving the same weights again gives the same version; new weights a new one.
    save_model(tmp_path, model, vocab, cfg)
    assert load_model(tmp_path)[3]["model_version"] == extra["model_version"]


def test_model_saved_before_readout_option_loads_as_linear(tmp_path: Path) -> None:
    """Files written before ``model.readout`` existed hold the learned linear read-out; their
    config lacks the field, and loading must not apply today's default to them."""
    cfg = small_cfg()
    cfg.model.readout = "linear"
    vocab = ItemVocab([f"i{i}" for i in range(30)], 4)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    save_model(tmp_path, model, vocab, cfg)
    state, meta = _read(tmp_path / MODEL_FILE)
    del meta["config"]["model"]["readout"]
    _write(tmp_path, state, meta)
    loaded, _, cfg2, _ = load_model(tmp_path)
    assert cfg2.model.readout == "linear"
    assert isinstance(loaded, MemoryRecommender)
    lin, lin2 = model.head.readout, loaded.head.readout
    assert isinstance(lin, torch.nn.Linear) and isinstance(lin2, torch.nn.Linear)
    assert torch.equal(lin2.weight, lin.weight)


def test_sasrec_round_trip(tmp_path: Path) -> None:
    cfg = small_cfg()
    vocab = ItemVocab([f"i{i}" for i in range(30)], 4)
    model = SASRec(30, 4, SASRecConfig(embed_dim=16, max_len=7)).eval()
    save_model(tmp_path, model, vocab, cfg)
    loaded, _, _, extra = load_model(tmp_path)
    assert isinstance(loaded, SASRec) and loaded.cfg.max_len == 7
    hist = torch.tensor([1, 5, 2, 33])
    assert torch.equal(model.encode_history(hist), loaded.encode_history(hist))
    assert extra["model_version"].startswith("sasrec-")


def test_bad_checkpoints_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_model(tmp_path)


def test_files_are_never_unpickled(tmp_path: Path) -> None:
    """A pickle that would run code when loaded is refused without being loaded; a legacy
    model.pt of tensors and plain containers converts through weights_only loading."""
    import pickle

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "model.pt").write_bytes(pickle.dumps({"format_version": 1, "x": Evil()}))
    with pytest.raises(ValueError, match="pickle format"):
        load_model(evil)
    with pytest.raises(pickle.UnpicklingError):
        convert_legacy(evil)  # weights_only refuses the object
    assert not ran.exists()
    # a legacy file of the old layout converts and loads
    cfg = small_cfg()
    vocab = ItemVocab([f"i{i}" for i in range(5)], 2)
    model = MemoryRecommender(5, 2, cfg.memory, cfg.model).eval()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(
        {
            "format_version": 1, "model_version": "memory-old", "kind": "memory", "n_items": 5,
            "state_dict": model.state_dict(), "vocab": vocab.to_dict(), "config": cfg.to_dict(),
            "sasrec": {}, "extra": {"popularity": [1, 2, 3, 4, 5]},
        },
        legacy / "model.pt",
    )  # fmt: skip
    convert_legacy(legacy)
    loaded, _, _, extra = load_model(legacy)
    assert extra["model_version"] == "memory-old" and extra["popularity"] == [1, 2, 3, 4, 5]
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_serving_keeps_its_own_memory_backend(tmp_path: Path) -> None:
    cfg = small_cfg()  # trained with backend = recurrent
    vocab = ItemVocab([f"i{i}" for i in range(5)], 2)
    save_model(tmp_path, MemoryRecommender(5, 2, cfg.memory, cfg.model), vocab, cfg)
    serving = Config()
    serving.memory.backend = "reference"
    loaded, _, model_cfg, _ = load_model(tmp_path)
    adopt_model_config(serving, model_cfg)
    assert serving.memory.key_dim == 8 and serving.model.embed_dim == 16  # the model's shapes
    assert serving.memory.backend == "reference"  # the machine's kernel choice
    assert all(layer.mem.backend == "reference" for layer in loaded.layers)
