from dataclasses import dataclass

import numpy as np
import pytest
import torch

from recmem.archive import NoteBank, replay_events
from recmem.archive.selection import l2_normalise
from recmem.config import ArchiveConfig

L, H, K = 2, 2, 16
CH = L * H
CUDA = torch.cuda.is_available()


def small_cfg(**kw) -> ArchiveConfig:
    base = dict(
        chunk_events=16,
        window=2,
        spans_per_chunk=2,
        max_span=3,
        session_gap_s=0.0,
        address_dim=8,
        notes_per_user=64,
        replay_notes=2,
    )
    base.update(kw)
    return ArchiveConfig(**base)


@dataclass
class Stream:
    """One user's events with their keys and queries."""

    items: np.ndarray
    item_ids: list[str]
    actions: np.ndarray
    ts_ms: np.ndarray
    positions: np.ndarray
    k: np.ndarray
    q: np.ndarray

    def part(self, a: int, b: int) -> tuple:
        return (
            self.items[a:b],
            self.item_ids[a:b],
            self.actions[a:b],
            self.ts_ms[a:b],
            self.positions[a:b],
            self.k[a:b],
            self.q[a:b],
        )


def make_stream(n: int, seed: int, planted: tuple[int, ...] = (), start: int = 1) -> Stream:
    """Near-constant keys per channel (random keys at ``planted`` events), random queries."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(1, CH, K))
    k = base + 0.02 * rng.normal(size=(n, CH, K))
    for t in planted:
        k[t] = rng.normal(size=(CH, K))
    items = rng.integers(0, 1000, size=n) + 1000 * seed
    return Stream(
        items=items,
        item_ids=[f"u{seed}-i{i}" for i in items],
        actions=rng.integers(0, 6, size=n),
        ts_ms=1_700_000_000_000 + np.arange(n) * 60_000,
        positions=np.arange(start, start + n),
        k=l2_normalise(k),
        q=l2_normalise(rng.normal(size=(n, CH, K))),
    )


def test_chunk_close_writes_notes_around_planted_events():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(20, seed=1, planted=(5, 12))
    assert bank.observe("a", *s.part(0, 15)) == 0
    assert bank.pending_count("a") == 15 and bank.note_count("a") == 0
    assert bank.observe("a", *s.part(15, 20)) == 2
    assert bank.pending_count("a") == 4
    notes = bank.notes("a")
    assert [n.serial for n in notes] == [0, 1]
    assert 5 + 1 in notes[0].positions and 12 + 1 in notes[1].positions
    for n in notes:
        assert 1 <= len(n) <= 3
        idx = n.positions - 1
        assert np.array_equal(n.items, s.items[idx]) and np.array_equal(n.ts_ms, s.ts_ms[idx])
        assert np.array_equal(n.actions, s.actions[idx])
        assert n.item_ids == tuple(s.item_ids[i] for i in idx)


def test_note_address_is_p_q_at_channel_most_distinctive_event():
    bank = NoteBank(small_cfg(spans_per_chunk=1, max_span=1, window=1), K, CH, seed=4)
    s = make_stream(16, seed=2, planted=(9,))
    bank.observe("a", *s.part(0, 16))
    (note,) = bank.notes("a")
    assert note.positions.tolist() == [10]
    expected = l2_normalise(s.q[9][:, bank.coords])
    np.testing.assert_allclose(note.addresses, expected, atol=2e-3)  # stored as float16
    assert note.addresses.dtype == np.float32


def test_route_returns_planted_note_for_its_address():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(64, seed=3, planted=(3, 20, 40, 60))
    bank.observe("a", *s.part(0, 64))
    notes = bank.notes("a")
    assert len(notes) == 8
    target = notes[5]
    (routed,) = bank.route_addresses("a", target.addresses, r=1)
    assert routed.serial == target.serial and routed.votes == CH
    q = np.zeros((CH, K), np.float32)
    q[:, bank.coords] = target.addresses
    assert [n.serial for n in bank.route("a", q, r=1)] == [target.serial]
    assert [n.serial for n in bank.route("a", torch.from_numpy(q).view(L, H, K), r=1)] == [
        target.serial
    ]
    # a one-layer model whose head count equals C_ch: [n, 1, C_ch, K] is [n, L, H, K]
    assert [n.serial for n in bank.route("a", q.reshape(1, 1, CH, K), r=1)] == [target.serial]


def test_votes_top_r_and_chronological_order():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(64, seed=5, planted=(3, 20, 40, 60))
    bank.observe("a", *s.part(0, 64))
    notes = bank.notes("a")
    # channel 0, 1: note 6; channel 2: note 1; channel 3: note 4 -> votes 2, 1, 1
    u = np.stack([notes[6].addresses[0], notes[6].addresses[1], notes[1].addresses[2],
                  notes[4].addresses[3]])  # fmt: skip
    assert [n.serial for n in bank.route_addresses("a", u, r=1)] == [6]
    routed = bank.route_addresses("a", u, r=3)
    assert [(n.serial, n.votes) for n in routed] == [(1, 1), (4, 1), (6, 2)]  # chronological
    everything = bank.route_addresses("a", u, r=10)  # unvoted notes fill up to r
    assert [n.serial for n in everything] == list(range(8))
    assert sum(n.votes for n in everything) == CH
    ev = replay_events(routed)
    assert np.all(np.diff(ev.positions) > 0)
    assert len(ev) == sum(len(notes[i]) for i in (1, 4, 6))


def test_min_votes_drops_notes_with_fewer_votes():
    s = make_stream(64, seed=5, planted=(3, 20, 40, 60))
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    bank.observe("a", *s.part(0, 64))
    notes = bank.notes("a")
    u = np.stack([notes[6].addresses[0], notes[6].addresses[1], notes[1].addresses[2],
                  notes[4].addresses[3]])  # fmt: skip  # votes: note 6: 2, notes 1, 4: 1
    for m, want in [(0, list(range(8))), (1, [1, 4, 6]), (2, [6]), (3, [])]:
        strict = NoteBank(small_cfg(min_votes=m), K, CH, seed=0)
        strict.observe("a", *s.part(0, 64))
        assert [n.serial for n in strict.route_addresses("a", u, r=10)] == want
    strict = NoteBank(small_cfg(min_votes=1), K, CH, seed=0)
    strict.observe("a", *s.part(0, 64))
    top2 = [n.serial for n in strict.route_addresses("a", u, r=2)]  # the top R, then the cut
    assert len(top2) == 2 and 6 in top2 and set(top2) <= {1, 4, 6}
    with pytest.raises(ValueError, match="min_votes"):
        NoteBank(small_cfg(min_votes=-1), K, CH)


def _oracle_route(notes, u: np.ndarray, r: int) -> list[int]:
    """Votes (max over positions, argmax per channel), then summed best cosine, then recency;
    cosine on each address's nonzero prefix."""
    unit = l2_normalise(u)
    rho = np.stack([n.addresses for n in notes])
    cos = np.zeros((len(unit), CH, len(notes)))
    for t, c, i in np.ndindex(*cos.shape):
        m = np.flatnonzero(rho[i, c])
        m = m[-1] + 1 if len(m) else 0
        head = np.linalg.norm(unit[t, c, :m])
        cos[t, c, i] = unit[t, c, :m] @ rho[i, c, :m] / head if head > 1e-6 else 0.0
    best = cos.max(axis=0)  # [C, N]
    votes = np.bincount(best.argmax(axis=1), minlength=len(notes))
    strength = best.sum(axis=0)
    order = sorted(range(len(notes)), key=lambda i: (-votes[i], -strength[i], -i))
    return sorted(order[:r])


