"""Two `recmem serve` services in one consumer group on the real broker (in this process; b
also with front-end processes, server.frontends, or with consumer processes):
both learn the same partition -> owner map; a Rank or InspectUser for a user the other one
owns is forwarded (one hop) and answers exactly what the owner answers; a redirecting
instance names the owner; a forwarded call is never forwarded again; RankClient routes by
key and follows redirects; RankBatch routes each of its requests the same way."""

from __future__ import annotations

import copy
import time

import grpc
import pytest

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.client import RankClient
from recmem.modelstore import save_model
from recmem.server.routing import FORWARDED
from recmem.server.serve import RecMemService
from streams.codec import make_event
from streams.partitioner import partition_for
from streams.producer import EventProducer
from tests.recmem.rank_env import N_ITEMS, make_env

REQUEST_TS = 1_000_000 + 60_000 * 40


def wait_until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(
    params=[(0, 0, "threads"), (2, 0, "threads"), (2, 0, "aio"), (0, 2, "threads")],
    ids=["one-process", "b-frontends", "b-frontends-aio", "b-consumer-processes"],
)
def pair(request, tmp_path, kafka_config):
    """Services a (forward) and b (redirect; with ``server.frontends`` = the param's first
    value: its answers, redirects included, come through front-end processes, of
    ``server.frontend_mode`` = its third; with ``kafka.consumer_processes`` = its second: b
    is two members of the group, in processes of their own, that feed b's one engine)."""
    env = make_env(tmp_path / "spill-env", n_users=1)
    cfg = env.cfg
    cfg.kafka = kafka_config(partitions=4)
    cfg.server.model_dir = str(tmp_path / "model")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.checkpoint.interval_s = 0.5
    cfg.server.metrics_port = 0
    save_model(cfg.server.model_dir, env.model, env.vocab, cfg, {"popularity": env.popularity})
    users = [f"u{n}" for n in range(16)]
    counts = {u: 3 + i % 5 for i, u in enumerate(users)}
    events = [
        make_event(u, f"item{(7 * i + j) % N_ITEMS}", 1_000_000 + 60_000 * i, "click")
        for i in range(max(counts.values()))
        for j, u in enumerate(users)
        if i < counts[u]
    ]
    with EventProducer(cfg.kafka) as producer:
        producer.send(events, progress=False)
    cfg_b = copy.deepcopy(cfg)
    cfg_b.server.routing = "redirect"
    cfg_b.server.frontends, cfg_b.kafka.consumer_processes, cfg_b.server.frontend_mode = (
        request.param
    )
    a = RecMemService(cfg, device="cpu").start()
    b = RecMemService(cfg_b, device="cpu").start()
    try:
        wait_until(
            lambda: (
                a.ingest.assigned
                and b.ingest.assigned
                and len(a.ingest.assigned | b.ingest.assigned) == 4
                and a.owners.current.generation == b.owners.current.generation
                and a.built.engine.totals.events + b.built.engine.totals.events >= len(events)
            ),
            90,
            "both services to own and restore partitions and apply every event",
        )
        yield a, b, counts
    finally:
        a.stop(grace=0.5)
        b.stop(grace=0.5)


def rank_at(port: int, user: str, metadata=()):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return rank_pb2_grpc.RecMemStub(ch).Rank(
            rank_pb2.RankRequest(user_id=user, k=5, request_ts_ms=REQUEST_TS),
            timeout=10,
            metadata=metadata,
        )


def routing_at(port: int):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return rank_pb2_grpc.RecMemStub(ch).Routing(rank_pb2.RoutingRequest(), timeout=10)


