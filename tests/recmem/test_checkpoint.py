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


def test_a_setting_an_older_checkpoint_lacks_compares_as_its_default(tmp_path):
    """A setting added after a checkpoint was written is not in its meta.json: the checkpoint
    restores under the setting's default, and is refused under any other value."""
    from recmem.config import Config

    ours = data_settings(Config())
    new = "model.window"  # stands for a setting the writer did not know yet
    older = {n: v for n, v in ours.items() if n != new}
    changed = Config()
    changed.model.window = Config().model.window * 2 + 1
    store = CheckpointStore(tmp_path, LAYOUT)
    users = ["a", "b"]
    gen = torch.Generator().manual_seed(0)
    full = store.write(0, users, random_state(LAYOUT, 2, gen), 5, model_version="m", settings=older)
    # another value than the default is refused, and the message says what the default is
    with pytest.raises(
        IncompatibleCheckpoint,
        match=rf"{new}: checkpoint <unset: default {Config().model.window}>, "
        rf"this service {changed.model.window}",
    ):
        store.restore(0, settings=data_settings(changed))
    ckpt = store.restore(0, settings=ours, model_version="m")
    assert ckpt is not None and ckpt.next_offset == 5
    # this service goes on with deltas on top of the older checkpoint: the chain holds
    st = random_state(LAYOUT, 1, gen)
    store.write(0, ["a"], st, 7, model_version="m", settings=ours, parent=full.name)
    ckpt = store.restore(0, settings=ours, model_version="m")
    assert ckpt is not None and ckpt.next_offset == 7 and len(ckpt.chain) == 2
    assert_state_equal(ckpt.state.index(torch.tensor([0])), st)
    # a setting the checkpoint records and this service no longer has: refused
    gone = CheckpointStore(tmp_path / "gone", LAYOUT)
    retired = dict(ours, **{"model.retired": 3})
    gone.write(0, users, random_state(LAYOUT, 2, gen), 1, model_version="m", settings=retired)
    with pytest.raises(
        IncompatibleCheckpoint, match="model.retired: checkpoint 3, this service <unset>"
    ):
        gone.restore(0, settings=ours)


def test_unlock_schedule_fields_round_trip_through_a_delta_chain(tmp_path):
    """The adaptive unlock schedules' and the keyed block order's own state fields (unlock
    counts, signal sums, order key) move with the partition like S and M."""
    layout = StateLayout(2, 2, 4, 3, True, 5, adaptive=True, keyed_order=True)
    store = CheckpointStore(tmp_path, layout)
    gen = torch.Generator().manual_seed(5)

    def state(n):
        st = random_state(layout, n, gen)
        st.unlocks.copy_(torch.randint(0, 4, st.unlocks.shape, generator=gen))
        st.unlock_acc.copy_(torch.rand(st.unlock_acc.shape, generator=gen))
        st.order_key.copy_(torch.randint(0, 2**40, st.order_key.shape, generator=gen))
        return st

    first, later = state(3), state(1)
    full = store.write(0, ["a", "b", "c"], first, 3, model_version="m", settings=SET)
    store.write(0, ["b"], later, 4, model_version="m", settings=SET, parent=full.name)
    ckpt = store.restore(0, settings=SET)
    assert ckpt is not None and ckpt.user_ids == ["a", "b", "c"]
    want = first.put_rows(torch.tensor([1]), later)
    for name in ("unlocks", "unlock_acc", "order_key", "S", "pos"):
        assert torch.equal(getattr(ckpt.state, name), getattr(want, name)), name


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
        "memory.unlock",
        "memory.block_order",
        "model.route_dim",
    ):
        assert dotted in base, dotted
    # how this machine computes the rule, or what a request asks for, does not count
    for dotted in (
        "memory.backend",
        "archive.replay_notes",
        "archive.routing",
        "archive.route_candidates",
        "archive.route_device",
        "model.dropout",
    ):
        assert dotted not in base, dotted


# ---- object store and fencing ----------------------------------------------------------


@pytest.fixture(params=["dir", "s3"])
def location(request, tmp_path):
    """A fresh checkpoint root: a directory, or a bucket of the S3 emulator."""
    if request.param == "dir":
        return str(tmp_path / "ckpt")
    server = request.getfixturevalue("s3_server")
    return server.bucket()


def open_store(location, s3_server=None, **kw):
    from recmem.blobstore import S3Settings

    s3 = S3Settings(endpoint_url=s3_server.endpoint) if s3_server is not None else None
    return CheckpointStore(location, LAYOUT, s3=s3, **kw)


def store_for(request, location, **kw):
    server = request.getfixturevalue("s3_server") if location.startswith("s3://") else None
    return open_store(location, server, **kw)


def test_round_trip_deltas_and_corruption_in_either_store(request, location):
    store = store_for(request, location, keep=2)
    users, st = write(store, 4, 5, offset=7, seed=0, notes={"n": np.arange(3)})
    full = store.restore(4, settings=SET).path.name
    st2 = random_state(LAYOUT, 1, torch.Generator().manual_seed(1))
    delta = store.write(4, users[:1], st2, 9, model_version="m1", settings=SET, parent=full)
    ckpt = store.restore(4, settings=SET)
    assert ckpt.chain == [full, delta.name] and ckpt.next_offset == 9
    assert_state_equal(ckpt.state.index(slice(0, 1)), st2)
    assert_state_equal(ckpt.state.index(slice(1, 5)), st.index(slice(1, 5)))
    assert ckpt.bytes_read > 0
    assert store.partitions() == [4] and store.latest_offset(4) == 9
    # a corrupted delta falls back to its full parent
    key = f"p-00004/{delta.name}/state.S.bin"
    blob = bytearray(store.blobs.get(key))
    blob[3] ^= 0xFF
    store.blobs.put(key, bytes(blob))
    assert store.restore(4, settings=SET).chain == [full]
    # a model version other than the service's is refused, never silently continued
    with pytest.raises(IncompatibleCheckpoint, match="recmem-\\{model_version\\}"):
        store.restore(4, settings=SET, model_version="m2")


