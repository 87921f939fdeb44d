import json
import logging

import numpy as np
import pytest
import torch

from recmem.checkpoint import CheckpointError, CheckpointStore
from recmem.state_store import StateLayout
from tests.recmem.test_state_store import assert_state_equal, random_state

LAYOUT = StateLayout(n_layers=2, n_heads=2, key_dim=4, value_dim=3, momentum=True, embed_dim=5)


def write(store, partition, n, offset, seed, notes=None):
    users = [f"u{partition}-{i}" for i in range(n)]
    st = random_state(LAYOUT, n, torch.Generator().manual_seed(seed))
    store.write(partition, users, st, offset, model_version="m1", config_hash="c1", notes=notes)
    return users, st


def test_round_trip_with_notes_and_keep(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT, keep=2)
    notes = {"events": np.arange(12, dtype=np.int64).reshape(3, 4), "addr": np.ones((2, 3), "f4")}
    for k in range(4):
        users, st = write(store, 3, 5, offset=100 + k, seed=k, notes=notes)
    write(store, 7, 2, offset=9, seed=9)
    ckpt = store.restore(3, config_hash="c1")
    assert ckpt is not None
    assert ckpt.next_offset == 103 and ckpt.user_ids == users
    assert_state_equal(ckpt.state, st)
    assert ckpt.notes is not None
    assert set(ckpt.notes) == {"events", "addr"}
    assert np.array_equal(ckpt.notes["events"], notes["events"])
    assert ckpt.model_version == "m1"
    assert len(list((tmp_path / "p-00003").glob("ckpt-*"))) == 2
    assert store.partitions() == [3, 7]
    assert store.latest_offset(7) == 9
    assert store.restore(7).notes is None
    assert store.restore(5) is None and store.latest_offset(5) is None


def test_crash_mid_write_restores_previous_complete(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT)
    users, st = write(store, 0, 4, offset=50, seed=0)
    pdir = tmp_path / "p-00000"
    # a crash while writing: a temp dir with a truncated file, and a renamed directory whose
    # manifest update never happened (its meta is fine, but the manifest does not name it)
    tmp = pdir / ".tmp-ckpt-000000000002-12345"
    tmp.mkdir()
    (tmp / "state.S.bin").write_bytes(b"\0" * 7)
    orphan = pdir / "ckpt-000000000003"
    orphan.mkdir()
    (orphan / "meta.json").write_text("{")
    ckpt = store.restore(0)
    assert ckpt is not None and ckpt.next_offset == 50 and ckpt.user_ids == users
    assert_state_equal(ckpt.state, st)
    # the next write continues after the leftovers and removes them
    write(store, 0, 4, offset=60, seed=1)
    assert not tmp.exists() and not orphan.exists()
    assert store.restore(0).seq == 4


def test_corrupted_newest_falls_back_with_warning(tmp_path, caplog):
    store = CheckpointStore(tmp_path, LAYOUT)
    users, st = write(store, 1, 3, offset=10, seed=0)
    newest = store.write(
        1,
        users,
        random_state(LAYOUT, 3, torch.Generator()),
        20,
        model_version="m1",
        config_hash="c1",
    )
    blob = bytearray((newest / "state.S.bin").read_bytes())
    blob[5] ^= 0xFF
    (newest / "state.S.bin").write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="recmem.checkpoint"):
        ckpt = store.restore(1)
    assert ckpt is not None and ckpt.next_offset == 10
    assert_state_equal(ckpt.state, st)
    assert "CRC32" in caplog.text
    # truncated file in the newest: same fallback
    (newest / "users.json").write_bytes(b"[")
    assert store.restore(1).next_offset == 10


def test_unreadable_manifest_scans_directories(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT)
    write(store, 2, 3, offset=10, seed=0)
    write(store, 2, 3, offset=11, seed=1)
    (tmp_path / "p-00002" / "MANIFEST.json").write_text("not json")
    assert store.restore(2).next_offset == 11


def test_config_hash_mismatch_and_bad_inputs(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT)
    users, st = write(store, 0, 2, offset=1, seed=0)
    with pytest.raises(CheckpointError, match="config hash"):
        store.restore(0, config_hash="other")
    with pytest.raises(ValueError, match="user ids"):
        store.write(0, users[:1], st, 2, model_version="m", config_hash="c1")
    with pytest.raises(ValueError, match="safe file name"):
        store.write(
            0, users, st, 2, model_version="m", config_hash="c1", notes={"../x": st.pos.numpy()}
        )
    # the failed write left nothing that a restore would read
    assert store.restore(0).next_offset == 1
    manifest = json.loads((tmp_path / "p-00000" / "MANIFEST.json").read_text())
    assert len(manifest["checkpoints"]) == 1
