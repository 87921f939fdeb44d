"""The packed path between a front-end process and the engine process (docs/serving.md,
"Front-end processes", ``server.frontend_packed``).

Behind front ends the engine's process is one Python interpreter, and per RankBatch request
it would parse the candidates' id strings, look each up in the vocabulary, validate, and
build a response of id strings: most of its one core went there, not to the rank step
(bench/results/README.md, ``frontends_h200_roles_c6.json``). On the packed path a front end
does that work itself, with the same checks (``validation.to_queries``, over the vocabulary
and limits the engine process describes), and sends the engine numpy arrays: queries in,
item indices and scores out. Only the engine process's private socket serves these
methods, and only an instance without routing offers them (a forwarded or redirected call
needs the RankBatch path's per-request routing).

Methods (raw bytes, no protobuf messages): ``DESCRIBE`` answers JSON ``{"packed": bool,
"model_version", "vocab": ItemVocab.to_dict(), "limits": Limits as a dict}``; ``RANK``
takes ``pack_queries`` bytes and answers ``pack_results`` bytes, one result per query, in
order: a ranking, or the RankBatchResult failure RankBatch would have answered.

The arrays travel in one buffer (``pack_arrays``): a header of int64 [count, then (dtype
code, length) per array], then each array's bytes. Numbers are little-endian, as numpy
writes them on the hosts recmem runs on (front end and engine share one host).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from proto.recmem.v1 import rank_pb2
from recmem.queries import RankQuery, RankResult, UserEvents
from recmem.server.validation import Limits
from recmem.vocab import ItemVocab
from streams.validate import Limits as EventLimits

SERVICE = "recmem.internal.v1.Engine"
DESCRIBE = f"/{SERVICE}/Describe"
RANK = f"/{SERVICE}/RankPacked"

_DTYPES = (np.dtype("<i8"), np.dtype("<i4"), np.dtype("<f8"), np.dtype("u1"))
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_NO_CONTEXT = UserEvents.empty()


class PackedError(ValueError):
    """A packed buffer that does not hold what its header says."""


def pack_arrays(arrays: Sequence[np.ndarray]) -> bytes:
    """One buffer holding ``arrays`` (each 1-D, of a dtype in ``_DTYPES``)."""
    header = np.empty(1 + 2 * len(arrays), np.dtype("<i8"))
    header[0] = len(arrays)
    parts = []
    for i, a in enumerate(arrays):
        a = np.ascontiguousarray(a)
        header[1 + 2 * i] = _CODE[a.dtype]
        header[2 + 2 * i] = len(a)
        parts.append(a.tobytes())
    return header.tobytes() + b"".join(parts)


def unpack_arrays(data: bytes) -> list[np.ndarray]:
    """The arrays ``pack_arrays`` packed (read-only views of ``data``); PackedError when the
    buffer is short, long or names an unknown dtype."""
    try:
        n = int(np.frombuffer(data, np.dtype("<i8"), 1)[0])
        if not 0 <= n <= 64:
            raise PackedError(f"{n} arrays")
        header = np.frombuffer(data, np.dtype("<i8"), 1 + 2 * n)
        at = 8 * (1 + 2 * n)
        out = []
        for code, length in header[1:].reshape(n, 2).tolist():
            if not 0 <= code < len(_DTYPES) or length < 0:
                raise PackedError(f"array of dtype code {code}, length {length}")
            dtype = _DTYPES[code]
            out.append(np.frombuffer(data, dtype, length, at))
            at += length * dtype.itemsize
    except ValueError as e:  # frombuffer past the end (PackedError is one too)
        raise PackedError(f"malformed packed buffer: {e}") from None
    if at != len(data):
        raise PackedError(f"packed buffer holds {len(data) - at} bytes past its arrays")
    return out


def _offsets(lengths: np.ndarray) -> np.ndarray:
    ends = np.cumsum(lengths, dtype=np.int64)
    return np.concatenate([np.zeros(1, np.int64), ends])


def pack_queries(queries: Sequence[RankQuery]) -> bytes:
    """Validated queries (``validation.to_queries``'s) as one buffer."""
    users = [q.user_id.encode() for q in queries]
    cands = [q.candidates for q in queries]
    n_cand = np.array([-1 if c is None else len(c) for c in cands], np.int64)
    ctx = [q.context for q in queries]

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return pack_arrays(
        [
            np.array([len(u) for u in users], np.int64),
            np.frombuffer(b"".join(users), np.uint8),
            np.array([q.k for q in queries], np.int64),
            np.array([q.replay_notes for q in queries], np.int64),
            np.array([q.request_ts_ms for q in queries], np.int64),
            n_cand,
            cat([c for c in cands if c is not None]),
            np.array([len(c) for c in ctx], np.int64),
            cat([c.items for c in ctx if len(c)]),
            cat([c.actions for c in ctx if len(c)]),
            cat([c.ts_ms for c in ctx if len(c)]),
        ]
    )


def unpack_queries(data: bytes, n_items: int) -> list[RankQuery]:
    """``pack_queries``' queries; PackedError when the buffer is malformed or a candidate
    or context item is not an index of the ``n_items`` catalog items."""
    arrays = unpack_arrays(data)
    if len(arrays) != 11:
        raise PackedError(f"{len(arrays)} arrays in a packed query buffer, not 11")
    user_len, user_bytes, k, replay, ts, n_cand, cand, n_ctx, c_items, c_actions, c_ts = arrays
    n = len(user_len)
    if not all(len(a) == n for a in (k, replay, ts, n_cand, n_ctx)):
        raise PackedError("packed query columns differ in length")
    u_off, c_off, x_off = _offsets(user_len), _offsets(np.maximum(n_cand, 0)), _offsets(n_ctx)
    if (
        (user_len < 0).any()
        or (n_ctx < 0).any()
        or u_off[-1] != len(user_bytes)
        or c_off[-1] != len(cand)
        or not x_off[-1] == len(c_items) == len(c_actions) == len(c_ts)
    ):
        raise PackedError("packed query lengths do not add up")
    for items in (cand, c_items):
        if len(items) and (items.min() < 0 or items.max() >= n_items):
            raise PackedError(f"an item index outside the catalog of {n_items} items")
    raw = user_bytes.tobytes()
    out = []
    for u0, u1, c0, c1, nc, x0, x1, k_i, r_i, ts_i in zip(
        u_off[:-1].tolist(),
        u_off[1:].tolist(),
        c_off[:-1].tolist(),
        c_off[1:].tolist(),
        n_cand.tolist(),
        x_off[:-1].tolist(),
        x_off[1:].tolist(),
        k.tolist(),
        replay.tolist(),
        ts.tolist(),
        strict=True,
    ):
        context = (
            UserEvents(c_items[x0:x1], c_actions[x0:x1], c_ts[x0:x1]) if x1 > x0 else _NO_CONTEXT
        )
        out.append(
            RankQuery(
                raw[u0:u1].decode(),
                k_i,
                None if nc < 0 else cand[c0:c1],
                r_i,
                context,
                ts_i,
            )
        )
    return out


def pack_results(results: Sequence[RankResult | rank_pb2.RankBatchResult]) -> bytes:
    """Each query's answer: a RankResult, or the failed RankBatchResult RankBatch would
    have answered for it."""
    ok = [r for r in results if isinstance(r, RankResult)]
    failed = [b"" if isinstance(r, RankResult) else r.SerializeToString() for r in results]
    return pack_arrays(
        [
            np.array([len(f) for f in failed], np.int64),
            np.frombuffer(b"".join(failed), np.uint8),
            np.array([len(r.items) for r in ok], np.int64),
            np.concatenate([r.items for r in ok]).astype(np.int64) if ok else np.zeros(0, np.int64),
            np.concatenate([r.scores for r in ok]).astype(np.float64)
            if ok
            else np.zeros(0, np.float64),
            np.array(
                [
                    (r.position, r.cold_start, r.notes_replayed, r.context_applied, r.from_cache)
                    for r in ok
                ],
                np.int64,
            )
            .reshape(len(ok), 5)
            .ravel(),
        ]
    )


def fill_response(
    response: rank_pb2.RankResponse,
    item_ids: Sequence[str],
    items: Sequence[int],
    scores: Sequence[float],
    model_version: str,
    position: int,
    cold_start: bool,
    notes_replayed: int,
    context_applied: int,
) -> None:
    """Write one ranking into an empty RankResponse (the engine's RankBatch and Rank, and a
    front end's packed answers, build responses with this)."""
    add = response.items.add
    for i, s in zip(items, scores, strict=True):
        add(item_id=item_ids[i], score=s)
    response.model_version = model_version
    response.position = position
    response.cold_start = cold_start
    response.notes_replayed = notes_replayed
    response.context_applied = context_applied


def unpack_results(
    data: bytes, n: int, item_ids: Sequence[str], model_version: str
) -> list[rank_pb2.RankBatchResult]:
    """``pack_results``' answers as the RankBatchResults RankBatch would have answered;
    PackedError unless the buffer holds ``n`` of them."""
    arrays = unpack_arrays(data)
    if len(arrays) != 6:
        raise PackedError(f"{len(arrays)} arrays in a packed result buffer, not 6")
    fail_len, fail_bytes, n_items, items, scores, fields = arrays
    n_ok = len(n_items)
    i_off, f_off = _offsets(n_items), _offsets(fail_len)
    if (
        len(fail_len) != n
        or int((fail_len == 0).sum()) != n_ok
        or f_off[-1] != len(fail_bytes)
        or not i_off[-1] == len(items) == len(scores)
        or len(fields) != 5 * n_ok
        or (len(items) and (items.min() < 0 or items.max() >= len(item_ids)))
    ):
        raise PackedError(f"packed results do not answer {n} requests")
    raw = fail_bytes.tobytes()
    item_list, score_list = items.tolist(), scores.tolist()
    field_rows = fields.reshape(n_ok, 5).tolist()
    out = []
    j = 0
    for f0, f1 in zip(f_off[:-1].tolist(), f_off[1:].tolist(), strict=True):
        if f1 > f0:
            out.append(rank_pb2.RankBatchResult.FromString(raw[f0:f1]))
            continue
        i0, i1 = int(i_off[j]), int(i_off[j + 1])
        position, cold, notes, applied, _cached = field_rows[j]
        result = rank_pb2.RankBatchResult(code=0)
        fill_response(
            result.response,
            item_ids,
            item_list[i0:i1],
            score_list[i0:i1],
            model_version,
            position,
            bool(cold),
            notes,
            applied,
        )
        result.response.SetInParent()
        out.append(result)
        j += 1
    return out


def describe(packed: bool, model_version: str, vocab: ItemVocab, limits: Limits) -> bytes:
    """The engine process's answer to ``DESCRIBE``."""
    return json.dumps(
        {
            "packed": packed,
            "model_version": model_version,
            "vocab": vocab.to_dict(),
            "limits": dataclasses.asdict(limits),
        }
    ).encode()


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """What a front end needs to pack requests for the engine process and unpack answers."""

    packed: bool
    model_version: str
    vocab: ItemVocab
    limits: Limits

    @classmethod
    def parse(cls, data: bytes) -> EngineDescription:
        d: dict[str, Any] = json.loads(data)
        lim = dict(d["limits"])
        lim["events"] = EventLimits(**lim["events"])
        return cls(
            bool(d["packed"]),
            str(d["model_version"]),
            ItemVocab.from_dict(d["vocab"]),
            Limits(**lim),
        )
