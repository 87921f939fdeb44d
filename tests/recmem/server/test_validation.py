"""RankRequest validation applies the Kafka consumer's time bounds to context events."""

from __future__ import annotations

import time

import pytest

from proto.recmem.v1 import event_pb2, rank_pb2
from recmem.config import Config
from recmem.server import limits_from_config
from recmem.server.validation import InvalidRequest, to_query
from recmem.vocab import ItemVocab

VOCAB = ItemVocab(["a", "b"], 4)


def request(ts_ms: int) -> rank_pb2.RankRequest:
    event = event_pb2.Event(item_id="a", ts_ms=ts_ms, action=event_pb2.ACTION_CLICK)
    return rank_pb2.RankRequest(user_id="u", k=1, context=[event])


def test_context_times_before_min_ts_are_refused_and_seconds_named() -> None:
    limits = limits_from_config(Config())
    now_ms = int(time.time() * 1000)
    assert to_query(request(now_ms), VOCAB, limits).context.ts_ms.tolist() == [now_ms]
    with pytest.raises(InvalidRequest, match=r"context\[0\]: .*looks like seconds"):
        to_query(request(now_ms // 1000), VOCAB, limits)
    with pytest.raises(InvalidRequest, match=r"before kafka.min_ts_ms"):
        to_query(request(1), VOCAB, limits)
