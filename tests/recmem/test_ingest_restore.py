"""The Kafka adapter's partition lifecycle, driven directly (no broker): restores run on a
restore thread and reach the engine in slices while rank calls go on; a partition's users
get PartitionUnavailable (never a cold start) until it is complete; claims and writes carry
the group generation, and a newer generation's claim fences this member."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from recmem.checkpoint import CheckpointStore, Fenced
from recmem.engine import PartitionUnavailable
from recmem.ingest import KafkaIngest
from recmem.ranking import RankQuery
from recmem.state_store import StateLayout
from streams.group import GroupView, Member
from streams.sink import RESTORING
from tests.recmem.test_engine import make_engine, random_events, small_config
from tests.recmem.test_ingest import loop_over


class HeldStore(CheckpointStore):
    """A checkpoint store whose restores wait for ``release`` (a slow object store)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def restore(self, partition, **kw):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30)
        return super().restore(partition, **kw)


def service(tmp_path, sub, store, generation=1, prefetch_mb=0.0):
    cfg = small_config()
    cfg.checkpoint.interval_s = 0.0
    cfg.checkpoint.prefetch_mb = prefetch_mb
    loop = loop_over(make_engine(tmp_path / sub, cfg=cfg))
    ingest = KafkaIngest(loop, store, cfg, owner=f"{sub}:1")
    ingest.on_group(GroupView(generation=generation, partitions=2))
    return ingest


def layout():
    cfg = small_config()
    return StateLayout.from_config(cfg.memory, cfg.model)


def rank(ingest, user, partition):
    return ingest.loop.submit(RankQuery(user, k=3), partition=partition).result(timeout=10)


def test_restore_runs_off_the_consumer_thread_and_gates_rank_calls(tmp_path):
    events = random_events(300, 20, seed=1, n_partitions=2)
    a = service(tmp_path, "a", CheckpointStore(tmp_path / "ckpt", layout()))
    a.restore_now([0, 1])
    a.apply_batch(events, {0: 300, 1: 300})
    a.checkpoint()
    a.flush()
    positions = {u: int(a.engine.snapshot([u]).pos[0]) for u in a.engine.partition_of}
    a.loop.stop()

    held = HeldStore(tmp_path / "ckpt", layout())
    b = service(tmp_path, "b", held, generation=2)
    try:
        began = time.monotonic()
        assert b.on_assigned([0, 1]) == {0: RESTORING, 1: RESTORING}
        assert time.monotonic() - began < 0.5, "on_assigned waited for the restore"
        assert held.entered.wait(10)
        assert all(name.startswith("checkpoint-restore") for name in held.threads)
        user0 = next(u for u, p in a.engine.partition_of.items() if p == 0)
        with pytest.raises(PartitionUnavailable):
            rank(b, user0, 0)
        with pytest.raises(PartitionUnavailable):
            b.loop.inspect(user0, partition=0)
        # a user of no partition (partition None: not routed) is still answered
        assert rank(b, "nobody", None).cold_start
        assert b.restored() == {}
        held.release.set()
        deadline = time.monotonic() + 30
        got: dict = {}
        while len(got) < 2 and time.monotonic() < deadline:
            got.update(b.restored())
            time.sleep(0.01)
        assert {p: r.next_offset for p, r in got.items()} == {0: 300, 1: 300}
        for user, pos in positions.items():
            res = rank(b, user, a.engine.partition_of[user])
            assert res.position == pos and not res.cold_start
        assert not rank(b, "never-seen", 0).position and rank(b, "never-seen", 0).cold_start
        assert b.totals.restores == 2 and b.totals.restore_bytes > 0
        # the claims carry b's generation: a (generation 1) may no longer write
        assert b.checkpoints.fence(0).generation == 2
        assert b.checkpoints.fence(0).owner == "b:1"
    finally:
        held.release.set()
        b.close()
        b.loop.stop()


def test_a_newer_generation_fences_this_member(tmp_path):
    events = random_events(200, 16, seed=2, n_partitions=2)
    store = CheckpointStore(tmp_path / "ckpt", layout())
    a = service(tmp_path, "a", store, generation=3)
    try:
        a.restore_now([0, 1])
        a.apply_batch(events[:100], {0: 100, 1: 100})
        a.checkpoint()
        assert a.flush() == {0: 100, 1: 100}
        # another member got partition 1 at generation 4 (this one was paused meanwhile)
        CheckpointStore(tmp_path / "ckpt", layout()).claim(1, 4, "b:1")
        a.apply_batch(events[100:], {0: 200, 1: 200})
        a.checkpoint()
        a.flush()
        assert a.totals.fenced == 1
        assert store.latest_offset(1) == 100, "the stale write became a restore point"
        # the next sink call drops partition 1 here; its events are no longer applied
        assert a.checkpoint() == {0: 200}
        assert a.assigned == {0} and 1 not in a.engine.serving
        before = a.engine.totals.events
        a.apply_batch([e for e in events[:50] if e.partition == 1], {1: 250})
        a.drain()
        assert a.engine.totals.events == before
        # a restore of a partition claimed by a newer generation is refused, not applied
        a.on_group(GroupView(generation=3, partitions=2))
        a.on_assigned([1])
        deadline = time.monotonic() + 10
        while a.restoring and time.monotonic() < deadline:
            assert a.restored() == {}
            time.sleep(0.01)
        assert a.totals.fenced == 2 and 1 not in a.assigned
        with pytest.raises(Fenced):
            store.claim(1, 3)
    finally:
        a.close()
        a.loop.stop()


