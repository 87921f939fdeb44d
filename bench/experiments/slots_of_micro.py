"""The slots of some rows' open chunks out of a slot table [40,000, 31] int32 (the
NoteBank's at the default 32 events per chunk), two ways: one masked gather of the rows
(``recmem.rows.row_prefixes``, what ``OpenChunks.slots_of`` does) against indexing with
``recmem.rows.row_cells`` (a ragged index). 100 and 2,600 random rows (2,600: about a
workload batch's users), counts uniform in 0..31; five rounds alternating, each the best
of 3 x 200 calls, in microseconds a call.

    PYTHONPATH=. .venv/bin/python bench/experiments/slots_of_micro.py
"""

from __future__ import annotations

import json
import timeit

import numpy as np

from recmem.rows import row_cells, row_prefixes


def main() -> None:
    rng = np.random.default_rng(0)
    slot = rng.integers(0, 1 << 20, (40000, 31)).astype(np.int32)
    count = rng.integers(0, 32, 40000).astype(np.int32)
    out = {}
    for n in (100, 2600):
        rows = rng.choice(40000, n, replace=False)

        def masked(rows: np.ndarray = rows) -> np.ndarray:
            return row_prefixes(slot, rows, count[rows])

        def cells(rows: np.ndarray = rows) -> np.ndarray:
            return slot[row_cells(rows, count[rows])]

        assert (masked() == cells()).all()
        res: dict[str, list[float]] = {"row_prefixes": [], "row_cells": []}
        for _ in range(5):
            for k, f in (("row_prefixes", masked), ("row_cells", cells)):
                res[k].append(round(min(timeit.repeat(f, number=200, repeat=3)) / 200 * 1e6, 1))
        out[f"{n}_rows_us"] = res
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
