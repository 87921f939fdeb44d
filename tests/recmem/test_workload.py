"""The benchmark workload: determinism, Zipf activity and popularity, time order, chunking
in bounded memory, bad settings, and every event through a real broker exactly once."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from proto.actions import ACTIONS
from recmem.cli import main
from recmem.config import WorkloadConfig
from recmem.event_columns import COLUMNS, EventColumns, read_event_file
from recmem.workload import (
    BLOCK_EVENTS,
    START_MS,
    expected_top_share,
    rank_weights,
    top_share,
    user_event_counts,
    workload_chunks,
    workload_stream,
)
from streams.codec import decode_event

# several time blocks, so that block boundaries and chunk boundaries differ
SMALL = WorkloadConfig(users=3_000, events=150_000, items=2_000, seed=7)


def generate(spec: WorkloadConfig, chunk_events: int = BLOCK_EVENTS) -> EventColumns:
    return EventColumns.concat(list(workload_chunks(spec, chunk_events)))


def same(a: EventColumns, b: EventColumns) -> bool:
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in COLUMNS)


def test_deterministic_by_seed() -> None:
    a = generate(SMALL)
    assert same(a, generate(SMALL))
    other = generate(WorkloadConfig(users=3_000, events=150_000, items=2_000, seed=8))
    assert not np.array_equal(a.user, other.user)
    assert not np.array_equal(a.item, other.item)


def test_chunk_boundaries_do_not_change_the_output() -> None:
    whole = generate(SMALL, chunk_events=SMALL.events)
    for size in (999, 4096, BLOCK_EVENTS + 17):
        chunks = list(workload_chunks(SMALL, size))
        assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size
        assert same(EventColumns.concat(chunks), whole)
    one_by_one = workload_chunks(SMALL, 1)
    assert same(EventColumns.concat([next(one_by_one) for _ in range(300)]), whole.slice(0, 300))


def test_sizes_ids_and_fields() -> None:
    ev = generate(SMALL)
    assert len(ev) == SMALL.events
    counts = np.bincount(ev.user, minlength=SMALL.users)
    assert len(counts) == SMALL.users and counts.min() >= 1  # every user appears
    assert np.array_equal(counts, user_event_counts(SMALL))
    assert ev.item.min() >= 0 and ev.item.max() < SMALL.items
    assert (ev.action == ACTIONS.index("view")).all() and (ev.value == 1.0).all()
    stream = workload_stream(SMALL)
    assert stream.n_events == SMALL.events
    assert stream.user_ids[[0, 2_999]].tolist() == ["u0", "u2999"]
    assert stream.item_ids[[0, 1_999]].tolist() == ["i0", "i1999"]


def test_timestamps_increase_across_the_whole_stream() -> None:
    ev = generate(SMALL, chunk_events=10_000)
    gaps = np.diff(ev.ts_ms)
    assert ev.ts_ms[0] > START_MS and (gaps >= 1).all()
    assert abs(gaps.mean() - SMALL.mean_gap_ms) < 0.02 * SMALL.mean_gap_ms
    # each user's events spread over the whole span, not bunched in one block
    first, last = {}, {}
    for i, u in enumerate(ev.user.tolist()):
        first.setdefault(u, i)
        last[u] = i
    heavy = np.argsort(user_event_counts(SMALL))[-20:]
    assert all(first[u] < len(ev) * 0.1 and last[u] > len(ev) * 0.9 for u in heavy.tolist())


@pytest.mark.parametrize("s", [0.5, 1.0, 1.5])
def test_activity_and_popularity_follow_the_exponent(s: float) -> None:
    spec = WorkloadConfig(users=20_000, events=400_000, items=5_000, user_zipf=s, item_zipf=s)
    ev = generate(spec)
    counts = np.bincount(ev.user, minlength=spec.users)
    # the top 1 % of users hold what the exponent predicts
    assert top_share(counts) == pytest.approx(expected_top_share(spec), rel=0.02)
    items = np.bincount(ev.item, minlength=spec.items)
    w = rank_weights(spec.items, s)
    assert top_share(items) == pytest.approx(w[:50].sum() / w.sum(), rel=0.02)
    # heavy users and items are spread over the ids, not the lowest ones
    assert np.argmax(counts) != 0 and np.argmax(items) != 0


def test_exponent_zero_is_uniform_and_the_predictions_move_with_it() -> None:
    spec = WorkloadConfig(users=1_000, events=200_000, items=100, user_zipf=0, item_zipf=0)
    ev = generate(spec)
    counts = np.bincount(ev.user, minlength=spec.users)
    # multinomial noise only: 1 + Binomial(199,000, 1/1000) per user
    assert counts.mean() == 200 and counts.std() == pytest.approx(np.sqrt(199 * 0.999), rel=0.15)
    assert expected_top_share(spec) == pytest.approx(0.01)
    assert expected_top_share(WorkloadConfig()) == pytest.approx(0.613, abs=0.001)


def test_memory_stays_bounded_by_the_block() -> None:
    """Two million events are generated holding a few blocks of events at a time."""
    spec = WorkloadConfig(users=20_000, events=2_000_000, items=10_000)
    tracemalloc.start()
    try:
        n = 0
        for chunk in workload_chunks(spec, 50_000):
            n += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == spec.events
    assert peak < 16e6, f"peak {peak / 1e6:.1f} MB (the whole stream: 82 MB)"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"users": -1}, "workload.users = -1 is outside"),
        ({"users": 0}, "workload.users = 0 is outside"),
        ({"events": -5}, "workload.events = -5 is outside"),
        ({"users": 10, "events": 9}, "every user has at least one event"),
        ({"items": 0}, "workload.items = 0 is outside"),
        ({"user_zipf": -0.5}, "workload.user_zipf = -0.5 is outside"),
        ({"item_zipf": float("nan")}, "workload.item_zipf = nan is outside"),
        ({"mean_gap_ms": 0.5}, "workload.mean_gap_ms = 0.5 is outside"),
        ({"seed": -1}, "workload.seed = -1 is outside"),
    ],
)
def test_bad_settings_fail_clearly(changes: dict[str, float], message: str) -> None:
    spec = WorkloadConfig(users=100, events=1_000, items=50)
    for name, value in changes.items():
        setattr(spec, name, value)
    with pytest.raises(ValueError, match=message):
        workload_chunks(spec)
    with pytest.raises(ValueError, match=message):
        workload_stream(spec)


def test_cli_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["produce", "--dataset", "workload", "--set", "workload.user_zipf=-1"])
    assert rc == 2
    assert "workload.user_zipf = -1.0 is outside [0, inf)" in capsys.readouterr().err


def read_topic(cfg, expected: int, timeout_s: float = 30.0) -> list:
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, auto_offset_reset="earliest")
    consumer.assign([TopicPartition(cfg.topic, p) for p in range(cfg.partitions)])
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < expected and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    extra = consumer.poll(timeout_ms=500)  # nothing beyond the expected records
    consumer.close()
    return records + [r for batch in extra.values() for r in batch]


WORKLOAD_SET = [
    "--set",
    "workload.users=2000",
    "--set",
    "workload.events=20000",
    "--set",
    "workload.items=500",
    "--set",
    "workload.seed=3",
    "--set",
    "kafka.partitions=3",
]


def test_every_event_is_produced_once_and_reads_back(kafka_config, capsys) -> None:
    cfg = kafka_config(partitions=3)
    rc = main(
        ["produce", "--dataset", "workload", "--topic", cfg.topic]
        + ["--bootstrap", cfg.bootstrap_servers, *WORKLOAD_SET]
    )
    assert rc == 0
    assert "produced 20000 events of workload" in capsys.readouterr().out
    records = read_topic(cfg, 20_000)
    assert len(records) == 20_000
    events = [decode_event(r.value) for r in records]
    assert all(r.key == e.user_id.encode() for r, e in zip(records, events, strict=True))
    spec = WorkloadConfig(users=2_000, events=20_000, items=500, seed=3)
    want = generate(spec)
    got = sorted((e.ts_ms, e.user_id, e.item_id, e.action, e.value) for e in events)
    view = ACTIONS.index("view") + 1
    assert got == [
        (ts, f"u{u}", f"i{i}", view, 1.0)
        for ts, u, i in zip(
            want.ts_ms.tolist(), want.user.tolist(), want.item.tolist(), strict=True
        )
    ]
    # within a partition each user's events arrive in time order
    for p in range(3):
        per_user: dict[str, list[int]] = {}
        for r, e in zip(records, events, strict=True):
            if r.partition == p:
                per_user.setdefault(e.user_id, []).append(e.ts_ms)
        assert all(ts == sorted(ts) for ts in per_user.values())


def test_written_file_holds_the_workload_and_produces_it(kafka_config, tmp_path, capsys) -> None:
    path = tmp_path / "workload.npz"
    assert main(["produce", "--dataset", "workload", "--write", str(path), *WORKLOAD_SET]) == 0
    assert f"wrote 20000 events of workload to {path}" in capsys.readouterr().out
    stream = read_event_file(path)
    spec = WorkloadConfig(users=2_000, events=20_000, items=500, seed=3)
    assert stream.meta["workload"] == {**spec.__dict__}
    assert same(EventColumns.concat(list(stream.chunks(7_000))), generate(spec))
    cfg = kafka_config(partitions=1)
    rc = main(
        ["produce", "--dataset", f"npz:{path}", "--limit", "500", "--topic", cfg.topic]
        + ["--bootstrap", cfg.bootstrap_servers, "--set", "kafka.partitions=1"]
    )
    assert rc == 0
    events = [decode_event(r.value) for r in read_topic(cfg, 500)]
    first = generate(spec).slice(0, 500)
    assert [(e.user_id, e.item_id, e.ts_ms) for e in events] == [
        (f"u{u}", f"i{i}", ts)
        for u, i, ts in zip(first.user.tolist(), first.item.tolist(), first.ts_ms.tolist())
    ]
