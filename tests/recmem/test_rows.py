"""recmem/rows.py, the rows and slots under the engine's per-user structures and the
NoteBank's open chunks: rows and slots reused in order, arrays grown in place with their
contents kept, given-back object slots emptied, and the cell helpers against plain loops.
(The owners are checked against their plain references in test_seen_tails_fast.py and
test_archive_open_chunks.py.)"""

import numpy as np

from recmem.rows import (
    SlotPool,
    UserRows,
    ragged_arange,
    ring_cells,
    row_cells,
    row_prefixes,
)


def test_user_rows_reuse_released_rows_last_released_first_and_grow_in_place():
    rows = UserRows(first=4)
    keys = rows.add("keys", (3,), np.int64)
    got = rows.insert(["a", "b", "c"])
    assert got.tolist() == [0, 1, 2] and rows.capacity == 4
    keys[got] = [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert rows.release(["a", "x", "c"]).tolist() == [0, 2]  # unknown users skipped
    assert "a" not in rows and "b" in rows and len(rows) == 1
    # "c" was released last: its row comes first; then "a"'s, then rows never used
    got = rows.assign(["d", "b", "e", "d", "f", "g", "h"])
    assert got.tolist() == [2, 1, 0, 2, 3, 4, 5]
    assert list(rows.of) == ["b", "d", "e", "f", "g", "h"]
    assert rows.capacity == 6  # max(6 rows in use, 4 + 4 // 4, 4)
    assert rows.arrays["keys"] is keys and keys.shape == (6, 3)
    assert keys[1].tolist() == [2, 2, 2] and keys[4:].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert rows.lookup(["h", "a"]).tolist() == [5, -1]


def test_user_rows_widen_keeps_the_columns():
    rows = UserRows()
    rows.add("slot", (2,), np.int32)
    r = rows.insert(["a", "b"])
    rows.arrays["slot"][r] = [[1, 2], [3, 4]]
    assert rows.widen("slot", 1).shape[1] == 2  # never narrower
    wide = rows.widen("slot", 4)
    assert wide is rows.arrays["slot"] and wide.dtype == np.int32
    assert wide[r].tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]


def test_slot_pool_reuses_given_slots_and_empties_their_objects():
    pool = SlotPool(first=4)
    pool.add("ids", (), object)
    pool.add("x", (2,), np.float32)
    ids = pool.take(3)
    assert sorted(ids.tolist()) == [1, 2, 3] and ids.dtype == np.int64 and pool.used == 3
    pool.write(ids, {"ids": np.array(["p", "q", "r"], dtype=object), "x": np.ones((3, 2))})
    more = pool.take(3)  # grows: capacity max(4 - 1 + 3, 4 + 1, 4) = 6, contents kept
    assert pool.capacity == 6 and len(set(ids.tolist() + more.tolist())) == 6
    assert pool.read(ids, ["ids"])[0].tolist() == ["p", "q", "r"]
    assert pool.arrays["x"][ids].tolist() == [[1, 1]] * 3
    assert all(v is None for v in pool.arrays["ids"][more])  # new slots: None, not 0
    pool.give(ids[:2])
    assert pool.arrays["ids"][ids].tolist() == [None, None, "r"]  # strings not kept alive
    assert sorted(pool.take(2).tolist()) == sorted(ids[:2].tolist()) and pool.used == 6


def test_cells_against_plain_loops():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 4, 20)
    starts = rng.integers(0, 5, 20)
    rows = rng.permutation(30)[:20]
    r, c = row_cells(rows, counts, starts)
    assert r.tolist() == [x for x, n in zip(rows, counts) for _ in range(n)]
    assert c.tolist() == [s + t for s, n in zip(starts, counts) for t in range(n)]
    assert row_cells(rows, counts)[1].tolist() == [t for n in counts for t in range(n)]
    assert ragged_arange(starts, counts).tolist() == c.tolist()
    table = rng.integers(0, 99, (30, 4))
    want = [table[x, t] for x, n in zip(rows, counts) for t in range(n)]
    assert row_prefixes(table, rows, counts).tolist() == want
    assert row_prefixes(table, rows[:0], counts[:0]).shape == (0,)
    end, size = rng.integers(0, 4, 30), 4
    r, c = ring_cells(rows, counts, end, size)
    want = [(x, (end[x] - n + t) % size) for x, n in zip(rows, counts) for t in range(n)]
    assert list(zip(r.tolist(), c.tolist())) == want
