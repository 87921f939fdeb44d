import pickle

import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from recmem.archive import NoteBank
from recmem.config import Config
from recmem.engine import Engine, group_events, group_events_reference
from recmem.engine.engine import _cut
from recmem.state_store import StateLayout, UserStateStore
from recmem.vocab import ItemVocab
from streams.batch import EventBatch, event_key
from streams.validate import ValidEvent


def small_config() -> Config:
    cfg = Config()
    cfg.memory.n_layers = 2
    cfg.memory.n_heads = 2
    cfg.memory.key_dim = 8
    cfg.memory.value_dim = 8
    cfg.memory.n_blocks = 4
    cfg.memory.horizon = 8
    cfg.model.embed_dim = 16
    cfg.model.n_oov_buckets = 8
    cfg.archive.address_dim = 4  # <= key_dim
    cfg.state.device_capacity = 64
    cfg.state.host_capacity = 64
    return cfg


def make_engine(tmp_path, cfg=None, capacity=None, host_capacity=None, seed=0, bank=None):
    cfg = cfg or small_config()
    torch.manual_seed(seed)
    vocab = ItemVocab([f"i{j}" for j in range(30)], cfg.model.n_oov_buckets)
    model = MemoryRecommender(vocab.n_items, vocab.n_oov, cfg.memory, cfg.model)
    store = UserStateStore(
        StateLayout.from_config(cfg.memory, cfg.model),
        capacity or cfg.state.device_capacity,
        cfg.state.host_capacity if host_capacity is None else host_capacity,
        tmp_path / "spill",
        device="cpu",
    )
    return Engine(model, vocab, store, cfg, bank=bank)


def random_events(n, n_users, seed=0, n_partitions=3):
    rng = np.random.default_rng(seed)
    out = []
    ts = 10**12
    for k in range(n):
        u = int(rng.integers(n_users))
        ts += int(rng.integers(0, 10**6))
        out.append(
            ValidEvent(
                user_id=f"user{u}",
                item_id=f"i{int(rng.integers(40))}",  # some unknown -> OOV buckets
                ts_ms=ts,
                action=int(rng.integers(6)),
                value=1.0,
                session_id=None,
                partition=u % n_partitions,
                offset=k,
            )
        )
    return out


def test_group_events_keeps_order_per_user():
    vocab = ItemVocab(["a", "b"], 4)
    ev = [
        ValidEvent("x", "a", 1, 0, 1.0, None, 0, 0),
        ValidEvent("y", "zzz", 2, 1, 1.0, None, 1, 0),
        ValidEvent("x", "b", 3, 2, 1.0, None, 0, 1),
        ValidEvent("x", "a", 4, 3, 1.0, None, 0, 2),
    ]
    g = group_events(ev, vocab)
    assert g.user_ids == ["x", "y"] and g.partitions == [0, 1]
    assert g.lengths.tolist() == [3, 1]
    assert g.items[0].tolist() == [0, 1, 0]
    assert g.items[1, 0] == vocab.encode_one("zzz") >= 2
    assert g.ts_ms.tolist() == [[1, 3, 4], [2, 0, 0]]
    assert g.actions[0].tolist() == [0, 2, 3]


def reference_states(engine, events):
    """Each user's whole sequence through advance from a zero state, one user at a time."""
    by_user: dict[str, list[ValidEvent]] = {}
    for e in events:
        by_user.setdefault(e.user_id, []).append(e)
    out = {}
    with torch.no_grad():
        for user, evs in by_user.items():
            g = group_events(evs, engine.vocab)
            res = engine.model.advance(
                torch.from_numpy(g.items),
                torch.from_numpy(g.actions),
                torch.from_numpy(g.ts_ms),
                torch.from_numpy(g.lengths),
                engine.model.init_state(1, "cpu"),
            )
            out[user] = res.state
    return out


