import json
import logging

import numpy as np
import pytest
import torch

from recmem.checkpoint import (
    CheckpointStore,
    IncompatibleCheckpoint,
    data_settings,
)
from recmem.state_store import StateLayout
from tests.recmem.test_state_store import assert_state_equal, random_state

LAYOUT = StateLayout(n_layers=2, n_heads=2, key_dim=4, value_dim=3, momentum=True, embed_dim=5)
SET = {"memory.key_dim": 4, "archive.chunk_events": 32}


def write(store, partition, n, offset, seed, notes=None):
    users = [f"u{partition}-{i}" for i in range(n)]
    st = random_state(LAYOUT, n, torch.Generator().manual_seed(seed))
    store.write(partition, users, st, offset, model_version="m1", settings=SET, notes=notes)
    return users, st


def test_round_trip_with_notes_and_keep(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT, keep=2)
    notes = {"events": np.arange(12, dtype=np.int64).reshape(3, 4), "addr": np.ones((2, 3), "f4")}
    for k in range(4):
        users, st = write(store, 3, 5, offset=100 + k, seed=k, notes=notes)
    write(store, 7, 2, offset=9, seed=9)
    ckpt = store.restore(3, settings=SET)
    assert ckpt is not None
    assert ckpt.next_offset == 103 and ckpt.user_ids == users
    assert_state_equal(ckpt.state, st)
    [(note_users, got_notes)] = ckpt.notes_parts
    assert note_users == users and got_notes is not None
    assert set(got_notes) == {"events", "addr"}
    assert np.array_equal(got_notes["events"], notes["events"])
    assert ckpt.model_version == "m1" and ckpt.chain == [ckpt.path.name]
    assert len(list((tmp_path / "p-00003").glob("ckpt-*"))) == 2
    assert store.partitions() == [3, 7]
    assert store.latest_offset(7) == 9
    assert store.restore(7).notes_parts == [(["u7-0", "u7-1"], None)]
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
        settings=SET,
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


def test_settings_mismatch_names_the_setting_and_bad_inputs(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT)
    users, st = write(store, 0, 2, offset=1, seed=0)
    other = dict(SET, **{"archive.chunk_events": 16})
    with pytest.raises(
        IncompatibleCheckpoint, match="archive.chunk_events: checkpoint 32, this service 16"
    ):
        store.restore(0, settings=other)
    # an older format is refused, never skipped for an older restore point
    meta = next((tmp_path / "p-00000").glob("ckpt-*")) / "meta.json"
    old = json.loads(meta.read_text())
    meta.write_text(json.dumps(dict(old, format=1)))
    with pytest.raises(IncompatibleCheckpoint, match="format 1"):
        store.restore(0, settings=SET)
    meta.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="user ids"):
        store.write(0, users[:1], st, 2, model_version="m", settings=SET)
    with pytest.raises(ValueError, match="safe file name"):
        store.write(
            0, users, st, 2, model_version="m", settings=SET, notes={"../x": st.pos.numpy()}
        )
    # the failed write left nothing that a restore would read
    assert store.restore(0).next_offset == 1
    manifest = json.loads((tmp_path / "p-00000" / "MANIFEST.json").read_text())
    assert len(manifest["checkpoints"]) == 1


def test_delta_chain_merges_and_keeps_what_it_needs(tmp_path):
    store = CheckpointStore(tmp_path, LAYOUT, keep=2)
    gen = torch.Generator().manual_seed(3)
    users = [f"u{i}" for i in range(6)]
    truth = {}

    def put(names, offset, parent):
        st = random_state(LAYOUT, len(names), gen)
        for i, u in enumerate(names):
            truth[u] = st.index(slice(i, i + 1))
        notes = {"n": np.array([offset])}
        return store.write(
            0, names, st, offset, model_version="m", settings=SET, notes=notes, parent=parent
        ).name

    full = put(users, 10, None)
    d1 = put(["u1", "u3"], 11, full)
    d2 = put(["u3", "new"], 12, d1)
    ckpt = store.restore(0)
    assert ckpt.chain == [full, d1, d2] and ckpt.next_offset == 12
    assert sorted(ckpt.user_ids) == sorted(users + ["new"])
    for i, u in enumerate(ckpt.user_ids):
        assert_state_equal(ckpt.state.index(slice(i, i + 1)), truth[u])
    assert [int(n["n"][0]) for _, n in ckpt.notes_parts] == [10, 11, 12]
    # keep=2 restore points (d2, d1) still need the full one
    assert sorted(d.name for d in (tmp_path / "p-00000").glob("ckpt-*")) == [full, d1, d2]
    full2 = put(users + ["new"], 13, None)
    d3 = put(["u0"], 14, full2)
    assert sorted(d.name for d in (tmp_path / "p-00000").glob("ckpt-*")) == [full2, d3]
    assert store.restore(0).chain == [full2, d3]
    with pytest.raises(ValueError, match="does not exist"):
        put(["u0"], 15, full)


def test_corrupted_delta_falls_back_to_an_intact_chain(tmp_path, caplog):
    store = CheckpointStore(tmp_path, LAYOUT, keep=5)
    users, st = write(store, 0, 3, offset=10, seed=0)
    full = store.restore(0).path.name
    st2 = random_state(LAYOUT, 1, torch.Generator().manual_seed(1))
    d1 = store.write(0, users[:1], st2, 11, model_version="m1", settings=SET, parent=full)
    store.write(0, users[1:2], st2, 12, model_version="m1", settings=SET, parent=d1.name)
    (d1 / "users.json").write_bytes(b"[")
    with caplog.at_level(logging.WARNING, logger="recmem.checkpoint"):
        ckpt = store.restore(0)
    assert ckpt.chain == [full] and ckpt.next_offset == 10
    assert_state_equal(ckpt.state, st)
    assert caplog.text.count("unusable") == 2


def test_data_settings_cover_what_shapes_stored_data():
    from recmem.config import Config

    cfg = Config()
    base = data_settings(cfg)
    for dotted in (
        "memory.key_dim",
        "model.window",
        "model.hybrid",
        "archive.chunk_events",
        "archive.address_dim",
        "train.seed",
        "recent_events",
    ):
        assert dotted in base, dotted
    # how this machine computes the rule, or what a request asks for, does not count
    for dotted in ("memory.backend", "archive.replay_notes", "model.dropout"):
        assert dotted not in base, dotted