def test_route_matches_numpy_oracle_with_masked_addresses():
    bank = NoteBank(small_cfg(), K, CH, seed=2)
    s = make_stream(96, seed=21, planted=(3, 20, 40, 60, 80))
    s.q[:48, :, K // 2 :] = 0.0  # early events: the later key blocks still locked (Proteus)
    bank.observe("a", *s.part(0, 96))
    notes = bank.notes("a")
    assert notes[0].addresses[0, -1] == 0 and notes[-1].addresses[0, -1] != 0
    rng = np.random.default_rng(0)
    for trial in range(20):
        n_q, r = 1 + trial % 4, 1 + trial % 5
        u = rng.normal(size=(n_q, CH, 8)).astype(np.float32)
        got = [n.serial for n in bank.route_addresses("a", u, r=r)]
        assert got == [notes[i].serial for i in _oracle_route(notes, u, r)]


def test_each_channel_votes_once_with_max_over_query_positions():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(32, seed=6, planted=(3, 20))
    bank.observe("a", *s.part(0, 32))
    notes = bank.notes("a")
    u = np.stack([notes[0].addresses, notes[2].addresses])
    u[1, :3] = 0.0  # channels 0..2 vote from position 0, channel 3 from position 1
    u[0, 3] = 0.0
    routed = bank.route_addresses("a", u, r=4)
    assert {n.serial: n.votes for n in routed if n.votes} == {0: 3, 2: 1}
    assert bank.route_addresses("a", np.zeros((2, CH, 8)), r=4) == []


def test_user_isolation_and_unknown_user():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    a, b = make_stream(32, seed=7, planted=(4,)), make_stream(32, seed=8, planted=(9,))
    bank.observe("a", *a.part(0, 32))
    bank.observe("b", *b.part(0, 32))
    for note in bank.notes("b"):
        routed = bank.route_addresses("a", note.addresses, r=4)
        assert routed and all(set(n.item_ids) <= set(a.item_ids) for n in routed)
    assert bank.route_addresses("nobody", bank.notes("b")[0].addresses) == []
    assert bank.route("nobody", a.q[:2]) == []


def test_cap_evicts_oldest_and_index_follows():
    bank = NoteBank(small_cfg(notes_per_user=3), K, CH, seed=0)
    s = make_stream(48, seed=9, planted=(2, 18, 34))
    written = bank.observe("a", *s.part(0, 48))
    assert written == 6
    notes = bank.notes("a")
    assert [n.serial for n in notes] == [3, 4, 5]
    for n in notes:
        assert bank.route_addresses("a", n.addresses, r=1)[0].serial == n.serial
    s2 = make_stream(16, seed=10, start=49)
    bank.observe("a", *s2.part(0, 16))
    assert [n.serial for n in bank.notes("a")] == [5, 6, 7]


def test_buffering_one_event_at_a_time_equals_all_at_once():
    s = make_stream(70, seed=11, planted=(5, 30, 50))
    whole, single, mixed = (NoteBank(small_cfg(), K, CH, seed=0) for _ in range(3))
    whole.observe("a", *s.part(0, 70))
    for t in range(70):
        single.observe("a", *s.part(t, t + 1))
    for a, b in [(0, 3), (3, 20), (20, 21), (21, 70)]:
        mixed.observe("a", *s.part(a, b))
    ref = whole.notes("a")
    assert len(ref) == 8
    for other in (single, mixed):
        got = other.notes("a")
        assert [n.positions.tolist() for n in got] == [n.positions.tolist() for n in ref]
        for x, y in zip(got, ref):
            np.testing.assert_array_equal(x.addresses, y.addresses)
        assert other.pending_count("a") == whole.pending_count("a") == 70 - 64


def test_observe_batch_matches_per_user_observe():
    streams = [make_stream(40, seed=s, planted=(7,)) for s in (12, 13)]
    lengths = [40, 25]
    T = 40
    pad = np.zeros((2, T), dtype=np.int64)
    items, actions, ts, pos = pad.copy(), pad.copy(), pad.copy(), pad.copy()
    k = np.zeros((2, T, L, H, K), np.float32)
    q = np.zeros_like(k)
    for b, (s, n) in enumerate(zip(streams, lengths)):
        items[b, :n], actions[b, :n], ts[b, :n] = s.items[:n], s.actions[:n], s.ts_ms[:n]
        pos[b, :n] = s.positions[:n]
        k[b, :n], q[b, :n] = s.k[:n].reshape(n, L, H, K), s.q[:n].reshape(n, L, H, K)
    batch = NoteBank(small_cfg(), K, CH, seed=0)
    ids = [s.item_ids[:n] for s, n in zip(streams, lengths)]
    written = batch.observe_batch(
        ["x", "y"], torch.from_numpy(items), ids, actions, ts, pos, lengths,
        torch.from_numpy(k), torch.from_numpy(q),
    )  # fmt: skip
    single = NoteBank(small_cfg(), K, CH, seed=0)
    assert written == sum(
        single.observe(u, *s.part(0, n)) for u, s, n in zip("xy", streams, lengths)
    )
    for u in "xy":
        assert [n.positions.tolist() for n in batch.notes(u)] == [
            n.positions.tolist() for n in single.notes(u)
        ]
        assert batch.pending_count(u) == single.pending_count(u)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ],
)
def test_observe_batch_on_tensors_equals_it_on_numpy_arrays(caplog, device):
    """Tensors on a GPU are normalised there (``_units_of_tensors``, also called directly
    here on the CPU); numpy arrays and CPU tensors by ``l2_normalise``: the same notes, the
    same pending units within half-float rounding, a user with a non-finite key skipped on
    both, a malformed k refused on both."""
    streams = [make_stream(40, seed=s, planted=(7,)) for s in (21, 22, 23)]
    n = 40
    items = np.stack([s.items[:n] for s in streams])
    cols = [
        np.stack([getattr(s, f)[:n] for s in streams]) for f in ("actions", "ts_ms", "positions")
    ]
    k = np.stack([s.k[:n].reshape(n, L, H, K) for s in streams]).astype(np.float32)
    q = np.stack([s.q[:n].reshape(n, L, H, K) for s in streams]).astype(np.float32)
    k[1, 3, 0, 0, 0] = np.nan  # user y: rejected
    k[2, 5] = 0.0  # a zero key: stays zero
    ids = [s.item_ids[:n] for s in streams]
    users = ["x", "y", "z"]
    banks = []
    for kk, qq in ((k, q), (torch.from_numpy(k).to(device), torch.from_numpy(q).to(device))):
        bank = NoteBank(small_cfg(), K, CH, seed=0)
        bank.observe_batch(users, items, ids, *cols, [n, n, n], kk, qq)
        banks.append(bank)
        with pytest.raises(ValueError, match="k and q must be"):
            bank.observe_batch(users, items, ids, *cols, [n, n, n], kk[..., :-1], qq)
    ref, got = banks
    assert caplog.text.count("skipped 40 events of user 'y'") == 2
    assert ref.note_count("y") == got.note_count("y") == 0
    for u in ("x", "z"):
        assert ref.note_count(u) > 0
        assert [m.positions.tolist() for m in got.notes(u)] == [
            m.positions.tolist() for m in ref.notes(u)
        ]
        for a, b in zip(got.notes(u), ref.notes(u), strict=True):
            np.testing.assert_allclose(a.addresses, b.addresses, rtol=2e-3, atol=2e-3)
    units, addr, finite = got._units_of_tensors(
        torch.from_numpy(k).to(device), torch.from_numpy(q).to(device), 3 * n
    )
    assert units.dtype == addr.dtype == np.float16 and addr.shape[-1] == len(got.coords)
    assert finite.tolist() == [i != n + 3 for i in range(3 * n)]
    assert not units[2 * n + 5].any()  # the zero key
    want = l2_normalise(k.reshape(3 * n, CH, K)).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(units[finite].astype(np.float32), want[finite], atol=1e-3)