def test_a_claim_fences_older_generations_at_write_time(request, location):
    from recmem.checkpoint import Fenced

    store = store_for(request, location)
    users, st = write_gen(store, 0, offset=10, generation=3)
    store.claim(0, generation=5, owner="b:1")
    before = store.blobs.children("p-00000")
    with pytest.raises(Fenced, match="generation 5"):
        write_gen(store, 0, offset=20, generation=3)
    assert store.blobs.children("p-00000") == before, "a refused write left files behind"
    ckpt = store.restore(0, settings=SET)
    assert ckpt.next_offset == 10 and ckpt.generation == 3
    write_gen(store, 0, offset=30, generation=5)
    assert store.restore(0, settings=SET).next_offset == 30
    with pytest.raises(Fenced):
        store.claim(0, generation=4)
    assert store.claim(0, generation=5).generation == 5  # the owner's own claim again
    # another store object (another process) sees the same fence
    assert store_for(request, location).fence(0).generation == 5


def test_a_stale_write_whose_files_a_new_owner_removed_is_refused_not_raised(tmp_path):
    """A member frozen between creating its checkpoint's folder and opening a file in it
    (SIGSTOP in tests/test_scaleout.py) resumes after the new owner's first checkpoint has
    removed that unfinished folder as a stale leftover: its open fails. That is the same
    refusal as a fenced commit (Fenced, which ingest logs and counts), not an error that
    stops the process."""
    from recmem.checkpoint import Fenced

    location = str(tmp_path / "ckpt")
    stale = open_store(location)
    write_gen(stale, 0, offset=10, generation=3)
    owner_b = open_store(location)
    real_put, calls = stale.blobs.put, []

    def frozen_put(key, data):
        calls.append(key)
        if len(calls) != 2:
            return real_put(key, data)
        # the folder exists (the first file is in it); the new owner claims and writes
        owner_b.claim(0, generation=5, owner="b:1")
        write_gen(owner_b, 0, offset=30, generation=5)
        assert not (tmp_path / "ckpt" / key).parent.exists(), "the leftover was not removed"
        with open(tmp_path / "ckpt" / key, "wb") as f:  # where the frozen writer resumes
            f.write(data)

    stale.blobs.put = frozen_put
    with pytest.raises(Fenced, match="refused while writing"):
        write_gen(stale, 0, offset=20, generation=3)
    assert owner_b.restore(0, settings=SET).next_offset == 30
    # an error with no newer claim behind it is still an error
    owner_c = open_store(location)

    def failing_put(key, data):
        raise FileNotFoundError(key)

    owner_c.blobs.put = failing_put
    with pytest.raises(FileNotFoundError):
        write_gen(owner_c, 0, offset=40, generation=5)


class RacingStore(CheckpointStore):
    """A writer that read the fence just before another member's claim landed (the window
    between the check and the manifest replace): ``claim_in_between`` runs the claim there."""

    def __init__(self, *args, claim_in_between, **kw):
        super().__init__(*args, **kw)
        self.claim_in_between = claim_in_between

    def fence(self, partition, manifest=None):
        seen = super().fence(partition, manifest)
        if self.claim_in_between is not None:
            run, self.claim_in_between = self.claim_in_between, None
            run()
        return seen


def test_a_stale_write_in_the_race_window_is_refused_by_the_conditional_replace(s3_server):
    from recmem.blobstore import S3Settings
    from recmem.checkpoint import Fenced

    location = s3_server.bucket()
    owner_b = open_store(location, s3_server)
    write_gen(owner_b, 0, offset=10, generation=3)
    stale = RacingStore(
        location, LAYOUT, s3=S3Settings(endpoint_url=s3_server.endpoint),
        claim_in_between=lambda: owner_b.claim(0, generation=5),
    )  # fmt: skip
    with pytest.raises(Fenced):
        write_gen(stale, 0, offset=20, generation=3)
    assert owner_b.restore(0, settings=SET).next_offset == 10


def test_without_conditional_writes_a_restore_ignores_what_a_stale_owner_slipped_in(tmp_path):
    """A store that cannot write conditionally lets a stale owner's write through in the
    race window (it even rolls the manifest's fence back); the claim's fence object still
    tells a restore to ignore it."""
    location = str(tmp_path / "ckpt")
    plain = open_store(location, conditional=False)
    write_gen(plain, 0, offset=10, generation=3)
    stale = RacingStore(
        location, LAYOUT, conditional=False,
        claim_in_between=lambda: open_store(location, conditional=False).claim(0, 5, "b:1"),
    )  # fmt: skip
    write_gen(stale, 0, offset=20, generation=3)
    assert plain.latest_offset(0) == 10
    ckpt = plain.restore(0, settings=SET)
    assert ckpt.next_offset == 10 and ckpt.generation == 3
    # the new owner's own checkpoints are restore points again
    write_gen(plain, 0, offset=30, generation=5)
    assert plain.restore(0, settings=SET).next_offset == 30


def write_gen(store, partition, offset, generation):
    users = [f"u{partition}-{i}" for i in range(3)]
    st = random_state(LAYOUT, 3, torch.Generator().manual_seed(offset))
    store.write(
        partition, users, st, offset, model_version="m1", settings=SET, generation=generation
    )
    return users, st
