import numpy as np
import pytest

from recmem.archive import NoteBank
from recmem.archive.persist import PREFIX, pack_strings, unpack_strings
from tests.recmem.test_archive_bank import CH, K, make_stream, small_cfg


def _filled_bank(n_users: int = 3, n_events: int = 45) -> tuple[NoteBank, dict]:
    bank = NoteBank(small_cfg(notes_per_user=5), K, CH, seed=3)
    streams = {}
    for u in range(n_users):
        s = make_stream(n_events + 7 * u, seed=20 + u, planted=(4, 19, 33))
        bank.observe(f"user-{u}", *s.part(0, len(s.items) - 3))
        streams[f"user-{u}"] = s
    return bank, streams


def _routes(bank: NoteBank, users, queries) -> list:
    return [
        [(n.serial, n.votes, n.positions.tolist()) for n in bank.route(u, q, r=3)]
        for u in users
        for q in queries
    ]


def test_round_trip_through_npz_gives_identical_routes_and_continues(tmp_path):
    bank, streams = _filled_bank()
    users = sorted(streams)
    state = bank.state_for_users(users)
    assert all(k.startswith(PREFIX) for k in state)
    assert all(v.dtype != object for v in state.values())
    np.savez(tmp_path / "archive.npz", **state)
    with np.load(tmp_path / "archive.npz", allow_pickle=False) as f:
        loaded = {k: f[k] for k in f.files}
    restored = NoteBank(small_cfg(notes_per_user=5), K, CH, seed=3)
    assert restored.load_users(loaded) == 3
    queries = [make_stream(4, seed=99).q, make_stream(1, seed=98).q]
    assert _routes(restored, users, queries) == _routes(bank, users, queries)
    for u in users:
        assert restored.pending_count(u) == bank.pending_count(u) > 0
        for x, y in zip(restored.notes(u), bank.notes(u)):
            assert x.item_ids == y.item_ids and x.serial == y.serial
            np.testing.assert_array_equal(x.addresses, y.addresses)
    # The buffered events survived: the next events close the same chunks on both banks.
    for u, s in streams.items():
        n = len(s.items)
        assert restored.observe(u, *s.part(n - 3, n)) == bank.observe(u, *s.part(n - 3, n))
        assert [n.positions.tolist() for n in restored.notes(u)] == [
            n.positions.tolist() for n in bank.notes(u)
        ]


def test_subset_drop_and_empty_state():
    bank, streams = _filled_bank()
    state = bank.state_for_users(["user-1", "nobody"])
    other = NoteBank(small_cfg(notes_per_user=5), K, CH, seed=3)
    assert other.load_users(state) == 1
    assert other.users() == ["user-1"]
    assert bank.drop_users(["user-1", "nobody"]) == 1
    assert bank.note_count("user-1") == 0 and bank.route("user-1", streams["user-1"].q[:1]) == []
    empty = bank.state_for_users([])
    assert other.load_users(empty) == 0 and other.users() == ["user-1"]


def test_load_replaces_a_users_archive():
    bank, _ = _filled_bank()
    before = bank.state_for_users(["user-0"])
    s = make_stream(40, seed=50, start=1000)
    bank.observe("user-0", *s.part(0, 40))
    assert bank.load_users(before) == 1
    assert bank.state_for_users(["user-0"]).keys() == before.keys()
    for k, v in bank.state_for_users(["user-0"]).items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop(PREFIX + "note_addresses"), "missing array"),
        (lambda s: s.__setitem__(PREFIX + "coords", s[PREFIX + "coords"][::-1]), "coordinates"),
        (lambda s: s.__setitem__(PREFIX + "meta", np.array([1, 8, CH, 8])), "key_dim"),
        (
            lambda s: s.__setitem__(PREFIX + "note_actions", s[PREFIX + "note_actions"][:-1]),
            "length",
        ),
        (
            lambda s: s.__setitem__(
                PREFIX + "note_addresses", s[PREFIX + "note_addresses"] * np.nan
            ),
            "non-finite",
        ),
        (lambda s: s.__setitem__(PREFIX + "user_note_offsets", np.array([0, 9, 3, 2])), "offsets"),
    ],
)
def test_bad_state_is_rejected_and_changes_nothing(mutate, message):
    bank, _ = _filled_bank()
    state = dict(bank.state_for_users(bank.users()))
    mutate(state)
    target = NoteBank(small_cfg(notes_per_user=5), K, CH, seed=3)
    s = make_stream(20, seed=60)
    target.observe("user-0", *s.part(0, 20))
    before = target.state_for_users(["user-0"])
    with pytest.raises(ValueError, match=message):
        target.load_users(state)
    with pytest.raises(ValueError, match=message):  # replace= drops nothing on a bad state
        target.load_users(state, replace=["user-0"])
    assert target.users() == ["user-0"]
    for k, v in target.state_for_users(["user-0"]).items():
        np.testing.assert_array_equal(v, before[k])


def test_other_seed_cannot_load():
    bank, _ = _filled_bank(n_users=1)
    with pytest.raises(ValueError, match="coordinates"):
        NoteBank(small_cfg(), K, CH, seed=4).load_users(bank.state_for_users(bank.users()))


def test_strings_round_trip_unicode():
    strings = ["", "Amélie (2001)", "x" * 300, "東京"]
    data, offsets = pack_strings(strings)
    assert data.dtype == np.uint8 and offsets.tolist()[0] == 0
    assert unpack_strings(data, offsets, "t") == strings


def test_load_with_replace_drops_users_absent_from_the_state():
    bank, _ = _filled_bank(n_users=2)
    state = bank.state_for_users(["user-0"])
    other = NoteBank(small_cfg(notes_per_user=5), K, CH, seed=3)  # same P as the source
    s = make_stream(20, seed=61)
    other.observe("user-1", *s.part(0, 20))
    other.observe("user-9", *s.part(0, 20))
    assert other.load_users(state, replace=["user-0", "user-1"]) == 1
    assert sorted(other.users()) == ["user-0", "user-9"]  # user-1 replaced by nothing