def test_observe_batch_takes_packed_keys_as_sequences():
    s = make_stream(40, seed=24, planted=(7,))
    args = (["a"], s.items[None, :40], [s.item_ids[:40]], s.actions[None, :40])
    rest = (s.ts_ms[None, :40], s.positions[None, :40], [40])
    k, q = (x[:40].reshape(40, CH, K) for x in (s.k, s.q))
    ref, seq = NoteBank(small_cfg(), K, CH, seed=0), NoteBank(small_cfg(), K, CH, seed=0)
    assert ref.observe_batch(*args, *rest, k, q, packed=True) > 0
    assert seq.observe_batch(*args, *rest, k.tolist(), q.tolist(), packed=True) == ref.note_count(
        "a"
    )
    for a, b in zip(seq.notes("a"), ref.notes("a"), strict=True):
        np.testing.assert_array_equal(a.addresses, b.addresses)


def test_bad_input_is_rejected_without_changing_state():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(20, seed=14)
    bank.observe("a", *s.part(0, 10))
    with pytest.raises(ValueError, match="positions must increase"):
        bank.observe("a", *s.part(5, 12))
    assert bank.pending_count("a") == 10
    bad = list(s.part(10, 12))
    bad[5] = np.zeros((2, CH + 1, K))
    with pytest.raises(ValueError, match="keys must be"):
        bank.observe("a", *bad)
    bad = list(s.part(10, 12))
    bad[1] = ["only-one"]
    with pytest.raises(ValueError, match="differ in length"):
        bank.observe("a", *bad)
    with pytest.raises(ValueError, match="query addresses"):
        bank.route_addresses("a", np.zeros((1, CH, 3)))
    with pytest.raises(ValueError, match="window"):
        NoteBank(small_cfg(window=100), K, CH)
    # d_rho above K selects every key coordinate instead of failing
    assert len(NoteBank(small_cfg(address_dim=K + 1), K, CH).coords) == K
    assert bank.pending_count("a") == 10


