"""NoteBank's vectorised write path (open chunks in one arena, recmem/archive/open_chunks.py)
against its plain reference PlainNoteBank (one PendingEvents per user), on random batches:
the same notes, open chunks, checkpoint arrays, rejections and warnings."""

import logging

import numpy as np
import pytest
import torch

from recmem.archive import ItemIdRows, NoteBank, PlainNoteBank
from recmem.config import ArchiveConfig
from recmem.rows import ragged_arange

L, H, K = 2, 2, 8
CH = L * H


def cfg(chunk: int, notes: int) -> ArchiveConfig:
    return ArchiveConfig(
        chunk_events=chunk, window=min(2, chunk), spans_per_chunk=2, max_span=3,
        session_gap_s=30.0, address_dim=6, notes_per_user=notes, replay_notes=2,
    )  # fmt: skip


def assert_same(fast: NoteBank, plain: NoteBank, users: list[str]) -> None:
    assert fast.users() == plain.users()
    for u in users:
        assert fast.pending_count(u) == plain.pending_count(u), u
        a, b = fast.notes(u), plain.notes(u)
        assert len(a) == len(b), u
        for x, y in zip(a, b):
            assert x.serial == y.serial and x.item_ids == y.item_ids and x.votes == y.votes
            for f in ("items", "actions", "ts_ms", "positions", "addresses"):
                vx, vy = getattr(x, f), getattr(y, f)
                assert vx.dtype == vy.dtype and vx.shape == vy.shape
                assert vx.tobytes() == vy.tobytes(), (u, f)
            assert all(type(i) is str for i in x.item_ids)
    sa, sb = fast.state_for_users(users), plain.state_for_users(users)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
        assert sa[key].tobytes() == sb[key].tobytes(), key


