"""The rank step (SPEC sections 5-6): top-k items for a micro-batch of requests, read from
COPIES of the users' live memory states. A rank call never changes the live state.

For each request of a micro-batch:

1. Copy the user's state (``RankSources.snapshot``); position 0 means the user is unknown.
2. Query events (the "question" of the NoteBank paper: what the next item should follow):
   the request's context events when it has any, else, only when replay is on, the user's
   latest ``query_events`` applied events as the engine recorded them.
3. Route (replay on): the masked queries q~ of the query events go to the archive, which
   votes per channel and returns the top-R notes in time order. For context events q~ is
   computed by running them on a temporary copy of the state (positions continue after
   the user's position); for the user's own latest events it is the q~ the engine
   computed when it applied them (kept with the raw events), which is the same quantity
   at the same positions, so no extra pass is needed.
4. Final pass, on the copy: the notes' raw events (chronological, positions continuing
   after the user's position), then the query events, so the read-out sits on the user's
   most recent event with the replayed evidence in memory (without context this re-reads
   the latest event once more on the copy). Without replay only the context events run
   (none: the copy's stored read-out ``h`` is the user vector).
5. Score the user vector against the candidates or the whole TRAIN catalog; top-k.

Steps 3 and 4 are each at most ONE padded ``advance`` over the requests of the micro-batch
that need it, and scoring is one matmul for the whole-catalog requests plus one for the
candidate requests.

An unknown user without context gets TRAIN popularity (``cold_start``); with context the
answer comes from the context alone (a fresh zero state).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from models.graphs import GraphedReadout, GraphedReplay
from models.recommender import MemoryRecommender
from models.state import MemoryState
from recmem.archive.routing import ROUTINGS, overlap_weights
from recmem.queries import Events, RankQuery, RankResult, UserEvents
from recmem.rows import ragged_arange

log = logging.getLogger(__name__)


class ReplayCache:
    """User vectors after replay per (user, R), LRU, at most ``size`` entries (0 = off).

    Without context a replay request's answer depends only on the user's state, latest
    events and notes, which change only when the engine changes the user; the engine owns
    the cache and forgets every user it changes (applied events, restored or dropped
    partitions), so a kept vector is always the one a fresh replay gives."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError("replay cache size must be >= 0")
        self.size = size
        self._kept: OrderedDict[tuple[str, int], tuple[torch.Tensor, int]] = OrderedDict()
        self._keys_of: dict[str, set[int]] = {}
        self.counts = {"hits": 0, "stored": 0}
        """Replay requests answered from the cache, and vectors stored into it."""

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, user_id: str, r: int) -> tuple[torch.Tensor, int] | None:
        """(memory read-out after replay, notes replayed), or None."""
        got = self._kept.get((user_id, r))
        if got is not None:
            self._kept.move_to_end((user_id, r))
            self.counts["hits"] += 1
        return got

    def put(self, user_id: str, r: int, vec: torch.Tensor, notes: int) -> None:
        if self.size == 0:
            return
        self._kept[(user_id, r)] = (vec, notes)
        self._kept.move_to_end((user_id, r))
        self._keys_of.setdefault(user_id, set()).add(r)
        self.counts["stored"] += 1
        while len(self._kept) > self.size:
            (old, old_r), _ = self._kept.popitem(last=False)
            self._keys_of.get(old, set()).discard(old_r)

    def forget(self, user_ids: Sequence[str]) -> None:
        if not self._kept:
            return
        for user in user_ids:
            for r in self._keys_of.pop(user, ()):
                self._kept.pop((user, r), None)


class BatchRanker(Protocol):
    """What the service runs per micro-batch: the Ranker, or a baseline behind the same API."""

    @property
    def n_items(self) -> int: ...

    def rank(self, queries: Sequence[RankQuery]) -> list[RankResult]: ...


