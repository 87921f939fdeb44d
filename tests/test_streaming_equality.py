"""End to end: the served path computes what offline evaluation computes (issue 10).

A tiny model with the full read-out head (MAC window attention, request-time features) is
trained with ``recmem train``'s function; every event of the dataset is streamed through the
real broker into ``recmem serve`` (RecMemService: consumer, engine loop, NoteBank, gRPC);
then Rank is called over real gRPC at a request time T for several users, with and without
NoteBank replay, and its scores are compared with offline evaluation's: the model's user
vectors after each user's last event asked at T (``MemoryRecommender.user_vectors``, what
``memory-proteus`` scores) and the NoteBank scorer's (``memory-proteus-notebank``), each
scored against the same candidates. The model has a learned replay fusion (issue 12), trained
by replay-aware training and then set to weights far from "no replay", so that replay goes
through the fusion on every path; the offline replay scorer of replay-aware training
(``ReplayScorer``) gives the same vectors as the service."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from offline_eval.notebank_eval import NotebankScorer
from offline_eval.replay_training import ReplayScorer
from offline_eval.training import prepare_split, run_train
from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.datasets import load_dataset
from recmem.modelstore import load_model, save_model
from recmem.server.serve import RecMemService
from streams.codec import make_event
from streams.producer import EventProducer
from tests.offline_eval.test_training import tiny_cfg, write_csv

TIMEOUT = 30.0


def test_rank_over_grpc_equals_offline_evaluation(tmp_path: Path, kafka_config) -> None:
    csv = tmp_path / "events.csv"
    write_csv(csv, n_users=24, n_items=25, per_user=30)
    cfg = tiny_cfg(tmp_path, f"csv:{csv}")
    cfg.train.epochs = 1
    cfg.model.hybrid = "mac"
    cfg.model.window = 4
    cfg.model.request_time = "gap_clock"
    cfg.archive.chunk_events = 8
    cfg.archive.window = 2
    cfg.archive.max_span = 4
    cfg.archive.address_dim = 8
    cfg.model.replay_fusion = "gate"
    cfg.train.replay_steps = 2
    metrics = run_train(cfg, tmp_path / "model")
    assert metrics["replay_training"]["steps"] == 2
    model, vocab, model_cfg, extra = load_model(tmp_path / "model")
    assert model_cfg.model.hybrid == "mac" and model_cfg.model.request_time == "gap_clock"
    assert model.fusion is not None
    with torch.no_grad():  # far from "no replay", so that the fusion shows in every answer
        model.fusion.scale.fill_(0.7)
        model.fusion.gate.weight.normal_(0.0, 0.2)
    save_model(tmp_path / "model", model, vocab, model_cfg, extra)

    serve_cfg = copy.deepcopy(cfg)
    serve_cfg.kafka = kafka_config(partitions=3)
    serve_cfg.server.model_dir = str(tmp_path / "model")
    serve_cfg.server.port = 0
    serve_cfg.server.metrics_port = 0
    serve_cfg.checkpoint.dir = str(tmp_path / "ckpt")
    serve_cfg.state.spill_dir = str(tmp_path / "spill")
    serve_cfg.state.device_capacity = 8  # users move through the host tier too
    serve_cfg.state.host_capacity = 8
    data = load_dataset(cfg.data.dataset, cfg.data)  # time order, as recmem produce sends it
    rows = data.events.select("user_id", "item_id", "ts_ms", "action").rows()
    with EventProducer(serve_cfg.kafka) as producer:
        producer.send((make_event(u, i, ts, a) for u, i, ts, a in rows), progress=False)
    counts: dict[str, int] = {}
    for u, *_ in rows:
        counts[u] = counts.get(u, 0) + 1

    split = prepare_split(cfg)
    seqs = split.seqs
    users = [seqs.user_ids[b] for b in range(0, seqs.n_users, 4)]
    last = np.array([seqs.offsets[seqs.user_ids.index(u) + 1] - 1 for u in users])
    T = int(seqs.ts_ms.max()) + 2 * 3600 * 1000 + 17 * 60 * 1000  # "now": after every event
    request_ts = np.full(len(users), T, dtype=np.int64)
    candidates = vocab.item_ids[: min(20, vocab.n_items)]
    cand_idx = torch.as_tensor([vocab.index[i] for i in candidates])
    items = model.item_matrix()[cand_idx]
    with torch.no_grad():
        plain = model.user_vectors(seqs, last, request_ts) @ items.T
        replay_cfg = copy.deepcopy(model_cfg)
        replay_cfg.archive = cfg.archive
        replay_cfg.server = cfg.server
        scorer = NotebankScorer(model, replay_cfg, vocab, replay_notes=2)
        replayed = scorer.user_vectors(seqs, last, request_ts) @ items.T
        offline = ReplayScorer(model, replay_cfg, replay_notes=2)
        torch.testing.assert_close(
            offline.user_vectors(seqs, last, request_ts) @ items.T, replayed, atol=1e-4, rtol=1e-4
        )
    assert scorer.stats["replayed"] > 0
    assert not torch.allclose(plain, replayed, atol=1e-3)  # replay changes the answers

    svc = RecMemService(serve_cfg, device="cpu").start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            stub = rank_pb2_grpc.RecMemStub(ch)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    got = [
                        stub.InspectUser(rank_pb2.InspectUserRequest(user_id=u), timeout=TIMEOUT)
                        for u in counts
                    ]
                except grpc.RpcError as e:  # before the partitions are assigned and restored
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    time.sleep(0.3)
                    continue
                if all(g.position == counts[g.user_id] for g in got):
                    break
                time.sleep(0.3)
            assert {g.user_id: g.position for g in got} == counts
            for b, user in enumerate(users):
                for replay, want in ((False, plain), (True, replayed)):
                    res = stub.Rank(
                        rank_pb2.RankRequest(
                            user_id=user, k=len(candidates), candidate_item_ids=candidates,
                            replay=rank_pb2.ReplayOptions(enabled=replay, notes=2),
                            request_ts_ms=T,
                        ),
                        timeout=TIMEOUT,
                    )  # fmt: skip
                    served = {it.item_id: it.score for it in res.items}
                    offline = dict(zip(candidates, want[b].tolist(), strict=True))
                    assert served.keys() == offline.keys()
                    for item, score in served.items():
                        assert abs(score - offline[item]) <= 1e-4 + 1e-4 * abs(score), (
                            user, replay, item, score, offline[item],
                        )  # fmt: skip
                    if replay:
                        assert res.notes_replayed == 2, user
    finally:
        svc.stop(grace=1.0)
    assert svc.failure is None