class CountingStore(CheckpointStore):
    """A checkpoint store that records which partitions' checkpoint files it reads."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.loads: list[int] = []

    def _load(self, partition, prefix):
        self.loads.append(partition)
        return super()._load(partition, prefix)


def test_a_prefetched_checkpoint_is_used_only_while_the_manifest_names_it(tmp_path):
    events = random_events(300, 20, seed=3, n_partitions=2)
    a = service(tmp_path, "a", CheckpointStore(tmp_path / "ckpt", layout()))
    store = CountingStore(tmp_path / "ckpt", layout())
    b = service(tmp_path, "b", store, generation=2, prefetch_mb=100)
    try:
        a.restore_now([0, 1])
        a.apply_batch(events[:150], {0: 150, 1: 150})
        a.checkpoint()
        a.flush()
        # b rejoins its group: it reads both partitions ahead (claims and installs nothing)
        b.on_rebalancing()
        deadline = time.monotonic() + 30
        while not all(f.done() for f in b._prefetched.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(b._prefetched) == [0, 1] and sorted(store.loads) == [0, 1]
        assert b.engine.partition_of == {} and store.fence(0).generation == 1
        # the owner checkpoints partition 1 once more before it goes (partition 0 unchanged)
        a.apply_batch([e for e in events[150:] if e.partition == 1], {1: 300})
        a.checkpoint()
        a.flush()
        positions = {u: int(a.engine.snapshot([u]).pos[0]) for u in a.engine.partition_of}
        a.loop.stop()
        store.loads.clear()
        me = Member("b:1")
        b.on_group(GroupView(generation=2, partitions=2, owners={0: me, 1: me}))
        assert b.on_assigned([0, 1]) == {0: RESTORING, 1: RESTORING}
        got: dict = {}
        while len(got) < 2 and time.monotonic() < deadline:
            got.update(b.restored())
            time.sleep(0.01)
        # partition 0 came from memory; partition 1's prefetch was outdated: read again
        assert store.loads == [1]
        assert b.totals.restores_prefetched == 1
        assert {p: r.next_offset for p, r in got.items()} == {0: 150, 1: 300}
        for user, pos in positions.items():
            res = rank(b, user, b.engine.partition_of[user])
            assert res.position == pos and not res.cold_start
        assert store.fence(0).generation == 2 and store.fence(1).generation == 2
        assert b._prefetched == {} and b._prefetch_held == 0
    finally:
        b.close()
        b.loop.stop()


def test_prefetches_of_partitions_given_elsewhere_are_dropped(tmp_path):
    events = random_events(100, 10, seed=4, n_partitions=2)
    a = service(tmp_path, "a", CheckpointStore(tmp_path / "ckpt", layout()))
    a.restore_now([0, 1])
    a.apply_batch(events, {0: 100, 1: 100})
    a.checkpoint()
    a.flush()
    a.loop.stop()
    b = service(tmp_path, "b", CheckpointStore(tmp_path / "ckpt", layout()), prefetch_mb=100)
    off = service(tmp_path, "c", CheckpointStore(tmp_path / "ckpt", layout()))
    try:
        b.on_rebalancing()
        off.on_rebalancing()  # prefetch_mb = 0: nothing read
        assert off._prefetched == {}
        b.on_group(GroupView(generation=2, partitions=2, owners={0: Member("c:1")}))
        assert b._prefetched == {}
        deadline = time.monotonic() + 30
        while b._prefetch_held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b._prefetch_held == 0
    finally:
        for s in (b, off):
            s.close()
            s.loop.stop()


class SlowStore(CheckpointStore):
    """A checkpoint store that records what each write holds and takes its time, so that
    batches keep arriving while a checkpoint is between its partitions."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.writes: list[tuple[int, int, dict[str, int]]] = []

    def write(self, partition, user_ids, state, next_offset, **kw):
        pos = dict(zip(user_ids, state.pos.tolist()))
        self.writes.append((partition, int(next_offset), pos))
        time.sleep(0.02)
        return super().write(partition, user_ids, state, next_offset, **kw)


def test_checkpoints_taken_while_batches_arrive_hold_exactly_the_events_before_their_offsets(
    tmp_path,
):
    """Checkpoints capture one partition at a time while the consumer keeps handing batches
    over: every checkpoint's states hold exactly the events below its offset, never one
    more or one less (a capture queued out of order with the batches would break it)."""
    raw = random_events(1200, 40, seed=5, n_partitions=2)
    events = [dataclasses.replace(e, ts_ms=e.ts_ms + k) for k, e in enumerate(raw)]  # no dups
    store = SlowStore(tmp_path / "ckpt", layout())
    a = service(tmp_path, "a", store)
    try:
        a.restore_now([0, 1])
        for start in range(0, len(events), 40):
            batch = events[start : start + 40]
            ends = {e.partition: e.offset + 1 for e in batch}
            a.apply_batch(batch, ends)
            a.checkpoint()  # starts one when none is being written (interval 0)
        a.flush()
        a.checkpoint()
        a.flush()
    finally:
        a.close()
        a.loop.stop()
    assert len({p for p, _, _ in store.writes}) == 2 and len(store.writes) >= 3
    below_offsets = 0
    for partition, offset, pos in store.writes:
        for user, got in pos.items():
            want = sum(1 for e in events if e.user_id == user and e.offset < offset)
            assert got == want, (partition, offset, user, got, want)
        below_offsets += offset < events[-1].offset
    assert below_offsets, "no checkpoint was taken while batches were still arriving"
