"""``recmem serve`` members on librdkafka (``kafka.client = "confluent"``), which carries no
member data: each member learns the other partitions' owners from their checkpoint claims
(recmem/routing.py ``ClaimedOwners``). Two real serve processes on the embedded broker,
real gRPC on 127.0.0.1: a user owned by the other member, asked here, gets the owner's
answer (forwarded), equal to the single-process run, after the second member joined and
took partitions over from the first; the client library calls owners
directly; and the claims rule: a claim naming this member for a partition it does not
hold is not taken as ownership."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from proto.recmem.v1 import rank_pb2
from recmem.checkpoint import CheckpointStore
from recmem.client import RankClient
from recmem.config import Config
from recmem.routing import ClaimedOwners, OwnerMap
from recmem.state_store import StateLayout
from streams.group import GroupView, Member
from streams.partitioner import partition_for
from tests.cluster import (
    REQUEST_TS,
    Cluster,
    assert_same_ranking,
    caught_up,
    checkpoints,
    ml100k_setup,
    reference,
    reference_ranks,
    scaleout_config,
)

PARTITIONS = 4


@pytest.mark.slow
def test_confluent_members_route_users_to_their_owner(tmp_path, kafka_config):
    kafka = kafka_config(partitions=PARTITIONS, client="confluent", heartbeat_interval_ms=200)
    cfg = scaleout_config(tmp_path, kafka)
    work = ml100k_setup(cfg, limit=20_000)
    users = sorted(work.counts)
    ref = reference(cfg, work, tmp_path / "ref-spill")
    want = reference_ranks(ref, users)
    cluster = Cluster(cfg, tmp_path / "cluster", 2)
    try:
        # one member first, then a second joins: partitions move, each new owner claims them
        cluster.start(0)
        cluster.wait(lambda: cluster.settled(1), 120, "the first member owning every partition")
        assert cluster.routing(0).partitions == PARTITIONS
        cluster.start(1)
        store = checkpoints(cfg)
        addr = {inst.address: inst.index for inst in cluster.instances}

        def agreed() -> bool:
            """Both maps name every partition's last claimant (read every 0.5 s)."""
            claimed = {p: addr.get(store.fence(p).owner, -1) for p in range(PARTITIONS)}
            return cluster.owners(0) == cluster.owners(1) == claimed

        cluster.wait(
            lambda: cluster.settled(2) and caught_up(cfg, work.ends) and agreed(),
            180,
            "two members owning every partition (own + claims), every event checkpointed",
        )
        owners = cluster.owners(0)
        assert sorted(set(owners.values())) == [0, 1]
        for i in range(2):
            others = [u for u in users if owners[partition_for(u, PARTITIONS)] != i]
            mine = [u for u in users if owners[partition_for(u, PARTITIONS)] == i]
            assert others and mine
            got = rank_when_restored(cluster, i, others[::3] + mine[::9])
            for user, answer in got.items():
                assert_same_ranking(answer, want[user], user)
        with RankClient([inst.address for inst in cluster.instances]) as client:
            for user in users[::11]:
                assert_same_ranking(
                    client.rank(user, k=10, request_ts_ms=REQUEST_TS), want[user], user
                )
            assert client.counts["redirects"] == 0
        for i in range(2):
            assert cluster.stop(i) == 0, cluster.instances[i].log()[-3000:]
    finally:
        cluster.close()
        ref.close()


def rank_when_restored(cluster: Cluster, i: int, users: list[str]) -> dict[str, Any]:
    """Rank ``users`` through member ``i``. The claims may name a member while it still
    restores the partition (it claims first): the answer is then UNAVAILABLE with a retry
    hint, retried here for up to 30 s; any other failure fails the test."""
    stub = cluster.stub(i)
    out: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    for user in users:
        while True:
            try:
                out[user] = stub.Rank(
                    rank_pb2.RankRequest(user_id=user, k=10, request_ts_ms=REQUEST_TS), timeout=30
                )
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return out


def test_claims_fill_the_map_but_never_make_this_member_an_owner(tmp_path):
    cfg = Config()
    store = CheckpointStore(str(tmp_path / "ckpt"), StateLayout.from_config(cfg.memory, cfg.model))
    store.claim(0, 3, "a:1")  # mine now (own assignment below)
    store.claim(1, 3, "b:2")  # the other member's
    store.claim(2, 2, "a:1")  # mine before, gone now: nobody's until its new owner claims
    owners = OwnerMap(me="a:1")
    claimed = ClaimedOwners(owners, store, lambda: 4, poll_s=60)
    try:
        claimed.on_view(GroupView(5, 0, {0: Member("a:1")}, complete=False))
        claimed.refresh()
        own = owners.current
        assert (own.generation, own.partitions, own.owners) == (5, 4, {0: "a:1", 1: "b:2"})
        assert owners.owned_here() == [0]
        store.claim(2, 6, "c:3")  # the new owner claimed it
        claimed.refresh()
        assert owners.current.owners == {0: "a:1", 1: "b:2", 2: "c:3"}
        # a revoke: the same generation, a smaller own share; the claim still names us
        claimed.on_view(GroupView(5, 0, {}, complete=False))
        assert owners.current.owners == {1: "b:2", 2: "c:3"}
        assert owners.owned_here() == []
    finally:
        claimed.close()