def test_forward_redirect_and_the_client(pair):
    a, b, counts = pair
    ra, rb = routing_at(a.port), routing_at(b.port)
    assert ra.generation == rb.generation and ra.partitions == rb.partitions == 4
    assert list(ra.owners) == list(rb.owners) and len(ra.owners) == 4
    assert ra.address == a.server.address and rb.address == b.server.address
    owner_port = {p.partition: int(p.address.rsplit(":", 1)[1]) for p in ra.owners}
    for user, n in counts.items():
        p = partition_for(user, 4)
        assert p in (a.ingest.assigned if owner_port[p] == a.port else b.ingest.assigned)
        direct = rank_at(owner_port[p], user)
        assert direct.position == n and not direct.cold_start
        if owner_port[p] == b.port:
            # a forwards to b: the owner's answer, unchanged
            via = rank_at(a.port, user)
            assert via == direct
        else:
            # b redirects: FAILED_PRECONDITION naming a
            with pytest.raises(grpc.RpcError) as err:
                rank_at(b.port, user)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            md = dict(err.value.trailing_metadata())
            assert md["recmem-owner"] == a.server.address
            assert int(md["recmem-partition"]) == p
            # a call that was forwarded already is never forwarded again
        if owner_port[p] == b.port:
            with pytest.raises(grpc.RpcError) as err:
                rank_at(a.port, user, metadata=((FORWARDED, "elsewhere:1"),))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a user never seen: the cold-start answer, from its owner
    never = "never-seen-user"
    got = rank_at(a.port, never)
    assert got.cold_start and got.position == 0
    # the client routes by key (no redirects needed once it has the map), through b only
    with RankClient([f"127.0.0.1:{b.port}"]) as client:
        for user, n in counts.items():
            res = client.rank(user, k=5, request_ts_ms=REQUEST_TS)
            assert res == rank_at(owner_port[partition_for(user, 4)], user)
            assert client.inspect(user).position == n
        assert client.counts["redirects"] == 0
        assert client.owner_of(never) is not None
    # a client whose map is wrong follows the redirect
    with RankClient([f"127.0.0.1:{b.port}"]) as client:
        client.refresh()
        client._owners = {p: b.server.address for p in range(4)}  # a stale map
        for user, n in counts.items():
            assert client.rank(user, k=5, request_ts_ms=REQUEST_TS).position == n
        assert client.counts["redirects"] > 0
    text = a.metrics.registry.get_sample_value("recmem_rank_routes_total", {"route": "forwarded"})
    assert text and text > 0
    # RankClient.rank_batch: one call per owner, every answer the owner's; through a stale
    # map (everything at b) the requests b does not own are sent again alone
    with RankClient([f"127.0.0.1:{b.port}"]) as client:
        reqs = [rank_pb2.RankRequest(user_id=u, k=5, request_ts_ms=REQUEST_TS) for u in counts]
        for stale in (False, True):
            if stale:
                client._owners = {p: b.server.address for p in range(4)}
            got = client.rank_batch(reqs)
            assert [r.code for r in got] == [0] * len(reqs)
            assert [r.response.position for r in got] == list(counts.values())
        assert client.counts["redirects"] > 0
    # RankBatch routes each request like Rank: a forwards (every answer is the owner's), b
    # redirects (a result per request, naming the owner)
    reqs = [rank_pb2.RankRequest(user_id=u, k=5, request_ts_ms=REQUEST_TS) for u in counts]
    for port in (a.port, b.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            got = rank_pb2_grpc.RecMemStub(ch).RankBatch(
                rank_pb2.RankBatchRequest(requests=reqs), timeout=20
            )
        assert len(got.results) == len(reqs)
        for user, r in zip(counts, got.results):
            owner = owner_port[partition_for(user, 4)]
            if port == b.port and owner == a.port:
                assert r.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
                assert r.owner == a.server.address and not r.HasField("response")
                assert r.partition == partition_for(user, 4)
                assert r.generation == b.owners.current.generation
            else:
                alone = rank_at(owner, user)  # scores equal up to the batch's float order
                assert r.code == 0 and r.response.position == alone.position
                assert [i.item_id for i in r.response.items] == [i.item_id for i in alone.items]
                assert [i.score for i in r.response.items] == pytest.approx(
                    [i.score for i in alone.items], abs=1e-5
                )