def test_observe_batch_skips_a_rejected_user_and_keeps_the_others(caplog):
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    a, b = make_stream(20, seed=15), make_stream(20, seed=16)
    bank.observe("a", *a.part(0, 10))
    items = np.stack([a.items[:20], b.items[:20]])  # user a's events 1..10 again: rejected
    k = np.stack([a.k[:20], b.k[:20]])
    q = np.stack([a.q[:20], b.q[:20]])
    written = bank.observe_batch(
        ["a", "b"], items, [a.item_ids[:20], b.item_ids[:20]],
        np.stack([a.actions[:20], b.actions[:20]]), np.stack([a.ts_ms[:20], b.ts_ms[:20]]),
        np.stack([a.positions[:20], b.positions[:20]]), [20, 20], k, q,
    )  # fmt: skip
    assert written == 2 and bank.note_count("b") == 2
    assert bank.pending_count("a") == 10 and bank.note_count("a") == 0
    assert "skipped 20 events of user 'a'" in caplog.text


def test_half_precision_tensors_are_accepted():
    s = make_stream(16, seed=17, planted=(3,))
    ref, half = NoteBank(small_cfg(), K, CH, seed=0), NoteBank(small_cfg(), K, CH, seed=0)
    ref.observe("a", *s.part(0, 16))
    args = list(s.part(0, 16))
    args[5] = torch.from_numpy(s.k).to(torch.bfloat16)
    args[6] = torch.from_numpy(s.q).to(torch.float16)
    assert half.observe("a", *args) == 2
    assert [n.positions.tolist() for n in half.notes("a")] == [
        n.positions.tolist() for n in ref.notes("a")
    ]
    q = torch.from_numpy(s.q[:2]).to(torch.bfloat16)
    assert half.route("a", q, r=1)