class RankSources(Protocol):
    """What the rank step reads from the engine and the archive (all read-only)."""

    def snapshot(self, user_ids: Sequence[str]) -> MemoryState:
        """A copy of the users' states (zeros, position 0, for unknown users)."""
        ...

    def recent_events_many(self, user_ids: Sequence[str], n: int) -> list[UserEvents]:
        """For each of ``user_ids``, in order: up to ``n`` of the user's latest applied raw
        events (empty when not kept)."""
        ...

    def recent_queries_many(self, user_ids: Sequence[str], n: int) -> list[torch.Tensor | None]:
        """For each of ``user_ids``, in order: q~ [n', L, H, K] the engine computed for the
        same events ``recent_events_many`` returns (None when not kept: the Ranker then
        computes them on a copy)."""
        ...

    def route_many(
        self, requests: Sequence[tuple[str, torch.Tensor, int]]
    ) -> Sequence[Sequence[Events]]:
        """Top ``n_notes`` notes (their events) for query features [Q, L, H, d] (the
        model's ``route_features`` of the masked queries q~), in time order, for several
        (user, features, n_notes) requests at once, answers in order."""
        ...

    def route_overlap_many(
        self,
        requests: Sequence[tuple[str, Mapping[int, float], Mapping[int, float], int]],
        item_cat: np.ndarray | None,
    ) -> Sequence[Sequence[Events]]:
        """Top ``n_notes`` notes (their events) by item / category overlap
        (``archive.routing`` lexical or candidates; recmem/archive/routing.py) for (user,
        item weights, category weights, n_notes) requests, in time order."""
        ...


@dataclass(frozen=True)
class UserVectors:
    """``Ranker.user_vectors``: one row per query."""

    vectors: torch.Tensor
    """[B, D] user vectors at each request's time."""
    positions: list[int]
    """The users' live positions (before context and replay)."""
    notes_replayed: list[int]
    from_cache: list[bool]


def train_popularity(items: np.ndarray, n_items: int) -> np.ndarray:
    """[n_items] float32 share of TRAIN events per item (OOV indices are ignored)."""
    items = np.asarray(items, dtype=np.int64)
    counts = np.bincount(items[(items >= 0) & (items < n_items)], minlength=n_items)
    total = max(int(counts.sum()), 1)
    return (counts / total).astype(np.float32)


