"""The gRPC rank service over real gRPC on 127.0.0.1 (ephemeral ports): ranking, limits,
bearer token, TLS, health, reflection, micro-batching and graceful stop."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.recmem.v1 import event_pb2, rank_pb2, rank_pb2_grpc
from recmem.engine import EngineLoop
from recmem.server import RankServer
from tests.recmem.rank_env import N_ITEMS, RankEnv, make_env, start_loop, start_server

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"))


@pytest.fixture(scope="module")
def loop(env: RankEnv) -> Iterator[EngineLoop]:
    running = start_loop(env)
    yield running
    running.stop()


def start(env: RankEnv, loop: EngineLoop) -> RankServer:
    return start_server(env, loop)


@pytest.fixture(scope="module")
def server(env: RankEnv, loop: EngineLoop) -> Iterator[RankServer]:
    srv = start(env, loop)
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def channel(server: RankServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.Channel) -> rank_pb2_grpc.RecMemStub:
    return rank_pb2_grpc.RecMemStub(channel)


def ctx_event(item: str, ts: int, user: str = "") -> event_pb2.Event:
    return event_pb2.Event(user_id=user, item_id=item, ts_ms=ts, action=event_pb2.ACTION_CLICK)


def test_rank_returns_k_sorted_items_with_version_and_position(stub, env: RankEnv) -> None:
    res = stub.Rank(rank_pb2.RankRequest(user_id="user1", k=7), timeout=TIMEOUT)
    scores = [it.score for it in res.items]
    assert len(res.items) == 7
    assert scores == sorted(scores, reverse=True)
    assert len({it.item_id for it in res.items}) == 7
    assert all(it.item_id in env.vocab.index for it in res.items)
    assert res.model_version == "test-model"
    assert res.position == 40
    assert not res.cold_start


def test_candidates_are_a_subset_scored_like_the_catalog(stub) -> None:
    full = stub.Rank(rank_pb2.RankRequest(user_id="user2", k=N_ITEMS), timeout=TIMEOUT)
    by_id = {it.item_id: it.score for it in full.items}
    cands = [f"item{i}" for i in range(0, N_ITEMS, 3)]
    res = stub.Rank(
        rank_pb2.RankRequest(user_id="user2", k=5, candidate_item_ids=cands), timeout=TIMEOUT
    )
    assert len(res.items) == 5
    assert {it.item_id for it in res.items} <= set(cands)
    for it in res.items:
        assert it.score == pytest.approx(by_id[it.item_id], abs=1e-5)
    best = sorted(cands, key=lambda i: -by_id[i])[:5]
    assert [it.item_id for it in res.items] == best
    few = stub.Rank(
        rank_pb2.RankRequest(user_id="user2", k=10, candidate_item_ids=["item3", "item4"]),
        timeout=TIMEOUT,
    )
    assert len(few.items) == 2


def test_replay_on_reports_notes_and_changes_scores(stub) -> None:
    off = stub.Rank(rank_pb2.RankRequest(user_id="user3", k=10), timeout=TIMEOUT)
    on = stub.Rank(
        rank_pb2.RankRequest(
            user_id="user3", k=10, replay=rank_pb2.ReplayOptions(enabled=True, notes=2)
        ),
        timeout=TIMEOUT,
    )
    assert off.notes_replayed == 0
    assert 1 <= on.notes_replayed <= 2
    assert on.position == off.position == 40
    assert [it.score for it in on.items] != [it.score for it in off.items]


def test_a_repeated_replay_is_answered_from_the_cache(stub, server: RankServer) -> None:
    req = rank_pb2.RankRequest(
        user_id="user4", k=10, replay=rank_pb2.ReplayOptions(enabled=True, notes=3)
    )
    hits = server.metrics.replay_cache_hits._value.get()
    first = stub.Rank(req, timeout=TIMEOUT)
    second = stub.Rank(req, timeout=TIMEOUT)
    assert server.metrics.replay_cache_hits._value.get() == hits + 1
    assert [it.item_id for it in first.items] == [it.item_id for it in second.items]
    assert [it.score for it in first.items] == pytest.approx([it.score for it in second.items])
    assert first.notes_replayed == second.notes_replayed > 0


def test_unknown_user_gets_popularity_then_context_only(stub, env: RankEnv) -> None:
    res = stub.Rank(rank_pb2.RankRequest(user_id="nobody", k=5), timeout=TIMEOUT)
    assert res.cold_start and res.position == 0
    top = sorted(range(N_ITEMS), key=lambda i: (-env.popularity[i], i))[:5]
    assert [it.score for it in res.items] == pytest.approx([env.popularity[i] for i in top])
    ctx = stub.Rank(
        rank_pb2.RankRequest(user_id="nobody", k=5, context=[ctx_event("item1", 5_000)]),
        timeout=TIMEOUT,
    )
    assert not ctx.cold_start and ctx.context_applied == 1 and len(ctx.items) == 5


def test_inspect_user(stub) -> None:
    info = stub.InspectUser(rank_pb2.InspectUserRequest(user_id="user0"), timeout=TIMEOUT)
    # 40 events, N = 32, E = 4: every block is open; 5 closed chunks of 8 wrote notes
    assert info.known and info.position == 40
    assert info.unlocked_blocks == info.total_blocks == 4
    assert 5 <= info.note_count <= 10
    assert info.last_ts_ms > 0
    # 6 users, a slab of 4 and host room for 2: every tier but disk is in use
    tiers = {
        stub.InspectUser(rank_pb2.InspectUserRequest(user_id=f"user{u}")).resident_tier
        for u in range(6)
    }
    assert tiers == {"device", "host"}
    assert info.model_version == "test-model"
    none = stub.InspectUser(rank_pb2.InspectUserRequest(user_id="nobody"), timeout=TIMEOUT)
    assert not none.known and none.position == 0


MALFORMED = {
    "empty user": (rank_pb2.RankRequest(user_id="", k=3), "user_id is empty"),
    "k zero": (rank_pb2.RankRequest(user_id="u", k=0), "k must be positive"),
    "k negative": (rank_pb2.RankRequest(user_id="u", k=-4), "k must be positive"),
    "k too large": (rank_pb2.RankRequest(user_id="u", k=1001), "server.max_k"),
    "too many candidates": (
        rank_pb2.RankRequest(user_id="u", k=3, candidate_item_ids=[f"x{i}" for i in range(10_001)]),
        "server.max_candidates",
    ),
    "unknown candidate": (
        rank_pb2.RankRequest(user_id="u", k=3, candidate_item_ids=["item1", "no-such-item"]),
        "no-such-item",
    ),
    "duplicate candidates": (
        rank_pb2.RankRequest(user_id="u", k=3, candidate_item_ids=["item1", "item1"]),
        "duplicates",
    ),
    "oversized context": (
        rank_pb2.RankRequest(
            user_id="u", k=3, context=[ctx_event("item1", 10 + i) for i in range(257)]
        ),
        "server.max_context_events",
    ),
    "context without item": (
        rank_pb2.RankRequest(user_id="u", k=3, context=[ctx_event("", 10)]),
        "context[0].item_id is empty",
    ),
    "context without ts": (
        rank_pb2.RankRequest(user_id="u", k=3, context=[ctx_event("item1", 0)]),
        "ts_ms",
    ),
    "context of another user": (
        rank_pb2.RankRequest(user_id="u", k=3, context=[ctx_event("item1", 10, user="v")]),
        "differs",
    ),
    "context out of order": (
        rank_pb2.RankRequest(
            user_id="u", k=3, context=[ctx_event("item1", 20), ctx_event("item2", 10)]
        ),
        "oldest first",
    ),
    "context bad action": (
        rank_pb2.RankRequest(
            user_id="u",
            k=3,
            context=[event_pb2.Event(item_id="item1", ts_ms=10, action=42)],  # type: ignore[arg-type]
        ),
        "unknown action",
    ),
    "context nan value": (
        rank_pb2.RankRequest(
            user_id="u",
            k=3,
            context=[event_pb2.Event(item_id="item1", ts_ms=10, value=float("nan"))],
        ),
        "finite",
    ),
    "replay notes over limit": (
        rank_pb2.RankRequest(
            user_id="u", k=3, replay=rank_pb2.ReplayOptions(enabled=True, notes=33)
        ),
        "server.max_replay_notes",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_is_invalid_argument(stub, case: str) -> None:
    request, fragment = MALFORMED[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.Rank(request, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


def test_inspect_empty_user_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.InspectUser(rank_pb2.InspectUserRequest(user_id=""), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_serving_and_reflection_lists_service(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "recmem.v1.RecMem"):
        res = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
        assert res.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"recmem.v1.RecMem", "grpc.health.v1.Health"} <= names


def test_rank_batch_answers_each_request_like_rank(stub, server: RankServer) -> None:
    """One RankBatch call: a result per request in order, each what Rank answers; a bad
    request fails alone with Rank's status and message; the call's size is bounded."""
    reqs = [rank_pb2.RankRequest(user_id=f"user{u}", k=4) for u in range(6)]
    reqs.insert(2, rank_pb2.RankRequest(user_id="user1", k=0))  # malformed
    reqs.append(rank_pb2.RankRequest(user_id="nobody", k=3))  # cold start
    ok_before = (
        server.metrics.registry.get_sample_value("recmem_rank_requests_total", {"code": "OK"}) or 0
    )
    got = stub.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), timeout=TIMEOUT)
    assert len(got.results) == len(reqs)
    for req, res in zip(reqs, got.results):
        if req.k == 0:
            assert res.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "k must be positive" in res.message and not res.HasField("response")
            continue
        alone = stub.Rank(req, timeout=TIMEOUT)
        assert res.code == 0
        assert [it.item_id for it in res.response.items] == [it.item_id for it in alone.items]
        assert [it.score for it in res.response.items] == pytest.approx(
            [it.score for it in alone.items], abs=1e-5
        )
        assert (res.response.position, res.response.cold_start) == (
            alone.position,
            alone.cold_start,
        )
    assert got.results[-1].response.cold_start
    reg = server.metrics.registry
    # the batch's 7 good requests and the 7 single Rank calls after it
    assert reg.get_sample_value("recmem_rank_requests_total", {"code": "OK"}) == ok_before + 14
    for n, what in ((0, "holds 0 requests"), (257, "server.max_batch_requests")):
        batch = rank_pb2.RankBatchRequest(requests=[reqs[0]] * n)
        with pytest.raises(grpc.RpcError) as err:
            stub.RankBatch(batch, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert what in (err.value.details() or "")


def test_rank_batch_shares_engine_steps(tmp_path: Path) -> None:
    env = make_env(tmp_path / "spill")
    loop = start_loop(env, window_ms=200.0, adaptive=False)
    srv = start(env, loop)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            reqs = [rank_pb2.RankRequest(user_id=f"user{i % 6}", k=3) for i in range(12)]
            got = stub.RankBatch(rank_pb2.RankBatchRequest(requests=reqs), timeout=TIMEOUT)
        assert [r.code for r in got.results] == [0] * 12
        assert loop.counts.requests == 12
        assert loop.counts.batches < 12 and loop.counts.largest_batch > 1
    finally:
        srv.stop(grace=1.0)
        loop.stop()
        env.built.close()


def test_concurrent_requests_are_micro_batched(tmp_path: Path) -> None:
    env = make_env(tmp_path / "spill")
    loop = start_loop(env, window_ms=300.0, adaptive=False)
    srv = start(env, loop)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            stub.Rank(rank_pb2.RankRequest(user_id="user0", k=1), timeout=TIMEOUT)  # warm up
            barrier = threading.Barrier(12)
            results: list[rank_pb2.RankResponse] = []

            def call(i: int) -> None:
                barrier.wait()
                req = rank_pb2.RankRequest(user_id=f"user{i % 6}", k=3)
                results.append(stub.Rank(req, timeout=TIMEOUT))

            threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
        assert len(results) == 12
        counts = loop.counts
        assert counts.requests == 13
        assert counts.largest_batch > 1
        assert counts.batches < 13
        reg = srv.metrics.registry
        assert reg.get_sample_value("recmem_rank_requests_total", {"code": "OK"}) == 13
        assert reg.get_sample_value("recmem_rank_batch_size_count") == counts.batches
        assert reg.get_sample_value("recmem_rank_batch_size_sum") == 13
    finally:
        srv.stop(grace=1.0)
        loop.stop()
        env.built.close()


def test_bearer_token_required_and_accepted(env: RankEnv, loop: EngineLoop) -> None:
    env.cfg.server.auth_token = "s3cret"
    try:
        srv = start(env, loop)
    finally:
        env.cfg.server.auth_token = ""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            req = rank_pb2.RankRequest(user_id="user0", k=2)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Rank(req, timeout=TIMEOUT, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.Rank(req, timeout=TIMEOUT, metadata=(("authorization", "Bearer s3cret"),))
            assert len(ok.items) == 2
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=1.0)


def self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "server.crt", tmp / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_with_self_signed_certificate(env: RankEnv, loop: EngineLoop, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    env.cfg.server.tls_cert, env.cfg.server.tls_key = str(cert), str(key)
    try:
        srv = start(env, loop)
    finally:
        env.cfg.server.tls_cert = env.cfg.server.tls_key = ""
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(f"127.0.0.1:{srv.port}", creds, options=options) as ch:
            res = rank_pb2_grpc.RecMemStub(ch).Rank(
                rank_pb2.RankRequest(user_id="user0", k=3), timeout=TIMEOUT
            )
            assert len(res.items) == 3
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                rank_pb2_grpc.RecMemStub(plain).Rank(
                    rank_pb2.RankRequest(user_id="user0", k=3), timeout=5.0
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=1.0)


def test_tls_misconfiguration_is_a_clear_error(
    env: RankEnv, loop: EngineLoop, tmp_path: Path
) -> None:
    env.cfg.server.tls_cert = str(tmp_path / "missing.crt")
    env.cfg.server.tls_key = str(tmp_path / "missing.key")
    try:
        with pytest.raises(ValueError, match="file not found"):
            start(env, loop)
    finally:
        env.cfg.server.tls_cert = env.cfg.server.tls_key = ""


def test_stop_reports_not_serving_and_refuses_new_calls(env: RankEnv, loop: EngineLoop) -> None:
    srv = start(env, loop)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = rank_pb2_grpc.RecMemStub(ch)
        assert (
            len(stub.Rank(rank_pb2.RankRequest(user_id="user0", k=1), timeout=TIMEOUT).items) == 1
        )
        srv.stop(grace=1.0)
        assert srv.wait(timeout=5.0)
        with pytest.raises(grpc.RpcError):
            stub.Rank(rank_pb2.RankRequest(user_id="user0", k=1), timeout=5.0)


def test_serve_runs_ingest_and_rank_in_one_process(kafka_config, tmp_path: Path) -> None:
    """`recmem serve` pieces end to end: events through the real broker into the engine and
    archive, ranked over gRPC, checkpointed on stop."""
    from recmem.modelstore import save_model
    from recmem.server.serve import RecMemService
    from streams.codec import make_event
    from streams.producer import EventProducer

    env = make_env(tmp_path / "spill-env", n_users=1)
    cfg = env.cfg
    cfg.kafka = kafka_config(partitions=2)
    cfg.server.model_dir = str(tmp_path / "model")
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.checkpoint.full_every = 1  # serve honours it: every checkpoint full
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        cfg.server.metrics_port = sock.getsockname()[1]
    save_model(cfg.server.model_dir, env.model, env.vocab, cfg, {"popularity": env.popularity})
    events = [
        make_event(
            f"kafka-user{u}", f"item{(7 * i + u) % N_ITEMS}", 1_000_000 + 60_000 * i, "click"
        )
        for i in range(20)
        for u in range(3)
    ]
    producer = EventProducer(cfg.kafka)
    assert producer.send(events, progress=False) == 60
    producer.close()
    svc = RecMemService(cfg, device="cpu").start()
    assert svc.ingest is not None and svc.ingest.full_every == 1
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            deadline = time.monotonic() + 60
            hints = 0
            while time.monotonic() < deadline:
                try:
                    infos = [
                        stub.InspectUser(rank_pb2.InspectUserRequest(user_id=f"kafka-user{u}"))
                        for u in range(3)
                    ]
                except grpc.RpcError as e:
                    # before its partitions are assigned and restored: UNAVAILABLE with a
                    # retry hint, never a cold "unknown user"
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    md = dict(e.trailing_metadata())
                    assert int(md["grpc-retry-pushback-ms"]) > 0
                    hints += 1
                    time.sleep(0.2)
                    continue
                if all(i.position == 20 for i in infos):
                    break
                time.sleep(0.2)
            assert [i.position for i in infos] == [20, 20, 20]
            assert all(i.note_count >= 1 for i in infos)
            # partitions restored and consuming: the service reports ready
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="recmem.v1.RecMem"), timeout=TIMEOUT
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            res = stub.Rank(
                rank_pb2.RankRequest(
                    user_id="kafka-user1", k=5, replay=rank_pb2.ReplayOptions(enabled=True)
                ),
                timeout=TIMEOUT,
            )
            assert len(res.items) == 5 and res.position == 20 and res.notes_replayed >= 1
            url = f"http://127.0.0.1:{cfg.server.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as page:
                text = page.read().decode()
            assert 'recmem_rank_requests_total{code="OK"}' in text
            assert "recmem_ingest_events_total 60.0" in text
            # the ingest figures of `recmem ingest` (the same adapter): bytes per user state
            assert (
                f"recmem_ingest_bytes_per_user {float(svc.built.engine.store.bytes_per_user())}"
                in text
            )
            assert "recmem_ingest_duplicate_events_total 0.0" in text
            assert res.model_version.startswith("memory-E4-N32-")
    finally:
        svc.stop(grace=1.0)
    assert svc.failure is None
    metas = [json.loads(m.read_text()) for m in Path(cfg.checkpoint.dir).rglob("meta.json")]
    assert metas and all(m["kind"] == "full" for m in metas)
    # a restart restores states, notes and the recent-event tails from the checkpoint
    svc = RecMemService(cfg, device="cpu").start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    info = stub.InspectUser(rank_pb2.InspectUserRequest(user_id="kafka-user1"))
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    time.sleep(0.2)
                    continue
                if info.position == 20:
                    break
                time.sleep(0.2)
            assert info.position == 20 and info.note_count >= 1
            again = stub.Rank(
                rank_pb2.RankRequest(
                    user_id="kafka-user1", k=5, replay=rank_pb2.ReplayOptions(enabled=True)
                ),
                timeout=TIMEOUT,
            )
            assert [i.item_id for i in again.items] == [i.item_id for i in res.items]
            assert again.notes_replayed == res.notes_replayed
    finally:
        svc.stop(grace=1.0)


def test_recent_events_travel_with_the_checkpoint(env: RankEnv, loop: EngineLoop) -> None:
    from recmem.engine import RecentEvents

    users = ["user0", "user3", "nobody"]
    tails = env.engine.tails
    exported = loop.read(lambda: tails.export(users)).result(TIMEOUT)
    fresh = RecentEvents(tails.keep)
    fresh.load(users, exported)
    for user in users:
        want = loop.read(lambda u=user: (tails.recent(u, 5), tails.recent_queries(u, 5)))
        events, queries = want.result(TIMEOUT)
        assert fresh.recent(user, 5).ts_ms.tolist() == events.ts_ms.tolist()
        a = fresh.recent_queries(user, 5)
        assert (a is None) == (queries is None)
        if a is not None:
            assert np.array_equal(a, queries)
    with pytest.raises(ValueError, match="users restored"):
        fresh.load(users[:2], exported)


def test_not_serving_until_ready(env: RankEnv, loop: EngineLoop) -> None:
    srv = RankServer(env.cfg, loop, env.vocab, "test-model").start(ready=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status() -> int:
                request = health_pb2.HealthCheckRequest(service="recmem.v1.RecMem")
                return health.Check(request, timeout=TIMEOUT).status

            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            srv.mark_ready()
            assert status() == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=1.0)