@pytest.mark.parametrize(
    "capacity, host, buckets, cells",
    [(64, 64, "auto", 0), (64, 64, "off", 0), (5, 3, "on", 0), (5, 3, "off", 0),
     (64, 64, "off", 12), (5, 3, "off", 12)],
)  # fmt: skip
def test_micro_batches_equal_one_pass_per_user(tmp_path, capacity, host, buckets, cells):
    events = random_events(600, 25)
    cfg = small_config()
    cfg.state.length_buckets = buckets
    if cells:  # the padded path, whose pieces the cap cuts
        cfg.state.packed_advance = "off"
        cfg.state.piece_cells = cells
    engine = make_engine(tmp_path, cfg=cfg, capacity=capacity, host_capacity=host)
    total = 0
    for start in range(0, len(events), 37):
        chunk = events[start : start + 37]
        counts = engine.apply(chunk)
        assert counts.events == len(chunk)
        total += counts.events
    assert total == 600
    steps = engine.seconds["user_steps"]
    assert steps >= 600 and (buckets == "off" or steps < 2 * 600)
    ref = reference_states(engine, events)
    users = sorted(ref)
    got = engine.snapshot(users)
    for i, u in enumerate(users):
        want = ref[u]
        assert int(got.pos[i]) == int(want.pos[0]) == sum(e.user_id == u for e in events)
        assert int(got.last_ts[i]) == int(want.last_ts[0])
        torch.testing.assert_close(got.S[i], want.S[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.M[i], want.M[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.h[i], want.h[0], rtol=1e-4, atol=1e-5)
    # users are recorded under their partition
    for p in range(3):
        assert engine.users_of(p) == sorted(u for u in ref if int(u[4:]) % 3 == p)


def test_pieces_keep_to_the_cell_cap_and_the_slab():
    """state.piece_cells: pieces of consecutive rows (longest first), each at most ``cells``
    padded cells (rows x its first length) and ``most`` rows, one row at least."""
    lengths = np.array([50, 9, 7, 7, 3, 2, 2, 1, 1, 1, 1, 1], dtype=np.int64)
    rows = np.arange(len(lengths)) + 100
    got = _cut(rows, lengths, 64, 20)
    assert [p.tolist() for p in got] == [
        [100],
        [101, 102],
        [103, 104],
        [105, 106, 107, 108, 109, 110, 111],
    ]
    assert all(len(p) * lengths[p[0] - 100] <= 20 or len(p) == 1 for p in got)
    assert [p.tolist() for p in _cut(rows, lengths, 5, 0)] == [
        rows[:5].tolist(),
        rows[5:10].tolist(),
        rows[10:].tolist(),
    ]
    assert np.concatenate(_cut(rows, lengths, 3, 20)).tolist() == rows.tolist()


def test_snapshot_is_a_copy_and_unknown_users_are_zero(tmp_path):
    engine = make_engine(tmp_path)
    engine.apply(random_events(50, 4))
    snap = engine.snapshot(["user0", "nobody"])
    assert int(snap.pos[1]) == 0 and torch.count_nonzero(snap.S[1]) == 0
    before = engine.snapshot(["user0"]).S.clone()
    snap.S.add_(1.0)
    assert torch.equal(engine.snapshot(["user0"]).S, before)
    assert engine.known(["user0", "nobody"]) == [True, False]


def test_partition_export_adopt_and_drop(tmp_path):
    src = make_engine(tmp_path / "a")
    events = random_events(200, 12)
    src.apply(events)
    users = src.users_of(1)
    state = src.store.read(users)
    assert users and all(int(u[4:]) % 3 == 1 for u in users)
    dst = make_engine(tmp_path / "b")
    dst.adopt(1, users, state, [(users, src.export_arrays(users))])
    assert (
        dst.recent_events(users[0], 3).ts_ms.tolist()
        == src.recent_events(users[0], 3).ts_ms.tolist()
    )
    assert torch.equal(dst.snapshot(users).S, src.snapshot(users).S)
    assert dst.drop_partition(1) == len(users)
    assert dst.users_of(1) == [] and not any(dst.known(users))


class RecordingBank:
    """Stands in for the NoteBank: records what the engine's write path hands it."""

    def __init__(self):
        self.calls = []

    def observe_batch(
        self, user_ids, items, item_ids, actions, ts_ms, positions, lengths, k, q, packed=False
    ):
        shape = k.shape if not packed else (len(user_ids), int(lengths.max()), *k.shape[1:])
        if packed:
            assert k.shape[0] == q.shape[0] == int(lengths.sum())
        self.calls.append((list(user_ids), lengths.copy(), shape, positions.copy(), item_ids))


def test_notes_get_kq_and_lifetime_positions(tmp_path):
    bank = RecordingBank()
    engine = make_engine(tmp_path, bank=bank)
    events = random_events(40, 3)
    engine.apply(events[:20])
    n_first = len(bank.calls)
    engine.apply(events[20:])
    assert n_first >= 1 and len(bank.calls) > n_first
    before: dict[str, int] = {}
    for users, lengths, kshape, positions, item_ids in bank.calls:
        assert kshape == (len(users), int(lengths.max()), 2, 2, 8)
        for b, (u, n) in enumerate(zip(users, lengths)):
            # event j of the user is at its lifetime position before the step + j + 1
            assert positions[b, : int(n)].tolist() == list(
                range(before.get(u, 0) + 1, before.get(u, 0) + int(n) + 1)
            )
            assert len(item_ids[b]) == int(n)
            before[u] = before.get(u, 0) + int(n)
    # the latest events (routing queries) follow every user's last event
    for u in before:
        assert len(engine.recent_events(u, 1)) == 1


def test_bursts_run_in_aligned_chunks_and_equal_the_recurrent_path(tmp_path, monkeypatch):
    """Users with long runs in a micro-batch take the chunked CPU scan (auto); the states
    equal one event-at-a-time pass per user through the recurrent path."""
    from models.memory import ops

    calls = []
    real = ops.BACKENDS["chunk_aligned"]

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setitem(ops.BACKENDS, "chunk_aligned", counted)
    cfg = small_config()
    cfg.memory.horizon = 64  # Delta 16: aligned chunks of 16 events
    cfg.state.packed_advance = "off"  # the per-bucket path's choice of scan
    engine = make_engine(tmp_path, cfg=cfg)
    rng = np.random.default_rng(3)
    events, batches = [], []
    for _ in range(4):
        batch = []
        for u in range(5):
            for _ in range(int(rng.integers(0, 70))):
                ts = 10**12 + 1000 * len(events)
                e = ValidEvent(f"user{u}", f"i{int(rng.integers(40))}", ts, 1, 1.0, None, u % 3, 0)
                batch.append(e)
                events.append(e)
        batches.append(batch)
    for batch in batches:
        engine.apply(batch)
    assert calls and min(calls) >= ops.CPU_CHUNK_MIN_EVENTS
    monkeypatch.setattr(engine.model.mem_cfg, "backend", "recurrent")
    ref = reference_states(engine, events)
    users = sorted(ref)
    got = engine.snapshot(users)
    for i, u in enumerate(users):
        assert int(got.pos[i]) == int(ref[u].pos[0]) == sum(e.user_id == u for e in events)
        torch.testing.assert_close(got.S[i], ref[u].S[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.M[i], ref[u].M[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.h[i], ref[u].h[0], rtol=1e-4, atol=1e-5)


def test_duplicates_are_dropped_counted_and_kept_across_checkpoints(tmp_path):
    """The key is the event id when set, else (item, ts, action); a copy of one of the
    user's last ``dedupe_window`` events (or of an earlier one in the batch) is dropped."""
    cfg = small_config()
    cfg.state.dedupe_window = 4
    engine = make_engine(tmp_path / "a", cfg=cfg)
    e = [ValidEvent("u", f"i{k}", 1000 + k, 1, 1.0, None, 0, k) for k in range(6)]
    counts = engine.apply([e[0], e[1], e[0], e[2]])  # a copy inside the batch
    assert (counts.events, counts.duplicates) == (3, 1)
    counts = engine.apply([e[1], e[3]])  # a copy of a recent event
    assert (counts.events, counts.duplicates) == (1, 1)
    # another action, or the same fields under another event id, is another event
    other = ValidEvent("u", "i3", 1003, 2, 1.0, None, 0, 9)
    ided = [ValidEvent("u", "i4", 1004, 1, 1.0, None, 0, 10 + k, event_id=f"x{k}") for k in (1, 2)]
    counts = engine.apply([other, *ided])
    assert (counts.events, counts.duplicates) == (3, 0)
    assert engine.apply([ided[0]]).duplicates == 1
    assert engine.seen.dropped == 3 and int(engine.snapshot(["u"]).pos[0]) == 7
    # the window moved on: an old copy is applied again
    assert engine.apply([e[0]]).duplicates == 0
    # the keys travel with the checkpoint arrays
    restored = make_engine(tmp_path / "b", cfg=cfg)
    restored.adopt(0, ["u"], engine.store.read(["u"]), [(["u"], engine.export_arrays(["u"]))])
    assert restored.apply([ided[1]]).duplicates == 1
    cfg.state.dedupe_window = 0  # off: every event applies
    assert make_engine(tmp_path / "c", cfg=cfg).apply([e[0], e[0]]).events == 2


def test_columns_and_event_objects_apply_the_same(tmp_path):
    """A batch as columns (EventBatch, what consumer processes send) and the same batch as
    event objects give the same states, duplicates, positions, latest events and notes."""
    cfg = small_config()
    cfg.state.dedupe_window = 8
    rng = np.random.default_rng(3)
    events = [
        ValidEvent(f"u{u}", f"i{i}", 1000 + k, int(a), 1.0, None, int(u) % 3, k)
        for k, (u, i, a) in enumerate(
            zip(rng.integers(12, size=400), rng.integers(30, size=400), rng.integers(3, size=400))
        )
    ]
    # every tenth event sent twice: the copies are dropped by the duplicate policy
    events = [x for k, e in enumerate(events) for x in ([e, e] if k % 10 == 0 else [e])]
    m = cfg.memory
    a, b = (
        make_engine(
            tmp_path / n,
            cfg=cfg,
            bank=NoteBank(cfg.archive, m.key_dim, m.n_layers * m.n_heads, use_gpu=False),
        )  # fmt: skip
        for n in "ab"
    )
    for s in range(0, len(events), 110):
        part = events[s : s + 110]
        ca, cb = a.apply(part), b.apply(EventBatch.of(part))
        assert ca == cb
    assert a.seen.dropped == b.seen.dropped == 40
    users = sorted({e.user_id for e in events})
    sa, sb = a.snapshot(users), b.snapshot(users)
    assert torch.equal(sa.pos, sb.pos) and torch.equal(sa.S, sb.S) and torch.equal(sa.h, sb.h)
    assert [a.partition_of[u] for u in users] == [b.partition_of[u] for u in users]
    assert all(a.bank.note_count(u) == b.bank.note_count(u) for u in users)
    arrays_a, arrays_b = a.export_arrays(users), b.export_arrays(users)
    assert arrays_a.keys() == arrays_b.keys()
    for k in arrays_a:
        assert np.array_equal(arrays_a[k], arrays_b[k]), k


def test_event_batches_round_trip():
    events = [
        ValidEvent("u1", "i1", 5, 0, 1.0, None, 0, 7),
        ValidEvent("u2", "i2", 6, 2, 0.5, "s", 1, 8, event_id="e"),
        ValidEvent("u1", "i3", 7, 1, 2.0, None, 0, 9),
    ]
    batch = pickle.loads(pickle.dumps(EventBatch.of(events)))
    assert len(batch) == 3 and batch.events() == events
    assert batch.key.tolist() == [event_key(e) for e in events]
    assert batch.take(np.array([2, 0])).events() == [events[2], events[0]]
    assert batch.take(np.array([1])).events() == [events[1]]
    assert batch.take(np.zeros(0, np.int64)).events() == []
    assert EventBatch.of([]).events() == [] and len(EventBatch.of([])) == 0


@pytest.mark.parametrize(
    "unlock, order", [("surprise", "random"), ("drift", "prefix"), ("narrow", "reverse")]
)
def test_unlock_schedules_stream_through_the_engine(tmp_path, unlock, order):
    """Under an adaptive unlock schedule or a block order the engine's micro-batches give
    each user the state of one pass (unlock counts, signal sums and order keys included);
    InspectUser reports the blocks the user's state has open; a partition's states move
    with their schedule fields."""
    cfg = small_config()
    cfg.memory.unlock, cfg.memory.block_order = unlock, order
    cfg.memory.unlock_threshold = 0.8
    cfg.memory.horizon = 16  # decisions every 4 events
    cfg.model.window = 4
    engine = make_engine(tmp_path, cfg=cfg)
    events = random_events(400, 9)
    for start in range(0, len(events), 23):
        engine.apply(events[start : start + 23])
    ref = reference_states(engine, events)
    users = sorted(ref)
    got = engine.snapshot(users)
    for i, u in enumerate(users):
        for name in ("pos", "unlocks", "order_key"):
            a, b = getattr(got, name), getattr(ref[u], name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a[i], b[0]), (name, u)
        torch.testing.assert_close(got.S[i], ref[u].S[0], rtol=1e-4, atol=1e-5)
        if got.unlock_acc is not None:
            torch.testing.assert_close(
                got.unlock_acc[i], ref[u].unlock_acc[0], rtol=1e-4, atol=1e-5
            )
        info = engine.inspect(u)
        assert info is not None
        unlocks = 0 if got.unlocks is None else int(got.unlocks[i].max())
        assert info.unlocked_blocks == engine.model.sched.open_blocks(int(got.pos[i]), unlocks)
    if unlock == "narrow":
        assert all(engine.inspect(u).unlocked_blocks == 1 for u in users)  # type: ignore[union-attr]
    else:
        opened = [engine.inspect(u).unlocked_blocks for u in users]  # type: ignore[union-attr]
        assert max(opened) > 1
    dst = make_engine(tmp_path / "b", cfg=cfg)
    part = engine.users_of(1)
    dst.adopt(1, part, engine.store.read(part), [(part, engine.export_arrays(part))])
    a, b = dst.snapshot(part), engine.snapshot(part)
    for k, v in b.to_fields().items():
        assert torch.equal(a.to_fields()[k], v), k


@pytest.mark.parametrize("packed", [False, True])
def test_latest_events_are_the_last_keep_of_each_users_history(packed):
    """RecentEvents against a plain reference: after batches of 1 to 7 events per user
    (fewer, as many and more than ``keep``), each user's tail and its q~ are the last
    ``keep`` of everything observed, in order."""
    from recmem.engine import RecentEvents

    keep, rng = 4, np.random.default_rng(5)
    tails = RecentEvents(keep)
    history: dict[str, list[tuple[int, int, int, float]]] = {}
    step = 0
    for _ in range(6):
        users = [f"u{j}" for j in range(5)]
        lengths = rng.integers(0, 8, size=len(users))
        T = int(lengths.max())
        items = np.zeros((len(users), T), np.int64)
        actions, ts = items.copy(), items.copy()
        q = torch.zeros(len(users), T, 1, 1, 2)
        for b, u in enumerate(users):
            for t in range(int(lengths[b])):
                step += 1
                items[b, t], actions[b, t], ts[b, t] = step, step % 3, 1000 + step
                q[b, t] = float(step)
                history.setdefault(u, []).append((step, step % 3, 1000 + step, float(step)))
        q_in = q[torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]] if packed else q
        tails.observe(users, items, actions, ts, lengths, q_in, packed=packed)
        for u, events in history.items():
            want = events[-keep:]
            got = tails.recent(u, keep)
            assert got.items.tolist() == [e[0] for e in want]
            assert got.actions.tolist() == [e[1] for e in want]
            assert got.ts_ms.tolist() == [e[2] for e in want]
            queries = tails.recent_queries(u, keep)
            assert queries is not None
            assert queries[:, 0, 0, 0].tolist() == [e[3] for e in want]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("longest_first", [False, True])
def test_group_events_equals_the_reference(seed, longest_first):
    """The array grouping gives the plain loop's users, partitions, [B, T] arrays and
    lengths on random batches (skewed users, unknown items, one user, empty)."""
    rng = np.random.default_rng(seed)
    vocab = ItemVocab([f"i{j}" for j in range(30)], 8)
    for n, n_users in [(0, 1), (1, 1), (50, 1), (300, 7), (2000, 500)]:
        events = random_events(n, n_users, seed=int(rng.integers(1 << 30)))
        for batch in (events, EventBatch.of(events)):
            got = group_events(batch, vocab, longest_first=longest_first)
            want = group_events_reference(batch, vocab, longest_first=longest_first)
            if longest_first and n:
                assert (np.diff(got.lengths) <= 0).all()
            assert got.user_ids == want.user_ids and got.partitions == want.partitions
            for f in ("items", "actions", "ts_ms", "lengths"):
                assert np.array_equal(getattr(got, f), getattr(want, f)), f
                assert getattr(got, f).dtype == getattr(want, f).dtype, f


def test_vocab_encode_equals_encode_one():
    vocab = ItemVocab([f"i{j}" for j in range(30)], 8)
    ids = [f"i{j}" for j in np.random.default_rng(0).integers(60, size=500)]
    want = [vocab.encode_one(i) for i in ids]
    assert vocab.encode(ids).tolist() == want
    assert vocab.encode(iter(ids)).tolist() == want  # any iterable
    assert vocab.encode([]).dtype == np.int64 and len(vocab.encode([])) == 0


@pytest.mark.parametrize("seed", range(4))
def test_partition_bookkeeping_equals_the_reference(tmp_path, seed):
    """``_record_many`` leaves the same partitions, users per partition and dirty sets as
    the per-user loop, users moving between partitions included."""
    rng = np.random.default_rng(seed)
    a, b = make_engine(tmp_path / "a"), make_engine(tmp_path / "b")
    for _ in range(20):
        n = int(rng.integers(0, 40))
        users = [f"u{u}" for u in rng.choice(60, size=n, replace=False)]
        parts = rng.integers(1 if rng.random() < 0.3 else 4, size=n).tolist()
        a._record_many(users, parts)
        b._record_reference(users, parts)
        assert a.partition_of == b.partition_of
        assert a._users_of == b._users_of and a._dirty == b._dirty
        if rng.random() < 0.3:
            p = int(rng.integers(4))
            a.clear_dirty(p)
            b.clear_dirty(p)


@pytest.mark.parametrize("packed, buckets", [("on", "off"), ("off", "on"), ("off", "off")])
def test_apply_in_plan_order_equals_first_appearance_order(tmp_path, packed, buckets):
    """``apply`` groups longest first and hands pieces views of the batch's rows; the
    same events grouped in first-appearance order (``apply_grouped``: pieces copied out
    of the batch) give the same states, latest events, notes and checkpoint arrays,
    also when a batch is cut into slab-sized pieces and length buckets."""
    cfg = small_config()
    cfg.state.dedupe_window = 0  # apply_grouped has no duplicate policy
    cfg.state.packed_advance = packed
    cfg.state.length_buckets = buckets
    m = cfg.memory
    a, b = (
        make_engine(
            tmp_path / n,
            cfg=cfg,
            capacity=7,
            host_capacity=64,
            bank=NoteBank(cfg.archive, m.key_dim, m.n_layers * m.n_heads, use_gpu=False),
        )  # fmt: skip
        for n in "ab"
    )
    events = random_events(900, 12, seed=5)
    for s in range(0, len(events), 150):
        part = events[s : s + 150]
        assert a.apply(part) == b.apply_grouped(group_events_reference(part, b.vocab))
    users = sorted({e.user_id for e in events})
    sa, sb = a.snapshot(users), b.snapshot(users)
    assert torch.equal(sa.pos, sb.pos) and torch.equal(sa.S, sb.S) and torch.equal(sa.h, sb.h)
    assert sum(a.bank.note_count(u) for u in users) > 0
    arrays_a, arrays_b = a.export_arrays(users), b.export_arrays(users)
    assert arrays_a.keys() == arrays_b.keys()
    for k in arrays_a:
        assert np.array_equal(arrays_a[k], arrays_b[k]), k
    assert a.partition_of == b.partition_of and a._dirty == b._dirty