def test_concurrent_observe_and_route():
    import threading

    bank = NoteBank(small_cfg(notes_per_user=4), K, CH, seed=0)
    s = make_stream(400, seed=18, planted=(5, 50, 100))
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                for n in bank.route("a", s.q[:3], r=2):
                    assert 1 <= len(n) <= 3 and n.votes >= 0
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for a in range(0, 400, 7):
        bank.observe("a", *s.part(a, min(a + 7, 400)))
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors and bank.note_count("a") == 4


def test_route_many_equals_routing_each_request_alone():
    """One batched vote over users with different note counts and query lengths, an unknown
    user, r = 0 and all-zero queries: each answer is the single-request route's and the
    oracle's."""
    bank = NoteBank(small_cfg(), K, CH, seed=3)
    lengths = {"a": 96, "b": 20, "c": 48, "d": 33}
    for i, (user, n) in enumerate(lengths.items()):
        s = make_stream(n, seed=30 + i, planted=tuple(range(3, n, 11)))
        s.q[: n // 2, :, K // 2 :] = 0.0
        bank.observe(user, *s.part(0, n))
    rng = np.random.default_rng(1)
    requests = []
    for trial in range(12):
        user = ["a", "b", "c", "d", "nobody"][trial % 5]
        q = rng.normal(size=(1 + trial % 4, L, H, K)).astype(np.float32)
        if trial == 7:
            q[:] = 0.0
        requests.append((user, q, [2, 0, 3, 1, 5][trial % 5] if trial != 9 else 0))
    got = bank.route_many(requests)
    for (user, q, r), routed in zip(requests, got, strict=True):
        alone = bank.route(user, q, r)
        assert [(n.serial, n.votes) for n in routed] == [(n.serial, n.votes) for n in alone]
        notes = bank.notes(user)
        if notes and r > 0 and q.any():
            u = bank.address(q.reshape(len(q), CH, K))
            assert [n.serial for n in routed] == [
                notes[i].serial for i in _oracle_route(notes, u, r)
            ]
        else:
            assert routed == []


def test_batched_chunk_close_equals_closing_chunks_one_at_a_time():
    """The write path closes all chunks of a batch at once; the notes equal those of the
    single-chunk functions (distinctiveness, select_spans, span_addresses) run per chunk."""
    from recmem.archive.selection import distinctiveness, select_spans, span_addresses

    cfg = small_cfg()
    bank = NoteBank(cfg, key_dim=K, n_channels=CH, seed=0)
    rng = np.random.default_rng(11)
    users = [f"u{i}" for i in range(6)]
    lens = np.array([3 * cfg.chunk_events + 5, cfg.chunk_events, 1, 2 * cfg.chunk_events, 7, 0])
    T = int(lens.max())
    items = rng.integers(0, 50, (6, T))
    ts = np.cumsum(rng.integers(0, 2_000_000, (6, T)), axis=1)
    pos = np.arange(1, T + 1)[None, :].repeat(6, 0)
    k = rng.normal(size=(6, T, CH, K)).astype(np.float32)
    q = rng.normal(size=(6, T, CH, K)).astype(np.float32)
    ids = [[str(i) for i in items[b, : lens[b]]] for b in range(6)]
    written = bank.observe_batch(users, items, ids, np.zeros_like(items), ts, pos, lens, k, q)
    total = 0
    for b, user in enumerate(users):
        want = []
        unit_k = l2_normalise(k[b]).astype(np.float16)
        unit_u = l2_normalise(q[b][..., bank.coords]).astype(np.float16)
        for c in range(lens[b] // cfg.chunk_events):
            sl = slice(c * cfg.chunk_events, (c + 1) * cfg.chunk_events)
            d = distinctiveness(unit_k[sl])
            spans = select_spans(
                d.sum(axis=1), ts[b, sl], window=cfg.window, n_spans=cfg.spans_per_chunk,
                max_span=cfg.max_span, gap_ms=cfg.session_gap_s * 1000.0,
            )  # fmt: skip
            for a, e in spans:
                rho = span_addresses(d, unit_u[sl], a, e)
                want.append((items[b, sl][a:e].tolist(), pos[b, sl][a:e].tolist(), rho))
        got = bank.notes(user)
        assert [(n.items.tolist(), n.positions.tolist()) for n in got] == [w[:2] for w in want]
        assert [n.serial for n in got] == list(range(len(want)))
        for n, w in zip(got, want):
            assert np.array_equal(n.addresses, w[2])
        assert bank.pending_count(user) == lens[b] % cfg.chunk_events
        total += len(want)
    assert written == total > 0


def test_with_votes_equals_dataclasses_replace():
    """The routed-note copy has replace()'s type and field values (the same arrays), stays
    frozen, and leaves the stored note as it was."""
    import dataclasses

    from recmem.archive.store import Note, with_votes

    rng = np.random.default_rng(5)
    note = Note(
        serial=7,
        items=rng.integers(0, 50, 4),
        item_ids=("a", "b", "c", "d"),
        actions=rng.integers(0, 3, 4),
        ts_ms=np.arange(4, dtype=np.int64),
        positions=np.arange(10, 14, dtype=np.int64),
        addresses=rng.normal(size=(CH, 8)).astype(np.float32),
    )
    got = with_votes(note, 3)
    want = dataclasses.replace(note, votes=3)
    assert type(got) is Note and got is not note
    for f in dataclasses.fields(Note):
        assert getattr(got, f.name) is getattr(want, f.name) or (
            getattr(got, f.name) == getattr(want, f.name)
        ), f.name
    assert got.votes == 3 and note.votes == 0 and len(got) == 4
    assert vars(got).keys() == vars(want).keys()
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.votes = 1  # type: ignore[misc]


def test_route_many_notes_are_the_stored_notes_with_votes():
    """Each routed note carries its stored note's arrays and ids, and only votes differ."""
    bank = NoteBank(small_cfg(), K, CH, seed=3)
    s = make_stream(96, seed=30, planted=tuple(range(3, 96, 11)))
    bank.observe("a", *s.part(0, 96))
    q = np.random.default_rng(2).normal(size=(3, L, H, K)).astype(np.float32)
    (routed,) = bank.route_many([("a", q, 3)])
    stored = {n.serial: n for n in bank.notes("a")}
    assert routed
    for n in routed:
        m = stored[n.serial]
        assert n.votes >= 1 and m.votes == 0
        for name in ("items", "item_ids", "actions", "ts_ms", "positions", "addresses"):
            assert getattr(n, name) is getattr(m, name), name


def _routed(answers):
    return [[(n.serial, n.votes) for n in notes] for notes in answers]


@pytest.mark.parametrize(
    "device",
    [
        None,  # numpy and faiss
        "cpu",  # torch
        pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")),
    ],
)
@pytest.mark.parametrize("seed", range(6))
def test_route_many_equals_its_plain_reference_on_random_banks(seed, device):
    """The batched route (one faiss call over rows gathered from every user's index, the
    vote on unpadded rows) gives the notes, order and votes of ``route_many_plain`` (each
    request alone, its user's index searched): users with 0, 1 or many notes (some
    evicted), repeated chunks (tied addresses), masked addresses, unknown users, r = 0,
    None or above the note count, single positions, zero queries and zero channels,
    torch and numpy queries, min_votes on and off."""
    rng = np.random.default_rng(seed)
    cfg = small_cfg(notes_per_user=int(rng.choice([3, 64])), min_votes=int(seed % 3 == 2))
    bank = NoteBank(cfg, K, CH, seed=seed)
    users = [f"u{i}" for i in range(7)]
    for i, user in enumerate(users):
        n = int(rng.choice([0, 5, 16, 40, 96]))
        if n == 0:
            continue
        s = make_stream(
            n, seed=100 * seed + i, planted=tuple(range(2, n, int(rng.integers(5, 12))))
        )
        if i % 2:  # a repeated stretch: notes with the same addresses (ties)
            s.k[32:64], s.q[32:64] = s.k[:32][: len(s.k[32:64])], s.q[:32][: len(s.q[32:64])]
        if i % 3 == 0:
            s.q[: n // 2, :, K // 2 :] = 0.0  # early events under a locked key block
        bank.observe(user, *s.part(0, n))
    requests = []
    for _ in range(40):
        user = str(rng.choice([*users, "nobody"]))
        notes = bank.notes(user)
        shape = [(int(rng.integers(1, 5)), L, H, K), (int(rng.integers(1, 4)), CH, K), (CH, K)]
        q = rng.normal(size=shape[int(rng.integers(0, 3))]).astype(np.float32)
        if notes and rng.random() < 0.4:  # ask with a stored address: exact cosine ties
            note = notes[int(rng.integers(len(notes)))]
            q = np.zeros((1, CH, K), np.float32)
            q[0][:, bank.coords] = note.addresses
        if rng.random() < 0.15:
            q[..., : q.shape[-2] // 2, :] = 0.0  # some channels abstain
        if rng.random() < 0.05:
            q[:] = 0.0
        r = [None, 0, 1, 2, 3, 70][int(rng.integers(0, 6))]
        requests.append((user, torch.from_numpy(q) if rng.random() < 0.5 else q, r))
    bank.route_device = None if device is None else torch.device(device)
    got = bank.route_many(requests)
    want = bank.route_many_plain(requests)
    assert _routed(got) == _routed(want)
    assert sum(map(len, got)) >= 10
    tensors = [(u, torch.as_tensor(q), r) for u, q, r in requests]
    assert _routed(bank.route_many(tensors)) == _routed(want)
    # as the rank step asks: tensors [n, L, H, K] with n varying
    alike = [
        (u, torch.from_numpy(rng.normal(size=(int(rng.integers(1, 5)), L, H, K))).float(), r)
        for u, _, r in requests
    ]
    assert _routed(bank.route_many(alike)) == _routed(bank.route_many_plain(alike))
    # without votes (the rank step): the same notes in the same order, the stored objects
    bare = bank.route_many(requests, votes=False)
    assert [[n.serial for n in ns] for ns in bare] == [[n.serial for n in ns] for ns in want]
    for (user, _, _), notes in zip(requests, bare, strict=True):
        stored = {n.serial: n for n in bank.notes(user)}
        assert all(n is stored[n.serial] for n in notes)
    for (user, _, _), notes in zip(requests, got, strict=True):
        stored = {n.serial: n for n in bank.notes(user)}
        assert all(n.items is stored[n.serial].items for n in notes)


def test_route_many_rejects_what_the_plain_route_rejects():
    bank = NoteBank(small_cfg(), K, CH, seed=0)
    s = make_stream(32, seed=1, planted=(3, 20))
    bank.observe("a", *s.part(0, 32))
    bad_dims = [("a", np.ones((2, CH, K + 1), np.float32), 2)]
    bad_shape = [("a", np.ones((2, CH + 1, K), np.float32), 2)]
    nan = [("a", np.full((1, CH, K), np.nan, np.float32), 2)]
    for requests in (bad_dims, bad_shape, nan, [("a", s.q[:1], -1)]):
        for route in (bank.route_many, bank.route_many_plain):
            with pytest.raises(ValueError):
                route(requests)
    assert bank.route_many([]) == []