def _pad(rows: Sequence[UserEvents], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded [B, T] items, actions, ts and lengths [B] (int64, on ``device``)."""
    B = len(rows)
    T = max((len(r) for r in rows), default=0)
    items = np.zeros((B, T), dtype=np.int64)
    actions = np.zeros((B, T), dtype=np.int64)
    ts = np.zeros((B, T), dtype=np.int64)
    lengths = np.zeros(B, dtype=np.int64)
    for b, r in enumerate(rows):
        n = len(r)
        items[b, :n], actions[b, :n], ts[b, :n], lengths[b] = r.items, r.actions, r.ts_ms, n
    return tuple(torch.from_numpy(a).to(device) for a in (items, actions, ts, lengths))


def _pad_joined(rows: Sequence[Sequence[Events]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``_pad([UserEvents.concat(parts) for parts in rows], device)`` (its plain form) with
    one concatenation of every part of every row per field and one scatter into the padded
    arrays, not a concatenation per row and a copy per row."""
    B = len(rows)
    parts = [p for ps in rows for p in ps]
    items = [p.items for p in parts]
    sizes = np.fromiter(map(len, items), dtype=np.int64, count=len(parts))
    owner = np.repeat(np.arange(B), [len(ps) for ps in rows])
    lengths = np.bincount(owner, weights=sizes, minlength=B).astype(np.int64)
    T = int(lengths.max()) if B else 0
    cells = ragged_arange(np.arange(B, dtype=np.int64) * T, lengths)  # valid cells of [B, T]
    full = np.flatnonzero(sizes).tolist()
    out = []
    for col in (items, [p.actions for p in parts], [p.ts_ms for p in parts]):
        padded = np.zeros(B * T, dtype=np.int64)
        if full:
            padded[cells] = np.concatenate([col[j] for j in full]).astype(np.int64)
        out.append(padded.reshape(B, T))
    return tuple(torch.from_numpy(a).to(device) for a in (*out, lengths))


class Ranker:
    """Runs the rank step for micro-batches on one model and one set of sources.

    ``popularity`` [n_items] scores the cold-start answer (None: every item scores 0 and
    the catalog order decides). ``query_events``: how many of the user's latest events
    form the routing query when a replay request carries no context. ``replay_cache``:
    user vectors after replay kept by the sources' owner (the engine forgets a user's
    entries whenever it changes the user); None: always replay. ``routing``
    (``archive.routing``): native = the archive's vote over the query events' query
    features; lexical = notes sharing items or categories with the query events;
    candidates = notes with the categories of the request's candidates, or with none of
    the top ``route_candidates`` items of the live user vector (SIM's hard search).
    ``item_categories`` [n_items]: each item index's category (None: items are their own).
    """

    def __init__(
        self,
        model: MemoryRecommender,
        sources: RankSources,
        popularity: np.ndarray | None = None,
        query_events: int = 1,
        cuda_graphs: bool = False,
        max_batch: int = 64,
        replay_cache: ReplayCache | None = None,
        routing: str = "native",
        route_candidates: int = 50,
        item_categories: np.ndarray | None = None,
    ) -> None:
        if popularity is not None and len(popularity) != model.n_items:
            raise ValueError(
                f"popularity has {len(popularity)} entries, the model has {model.n_items} items"
            )
        if query_events < 1:
            raise ValueError("query_events must be >= 1")
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} is not one of {'|'.join(ROUTINGS)}")
        self.routing = routing
        self.route_candidates = route_candidates
        self.item_categories = item_categories
        self.model = model
        self.sources = sources
        self.query_events = query_events
        self.device = next(model.parameters()).device
        graphs = cuda_graphs and self.device.type == "cuda" and not model.sched.adaptive
        self.graphs = GraphedReplay(model, max_batch) if graphs else None
        """The replay pass under CUDA graphs (``cuda_graphs`` on a CUDA device), else None
        (also under an adaptive unlock schedule, whose pieces are cut on the host)."""
        self.readouts = GraphedReadout(model, max_batch) if graphs else None
        """The read-out (``model.read_user``: the head over memory, window and request time)
        under CUDA graphs, with the same switch, else None."""
        pop = np.zeros(model.n_items, np.float32) if popularity is None else popularity
        self.popularity = np.asarray(pop, np.float32)
        self._by_popularity = np.argsort(-self.popularity, kind="stable")
        self.batches = 0
        """Micro-batches ranked so far."""
        self.seconds = dict.fromkeys(("snapshot", "route", "replay", "readout", "score"), 0.0)
        """Wall time spent so far per step of ``rank`` (host clock: on a GPU the kernels of
        one step may finish in a later one, where the results are copied back)."""
        self.cache = replay_cache

    @property
    def cache_counts(self) -> dict[str, int]:
        """Replay requests answered from the cache, and vectors stored into it."""
        return dict(self.cache.counts) if self.cache is not None else {"hits": 0, "stored": 0}

    @property
    def n_items(self) -> int:
        """Size of the TRAIN catalog this ranker scores."""
        return self.model.n_items

    def warm_up(self) -> int:
        """Capture the replay pass's CUDA graphs for every padded shape now, not on the
        first request of each shape; returns how many exist (0 without graphs)."""
        if self.graphs is None:
            return 0
        began = time.perf_counter()
        like = self.model.init_state(1, self.device)
        try:
            n = self.graphs.capture_all(like)
        except Exception:  # noqa: BLE001 - a driver or op that cannot be captured: run eagerly
            log.exception("capturing the replay pass in CUDA graphs failed; replays run eagerly")
            self.graphs = self.readouts = None
            return 0
        if self.readouts is not None:
            try:
                n += self.readouts.capture_all(like)
            except Exception:  # noqa: BLE001 - as above: the read-out then runs eagerly
                log.exception("capturing the read-out in CUDA graphs failed; it runs eagerly")
                self.readouts = None
        log.info("rank graphs: %d shapes captured in %.1f s", n, time.perf_counter() - began)
        return n

    def _replay(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        lengths: torch.Tensor,
        state: MemoryState,
    ) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(items, actions, ts, lengths, state)
        return self.model.replay_read(items, actions, ts, lengths, state)

    @torch.inference_mode()
    def rank(self, queries: Sequence[RankQuery]) -> list[RankResult]:
        """Rank a micro-batch; results in request order."""
        if not queries:
            return []
        self.batches += 1
        uv = self._user_vectors(queries)
        cold = [p == 0 and len(q.context) == 0 for p, q in zip(uv.positions, queries)]
        clock = time.perf_counter()
        top = self._score(queries, uv.vectors, cold)
        self._lap("score", clock)
        return [
            RankResult(
                items=top[i][0],
                scores=top[i][1],
                position=int(uv.positions[i]),
                cold_start=cold[i],
                notes_replayed=uv.notes_replayed[i],
                context_applied=len(q.context),
                from_cache=uv.from_cache[i],
            )
            for i, q in enumerate(queries)
        ]

    @torch.inference_mode()
    def user_vectors(self, queries: Sequence[RankQuery]) -> UserVectors:
        """The user vector of each query, as ``rank`` scores it: what offline evaluation
        of the rank path (offline_eval.notebank_eval) reads. An unknown user without
        context gets a zero state's vector (``rank`` answers it with popularity)."""
        return self._user_vectors(queries)

    def _user_vectors(self, queries: Sequence[RankQuery]) -> UserVectors:
        if self.model.training:  # eval() walks every module, on every rank step
            self.model.eval()
        clock = time.perf_counter()
        users = [q.user_id for q in queries]
        base = self._move(self.sources.snapshot(users))
        live_pos = base.pos.tolist()
        hits: dict[int, tuple[torch.Tensor, int]] = {}
        if self.cache is not None and self.cache.size:
            for i, q in enumerate(queries):
                if q.replay_notes and not len(q.context) and live_pos[i] > 0:
                    got = self.cache.get(q.user_id, q.replay_notes)
                    if got is not None:
                        hits[i] = got
        clock = self._lap("snapshot", clock)

        # Query events: the context, else (replay only) the user's latest events.
        query_ev: list[UserEvents] = [q.context for q in queries]
        stored_q: list[torch.Tensor | None] = [None] * len(queries)
        latest = [
            i
            for i, (q, p) in enumerate(zip(queries, live_pos))
            if not (len(q.context) or not q.replay_notes or p == 0 or i in hits)
        ]
        if latest:  # read for the whole batch at once
            ids = [queries[i].user_id for i in latest]
            evs = self.sources.recent_events_many(ids, self.query_events)
            qs = self.sources.recent_queries_many(ids, self.query_events)
            for i, ev, sq in zip(latest, evs, qs, strict=True):
                query_ev[i], stored_q[i] = ev, sq

        # the live read-out: the stored one, or after the request's context on a copy
        state = self._with_context(queries, base)
        ctx_rows = [i for i, q in enumerate(queries) if len(q.context)]
        live = base.h
        if ctx_rows and self.routing == "candidates":
            live = self._context_readout(queries, base, ctx_rows)
        notes = self._route(queries, base, state, live, query_ev, stored_q, live_pos)
        clock = self._lap("route", clock)

        replay_rows = [i for i, ns in enumerate(notes) if ns]
        fused = self.model.fusion is not None
        if ctx_rows and self.routing != "candidates":
            # without a fusion a replayed row reads the replay alone: its context pass is moot
            need = [i for i in ctx_rows if fused or not notes[i]]
            if need:
                live = self._context_readout(queries, base, need)
        replayed = live
        if replay_rows:
            rows_ev = [[*notes[i], query_ev[i]] for i in replay_rows]  # joined and padded
            items, actions, ts, lengths = _pad_joined(rows_ev, self.device)
            if len(replay_rows) == len(queries):
                # every row runs (the read-out-only pass never writes the snapshot)
                replayed = self._replay(items, actions, ts, lengths, base)
            else:
                rows = torch.as_tensor(replay_rows, device=self.device)
                vec = self._replay(items, actions, ts, lengths, base.index(rows))
                replayed = live.index_copy(0, rows, vec)

        if hits:
            rows = torch.as_tensor(list(hits), device=self.device)
            vecs = torch.stack([h[0] for h in hits.values()])
            replayed = replayed.index_copy(0, rows, vecs.to(replayed.dtype))
        if self.cache is not None and self.cache.size:
            for i, q in enumerate(queries):
                if i not in hits and q.replay_notes and not len(q.context) and notes[i]:
                    self.cache.put(q.user_id, q.replay_notes, replayed[i].clone(), len(notes[i]))
        did_replay = torch.as_tensor(
            [bool(notes[i]) or i in hits for i in range(len(queries))], device=self.device
        )
        clock = self._lap("replay", clock)
        request_ts = self._request_ts(queries)
        if self.readouts is not None:
            vectors = self.readouts(state, request_ts, live, replayed, did_replay)
        else:
            vectors = self.model.read_user(
                state, request_ts, mem=live, replayed=replayed, replayed_ok=did_replay
            )
        self._lap("readout", clock)
        return UserVectors(
            vectors=vectors,
            positions=[int(p) for p in live_pos],
            notes_replayed=[
                hits[i][1] if i in hits else len(notes[i]) for i in range(len(queries))
            ],
            from_cache=[i in hits for i in range(len(queries))],
        )

    def _context_readout(
        self, queries: Sequence[RankQuery], base: MemoryState, rows: list[int]
    ) -> torch.Tensor:
        """The memory read-out [B, D] after each listed request's context events run on a
        copy of its state (the other rows keep the stored read-out)."""
        idx = torch.as_tensor(rows, device=self.device)
        items, actions, ts, lengths = _pad([queries[i].context for i in rows], self.device)
        vec = self._replay(items, actions, ts, lengths, base.index(idx))
        return base.h.index_copy(0, idx, vec)

    def _request_ts(self, queries: Sequence[RankQuery]) -> torch.Tensor:
        now = int(time.time() * 1000)
        return torch.as_tensor(
            [q.request_ts_ms or now for q in queries], dtype=torch.int64, device=self.device
        )

    def _with_context(self, queries: Sequence[RankQuery], base: MemoryState) -> MemoryState:
        """``base`` with each request's context events pushed into its window (what the
        head reads at the request's time)."""
        with_ctx = [i for i, q in enumerate(queries) if len(q.context)]
        if not with_ctx:
            return base
        rows = torch.as_tensor(with_ctx, device=self.device)
        items, actions, ts, lengths = _pad([queries[i].context for i in with_ctx], self.device)
        pushed = self.model.push_window(base.index(rows), items, actions, ts, lengths)
        return base.put_rows(rows, pushed)

    def _lap(self, step: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[step] += now - since
        return now

    def _move(self, state: MemoryState) -> MemoryState:
        if state.S.device == self.device:
            return state
        return state.to(self.device)

    def _route(
        self,
        queries: Sequence[RankQuery],
        base: MemoryState,
        state: MemoryState,
        live: torch.Tensor,
        query_ev: Sequence[UserEvents],
        stored_q: Sequence[torch.Tensor | None],
        live_pos: Sequence[int],
    ) -> Sequence[Sequence[Events]]:
        """Notes to replay per request (``routing``): the archive's vote over the query
        features of the query events (stored, or one kq pass on a temporary copy for the
        rest), or item / category overlap with the query events or the candidates."""
        want = [
            i
            for i, q in enumerate(queries)
            if q.replay_notes > 0 and live_pos[i] > 0 and len(query_ev[i]) > 0
        ]
        notes: list[Sequence[Events]] = [[] for _ in queries]
        if not want:
            return notes
        if self.routing != "native":
            cats = self.item_categories
            if self.routing == "lexical":
                keys = [overlap_weights(query_ev[i].items, cats) for i in want]
            else:
                keys = self._candidate_keys(queries, state, live, want)
            routed = self.sources.route_overlap_many(
                [(queries[i].user_id, iw, cw, queries[i].replay_notes)
                 for i, (iw, cw) in zip(want, keys, strict=True)],
                cats,
            )  # fmt: skip
            for i, got_notes in zip(want, routed, strict=True):
                notes[i] = got_notes
            return notes
        q_tilde: dict[int, torch.Tensor] = {}
        todo = []
        for i in want:
            got = stored_q[i]
            if got is not None and len(got) == len(query_ev[i]):
                q_tilde[i] = got
            else:
                todo.append(i)
        if todo:
            rows = torch.as_tensor(todo, device=self.device)
            items, actions, ts, lengths = _pad([query_ev[i] for i in todo], self.device)
            res = self.model.advance(items, actions, ts, lengths, base.index(rows), return_kq=True)
            assert res.kq is not None
            feats = self.model.route_features(res.kq[1])
            for j, i in enumerate(todo):
                q_tilde[i] = feats[j, : int(lengths[j])]
        order = list(q_tilde)
        routed_now = self.sources.route_many(
            [(queries[i].user_id, q_tilde[i], queries[i].replay_notes) for i in order]
        )
        for i, got_notes in zip(order, routed_now, strict=True):
            notes[i] = got_notes
        return notes

    def _candidate_keys(
        self,
        queries: Sequence[RankQuery],
        state: MemoryState,
        live: torch.Tensor,
        rows: list[int],
    ) -> list[tuple[dict[int, float], dict[int, float]]]:
        """Category weights of each request's candidates (candidate-aware routing): its own
        candidates, or the top ``route_candidates`` items of its live user vector."""
        out: list[tuple[dict[int, float], dict[int, float]]] = [({}, {})] * len(rows)
        ranked = [j for j, i in enumerate(rows) if queries[i].candidates is None]
        top: dict[int, np.ndarray] = {}
        if ranked:
            idx = torch.as_tensor([rows[j] for j in ranked], device=self.device)
            vec = self.model.read_user(
                state.index(idx), self._request_ts(queries)[idx], mem=live[idx]
            )
            k = min(self.route_candidates, self.model.n_items)
            best = torch.topk(self.model.score(vec), k, dim=1).indices.cpu().numpy()
            top = {j: best[n] for n, j in enumerate(ranked)}
        for j, i in enumerate(rows):
            cand = queries[i].candidates
            items = top[j] if cand is None else cand
            out[j] = overlap_weights(items, self.item_categories, with_items=False)
        return out

    def _cold(self, q: RankQuery) -> tuple[np.ndarray, np.ndarray]:
        """TRAIN popularity top-k; ties go to the lower item index."""
        if q.candidates is None:
            idx = self._by_popularity[: q.k]
        else:
            order = np.lexsort((q.candidates, -self.popularity[q.candidates]))
            idx = q.candidates[order[: q.k]]
        return idx.astype(np.int64), self.popularity[idx]

    def _score(
        self, queries: Sequence[RankQuery], user_vec: torch.Tensor, cold: Sequence[bool]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-k (indices, scores) per request: one catalog matmul, one candidate einsum."""
        out = [self._cold(q) if c else None for q, c in zip(queries, cold)]
        n_items = self.model.n_items
        catalog = [i for i, q in enumerate(queries) if q.candidates is None and not cold[i]]
        if catalog:
            rows = torch.as_tensor(catalog, device=self.device)
            scores = self.model.score(user_vec[rows])
            kmax = min(max(queries[i].k for i in catalog), n_items)
            val, idx = torch.topk(scores, kmax, dim=1)
            val_np, idx_np = val.cpu().numpy(), idx.cpu().numpy()
            for j, i in enumerate(catalog):
                k = min(queries[i].k, n_items)
                out[i] = (idx_np[j, :k].astype(np.int64), val_np[j, :k].astype(np.float32))
        cand = [i for i, q in enumerate(queries) if q.candidates is not None and not cold[i]]
        if cand:
            lists = [c for c in (queries[i].candidates for i in cand) if c is not None]
            sizes = [len(c) for c in lists]
            C = max(sizes)
            padded = np.zeros((len(cand), C), dtype=np.int64)
            for j, c in enumerate(lists):
                padded[j, : sizes[j]] = c
            items = torch.from_numpy(padded).to(self.device)
            rows = torch.as_tensor(cand, device=self.device)
            scores = self.model.score(user_vec[rows], items)
            size_t = torch.as_tensor(sizes, device=self.device)
            valid = torch.arange(C, device=self.device)[None, :] < size_t[:, None]
            scores = scores.masked_fill(~valid, float("-inf"))
            kmax = min(max(queries[i].k for i in cand), C)
            val, pos = torch.topk(scores, kmax, dim=1)
            picked = torch.gather(items, 1, pos)
            val_np, picked_np = val.cpu().numpy(), picked.cpu().numpy()
            for j, i in enumerate(cand):
                k = min(queries[i].k, sizes[j])
                out[i] = (picked_np[j, :k].astype(np.int64), val_np[j, :k].astype(np.float32))
        done = [o for o in out if o is not None]
        assert len(done) == len(queries), "every request is scored"
        return done