class Feed:
    """Random batches for a fixed set of users, each user's positions counting up (with
    deliberate faults: repeated positions, non-finite keys, wrong item id counts)."""

    def __init__(self, seed: int, n_users: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.users = [f"u{i}" for i in range(n_users)]
        self.pos = dict.fromkeys(self.users, 0)
        self.ts = dict.fromkeys(self.users, 1_700_000_000_000)

    def batch(self, chunk: int, faults: bool, dup: bool) -> tuple[list, dict]:
        rng = self.rng
        B = int(rng.integers(1, 9 if dup else len(self.users) + 1))
        users = list(rng.choice(self.users, size=B, replace=dup))
        # lengths: many 0 / 1 / 2, sometimes several chunks at once
        lens = np.array(
            [
                int(rng.choice([0, 1, 1, 2, 3, chunk - 1, chunk, 2 * chunk + 1, 3 * chunk]))
                for _ in users
            ],
            dtype=np.int64,
        )
        T = max(int(lens.max()), 1)
        items = np.zeros((B, T), np.int64)
        actions, ts, pos = items.copy(), items.copy(), items.copy()
        ids = []
        for b, (u, n) in enumerate(zip(users, lens.tolist())):
            items[b, :n] = rng.integers(0, 40, n)
            actions[b, :n] = rng.integers(0, 5, n)
            step = rng.integers(0, 60_000, n)
            ts[b, :n] = self.ts[u] + np.cumsum(step)
            p = self.pos[u] + np.arange(1, n + 1)
            if faults and n and rng.random() < 0.08:
                p = p - int(rng.integers(1, 3))  # overlaps what was seen: rejected
            elif faults and n > 1 and rng.random() < 0.05:
                p[-1] = p[-2]  # not increasing inside the batch
            else:
                self.pos[u] += n
                self.ts[u] = int(ts[b, n - 1]) if n else self.ts[u]
            pos[b, :n] = p
            ids.append([f"item-{i}" for i in items[b, :n]])
            if faults and n and rng.random() < 0.04:
                ids[-1] = ids[-1][:-1]
        k = rng.normal(size=(B, T, L, H, K)).astype(np.float32)
        q = rng.normal(size=(B, T, L, H, K)).astype(np.float32)
        k[..., 0] += 3.0 * (rng.random((B, T, L, H)) < 0.2)  # a few distinctive events
        q[rng.random((B, T)) < 0.1, :, :, : K // 2] = 0.0
        for b, n in enumerate(lens.tolist()):
            if faults and n and rng.random() < 0.04:
                k[b, int(rng.integers(0, n)), 0, 0, 0] = np.nan
            k[b, n:] = np.nan if rng.random() < 0.5 else 0.0  # padding is never read
        return users, dict(
            items=items, ids=ids, actions=actions, ts=ts, pos=pos, lens=lens, k=k, q=q
        )


def observe(bank: NoteBank, users, d, packed: bool, flat_ids: bool) -> int:
    ids = d["ids"]
    if flat_ids and all(len(x) == n for x, n in zip(ids, d["lens"])):
        flat = np.empty(int(d["lens"].sum()), dtype=object)
        flat[:] = [i for x in ids for i in x]
        ids = ItemIdRows(flat, d["lens"])
    k, q = torch.from_numpy(d["k"]), torch.from_numpy(d["q"])
    if packed:
        valid = np.arange(k.shape[1])[None, :] < d["lens"][:, None]
        k, q = k[torch.from_numpy(valid)], q[torch.from_numpy(valid)]
    return bank.observe_batch(
        users, d["items"], ids, d["actions"], d["ts"], d["pos"], d["lens"], k, q, packed=packed
    )


@pytest.mark.parametrize("seed", range(16))
def test_vectorised_write_path_equals_the_plain_reference(seed, caplog):
    rng = np.random.default_rng(1000 + seed)
    chunk = int(rng.choice([1, 2, 3, 5, 8]))
    c = cfg(chunk, notes=int(rng.choice([1, 3, 50])))
    fast, plain = NoteBank(c, K, CH, seed=seed), PlainNoteBank(c, K, CH, seed=seed)
    feed = Feed(seed, n_users=int(rng.integers(2, 12)))
    for step in range(60):
        users, d = feed.batch(chunk, faults=seed % 2 == 0, dup=step % 7 == 3)
        packed, flat_ids = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="recmem.archive.bank"):
            n_fast = observe(fast, users, d, packed, flat_ids)
            warned_fast = [r.getMessage() for r in caplog.records]
            caplog.clear()
            n_plain = observe(plain, users, d, packed, flat_ids)
            warned_plain = [r.getMessage() for r in caplog.records]
        assert n_fast == n_plain
        assert warned_fast == warned_plain
        assert_same(fast, plain, feed.users)
        if step % 9 == 8:
            # checkpoint round trips between batches, both ways, some users dropped
            some = [u for u in feed.users if rng.random() < 0.5]
            state = plain.state_for_users(some)
            gone = [u for u in feed.users if rng.random() < 0.2]
            for bank in (fast, plain):
                bank.drop_users(gone)
                bank.load_users(state, replace=some)
            assert_same(fast, plain, feed.users)
            state = fast.state_for_users(feed.users)
            fast, plain2 = NoteBank(c, K, CH, seed=seed), PlainNoteBank(c, K, CH, seed=seed)
            fast.load_users(state)
            plain2.load_users(plain.state_for_users(feed.users))
            plain = plain2
            assert_same(fast, plain, feed.users)


def test_single_user_observe_equals_the_plain_reference():
    rng = np.random.default_rng(5)
    c = cfg(4, notes=3)
    fast, plain = NoteBank(c, K, CH, seed=1), PlainNoteBank(c, K, CH, seed=1)
    pos = 0
    for _ in range(40):
        n = int(rng.integers(0, 10))
        p = np.arange(pos + 1, pos + n + 1)
        bad = n > 0 and rng.random() < 0.15
        if bad:
            p = p - 1
        args = (
            rng.integers(0, 9, n), [str(i) for i in range(n)], np.zeros(n, np.int64),
            np.arange(n) * 1000, p, rng.normal(size=(n, CH, K)), rng.normal(size=(n, L, H, K)),
        )  # fmt: skip
        results = []
        for bank in (fast, plain):
            try:
                results.append(bank.observe("a", *args))
            except ValueError as e:
                results.append(str(e))
        assert results[0] == results[1]
        if not bad:
            pos += n
        assert_same(fast, plain, ["a"])


def test_a_checkpoint_with_a_longer_open_chunk_loads_and_closes_on_the_next_batch():
    """A checkpoint written with larger chunks (an open chunk longer than this bank's)."""
    rng = np.random.default_rng(2)
    big = PlainNoteBank(cfg(12, notes=50), K, CH, seed=0)
    n = 11
    big.observe(
        "a", np.arange(n), [str(i) for i in range(n)], np.zeros(n), np.arange(n) * 1000,
        np.arange(1, n + 1), rng.normal(size=(n, CH, K)), rng.normal(size=(n, CH, K)),
    )  # fmt: skip
    state = big.state_for_users(["a"])
    fast, plain = NoteBank(cfg(4, 50), K, CH), PlainNoteBank(cfg(4, 50), K, CH)
    k, q = rng.normal(size=(1, CH, K)), rng.normal(size=(1, CH, K))
    for bank in (fast, plain):
        bank.load_users(state)
        assert bank.pending_count("a") == 11
    assert_same(fast, plain, ["a"])
    for bank in (fast, plain):
        bank.observe("a", [1], ["x"], [0], [20_000], [n + 1], k, q)
    assert fast.pending_count("a") == 0 and fast.note_count("a") > 0
    assert_same(fast, plain, ["a"])


def test_ragged_arange():
    starts, lens = np.array([5, 0, 9, 2]), np.array([2, 0, 3, 1])
    want = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    np.testing.assert_array_equal(ragged_arange(starts, lens), want)
    assert len(ragged_arange(np.zeros(0), np.zeros(0))) == 0


def test_item_id_rows_act_as_a_list_per_user():
    rows = ItemIdRows(np.array(["a", "b", "c"], dtype=object), [2, 0, 1])
    assert len(rows) == 3
    assert list(rows[0]) == ["a", "b"] and list(rows[1]) == [] and list(rows[-1]) == ["c"]
    assert [list(r) for r in rows[1:]] == [[], ["c"]]
    with pytest.raises(IndexError):
        rows[3]
    with pytest.raises(ValueError):
        ItemIdRows(np.array(["a"], dtype=object), [2])


def test_the_arena_grows_and_reuses_freed_slots_and_rows():
    """Past the first slot and row capacity (4096 events, 1024 users), with users dropped
    and chunks closing between batches (their rows and slots reused)."""
    rng = np.random.default_rng(9)
    c = cfg(8, notes=4)
    fast, plain = NoteBank(c, K, CH, seed=2), PlainNoteBank(c, K, CH, seed=2)
    users = [f"u{i}" for i in range(1500)]
    done = dict.fromkeys(users, 0)
    for step in range(5):
        B = len(users)
        lens = rng.integers(1, 6, B)
        T = int(lens.max())
        pos = np.array([done[u] for u in users])[:, None] + np.arange(1, T + 1)[None, :]
        for u, n in zip(users, lens.tolist()):
            done[u] += n
        items = rng.integers(0, 50, (B, T))
        ids = [[str(i) for i in items[b, : lens[b]]] for b in range(B)]
        k = rng.normal(size=(B, T, CH, K)).astype(np.float32)
        q = rng.normal(size=(B, T, CH, K)).astype(np.float32)
        ts = np.cumsum(rng.integers(0, 9000, (B, T)), axis=1)
        for bank in (fast, plain):
            bank.observe_batch(users, items, ids, np.zeros_like(items), ts, pos, lens, k, q)
        if step == 2:
            gone = users[::3]
            for bank in (fast, plain):
                bank.drop_users(gone)
            for u in gone:
                done[u] = 0
        assert_same(fast, plain, users)
    assert fast._open.events.capacity > 4096 and fast._open.rows.capacity > 1024
