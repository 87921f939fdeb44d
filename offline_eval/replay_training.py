"""Replay-aware training and the offline replay scorer (SPEC section 5: "a learned fusion
... trained by replaying, for a target, only notes closed before that target").

For a set of queries (user, position p: the state after the user's p-th event, asked at a
request time) the user vectors with replay are computed as the rank path computes them
(recmem/ranking.py, a replay request without context), in batches:

1. the state after event p: each user's events run piece by piece up to its next query
   position (``piecewise_states``), keeping the query features of the latest
   ``server.replay_query_events`` events, as the engine keeps them;
2. the route over the user's archive as it stood after event p (offline_eval/
   replay_archive.py: only notes whose chunk closed by p), by ``archive.routing``;
3. the routed notes' events, then the query events again, replayed on a copy of the state
   (``MemoryRecommender.replay_read``, the rank path's function);
4. the user vector: ``read_user`` of the live and the replayed read-out through the
   model's replay fusion (the rank path's call).

``ReplayScorer`` is this as an offline_eval Scorer (tests check it equals the served path,
``NotebankScorer``, and that no event after a target changes it). ``train_replay`` is
replay-aware training: after the base training, ``train.replay_steps`` optimizer steps on
sampled TRAIN targets (``train.replay_share`` of each user's targets after its first closed
chunk, at most QUERIES_PER_USER per step), the loss the next-item cross-entropy of the fused
user vector; with ``train.replay_freeze`` (default) only the fusion and the routing
projection train, else every weight, also on the same targets without replay. A routing
projection (``model.route_dim``) also learns from a routing loss: a softmax over the
eligible notes' summed best cosines, which should put its mass on notes holding an item of
the target's category.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.recommender import MemoryRecommender, next_event_ts, padded_batch
from models.sequences import EventSeqs
from models.state import MemoryState
from models.train import TrainControl, auto_batch_size, length_batches, pick_device
from offline_eval.replay_archive import NoteArchive, Routed, build_note_archive
from recmem.archive.routing import overlap_weights
from recmem.archive.selection import l2_normalise
from recmem.config import Config

log = logging.getLogger(__name__)

QUERIES_PER_USER = 8
"""At most this many replayed targets per user in one replay-aware step."""
ROUTE_TEMPERATURE = 0.1
"""Temperature of the routing loss's softmax over summed cosines."""


@dataclass
class QuerySet:
    """Queries: ``users`` (rows of EventSeqs), ``positions`` (events applied, >= 1: the
    query row is the user's event at that 1-based position), ``request_ts`` (ms) and, for
    training, the ``targets`` (item index of the next event)."""

    users: np.ndarray
    positions: np.ndarray
    request_ts: np.ndarray
    targets: np.ndarray | None = None


@dataclass
class StepOut:
    """What ``replay_vectors`` gives for a piece of queries."""

    vectors: torch.Tensor
    """[n, D] user vectors with replay (the live one where no note was routed)."""
    live: torch.Tensor
    """[n, D] the memory read-out without replay."""
    notes: np.ndarray
    """[n] notes replayed."""
    route_loss: torch.Tensor | None = None
    route_n: int = 0
    routed: list[Routed] = field(default_factory=list)
    """Per query, the notes routed (indices into the user's notes)."""


def tail_concat(
    buf: torch.Tensor, buf_len: torch.Tensor, new: torch.Tensor, new_len: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``n`` rows of each user's (buf[:buf_len], new[:new_len]) along dim 1,
    left-aligned, with their counts: [B, n, ...], [B]."""
    B, Qb = buf.shape[:2]
    both = torch.cat([buf, new], dim=1)
    total = buf_len + new_len
    out_len = torch.clamp(total, max=n)
    start = total - out_len
    i = torch.arange(n, device=buf.device)[None, :]
    src = start[:, None] + i
    phys = torch.where(src < buf_len[:, None], src, Qb + src - buf_len[:, None])
    phys = torch.clamp(phys, 0, both.shape[1] - 1)
    idx = phys.reshape(B, n, *([1] * (both.dim() - 2))).expand(B, n, *both.shape[2:])
    out = torch.gather(both, 1, idx)
    keep = (i < out_len[:, None]).reshape(B, n, *([1] * (both.dim() - 2)))
    return torch.where(keep, out, torch.zeros_like(out)), out_len


StepFn = Callable[[np.ndarray, MemoryState, torch.Tensor, torch.Tensor], None]


@torch.no_grad()
def piecewise_states(
    model: MemoryRecommender,
    seqs: EventSeqs,
    qs: QuerySet,
    query_events: int,
    on_step: StepFn,
    *,
    raw_queries: bool = False,
) -> None:
    """Run every queried user's events up to each of its query positions in turn (one
    padded ``advance`` per step over the users with a query left, the busiest first) and
    call ``on_step(query indices, their states, query features [n, Q, L, H, d] of the
    latest ``query_events`` events, their counts [n])`` after each step (``raw_queries``:
    the masked queries q~ themselves, before a routing projection). Eval mode, no
    gradient."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        order = np.lexsort((qs.positions, qs.users))
        u_sorted = qs.users[order]
        uniq, first, counts = np.unique(u_sorted, return_index=True, return_counts=True)
        by_count = np.argsort(-counts, kind="stable")
        users, first, counts = uniq[by_count], first[by_count], counts[by_count]
        U = len(users)
        if U == 0:
            return
        state = model.init_state(U, device)
        prev = np.zeros(U, dtype=np.int64)
        mem = model.mem_cfg
        shape = (mem.n_layers, mem.n_heads, mem.key_dim if raw_queries else model.route_dim)
        dtype = state.h.dtype
        buf = torch.zeros(U, query_events, *shape, device=device, dtype=dtype)
        buf_len = torch.zeros(U, dtype=torch.int64, device=device)
        for j in range(int(counts.max())):
            n = int((counts > j).sum())
            qidx = order[first[:n] + j]
            target = qs.positions[qidx].astype(np.int64)
            lens = target - prev[:n]
            if (lens < 0).any():
                raise ValueError("query positions must not decrease within a user")
            items, actions, ts, lengths = padded_batch(seqs, users[:n], lens, device, prev[:n])
            sub = state if n == U else state.index(slice(0, n))
            res = model.advance(items, actions, ts, lengths, sub, return_kq=True)
            new = res.state
            state = new if n == U else state.put_rows(torch.arange(n, device=device), new)
            if res.kq is not None:
                q = res.kq[1]
                feats = (q if raw_queries else model.route_features(q)).to(dtype)
                b, bl = tail_concat(buf[:n], buf_len[:n], feats, lengths, query_events)
                buf[:n], buf_len[:n] = b, bl
            prev[:n] = target
            on_step(qidx, new, buf[:n].clone(), buf_len[:n].clone())
    finally:
        model.train(was_training)


def query_event_rows(
    seqs: EventSeqs, users: np.ndarray, positions: np.ndarray, query_events: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The latest ``query_events`` raw events (items, actions, ts) up to each position."""
    out = []
    for u, p in zip(users, positions, strict=True):
        end = int(seqs.offsets[u]) + int(p)
        start = max(int(seqs.offsets[u]), end - query_events)
        out.append((seqs.items[start:end], seqs.actions[start:end], seqs.ts_ms[start:end]))
    return out


def _pad_events(
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T = len(rows), max((len(r[0]) for r in rows), default=0)
    arr = np.zeros((3, B, T), dtype=np.int64)
    lengths = np.zeros(B, dtype=np.int64)
    for b, r in enumerate(rows):
        n = len(r[0])
        for k in range(3):
            arr[k, b, :n] = r[k]
        lengths[b] = n
    t = torch.from_numpy(arr).to(device)
    return t[0], t[1], t[2], torch.from_numpy(lengths).to(device)


@dataclass
class ReplaySettings:
    """What ``replay_vectors`` needs of the configuration."""

    routing: str
    replay_notes: int
    query_events: int
    route_candidates: int
    item_cat: np.ndarray | None = None

    @classmethod
    def from_config(
        cls, cfg: Config, item_cat: np.ndarray | None, replay_notes: int | None = None
    ) -> ReplaySettings:
        return cls(
            cfg.archive.routing,
            cfg.archive.replay_notes if replay_notes is None else replay_notes,
            max(1, cfg.server.replay_query_events),
            cfg.archive.route_candidates,
            item_cat,
        )


def replay_vectors(
    model: MemoryRecommender,
    seqs: EventSeqs,
    archive: NoteArchive,
    qs: QuerySet,
    qidx: np.ndarray,
    states: MemoryState,
    feats: torch.Tensor,
    feats_len: torch.Tensor,
    settings: ReplaySettings,
    *,
    replay_grad: bool = False,
) -> StepOut:
    """User vectors with replay for the queries ``qidx`` of ``qs`` from their states (and
    the query features of their latest events): route, replay, fuse, as the rank path
    does. ``replay_grad``: the replay pass runs ``advance`` with autograd (every weight
    learns from it) instead of the gradient-free read-out. The read-out of the head and
    the fusion keep autograd when it is enabled."""
    device = states.h.device
    users, pos = qs.users[qidx], qs.positions[qidx]
    req = torch.as_tensor(qs.request_ts[qidx], dtype=torch.int64, device=device)
    live = states.h
    R = settings.replay_notes
    route_loss, route_n = None, 0
    if settings.routing == "native":
        f_np = feats.detach().float().cpu().numpy()
        lens = feats_len.cpu().numpy()
        C = f_np.shape[2] * f_np.shape[3]
        q_feats = [f_np[j, : lens[j]].reshape(lens[j], C, -1) for j in range(len(qidx))]
        addresses = None
        if archive.raw:
            addresses, route_loss, route_n = _learned_addresses(
                model, archive, users, pos, feats, feats_len, qs, qidx, settings
            )
        routed = archive.route_native(users, pos, q_feats, R, addresses)
    else:
        if settings.routing == "lexical":
            ev = query_event_rows(seqs, users, pos, settings.query_events)
            weights = [overlap_weights(e[0], settings.item_cat) for e in ev]
        else:
            with torch.no_grad():
                vec = model.read_user(states, req, mem=live)
                k = min(settings.route_candidates, model.n_items)
                top = torch.topk(model.score(vec), k, dim=1).indices.cpu().numpy()
            weights = [overlap_weights(t, settings.item_cat, with_items=False) for t in top]
        routed = archive.route_overlap(users, pos, weights, settings.item_cat, R)
    n_notes = np.array([len(r.picked) for r in routed], dtype=np.int64)
    rows = np.flatnonzero(n_notes > 0)
    replayed = live
    if len(rows):
        ev = query_event_rows(seqs, users[rows], pos[rows], settings.query_events)
        replay_rows = []
        for k, j in enumerate(rows):
            ni, na, nt = archive.replay_events(routed[j])
            qi, qa, qt = ev[k]
            replay_rows.append(
                (np.concatenate([ni, qi]), np.concatenate([na, qa]), np.concatenate([nt, qt]))
            )
        items, actions, ts, lengths = _pad_events(replay_rows, device)
        idx = torch.as_tensor(rows, device=device)
        base = states.index(idx)
        if replay_grad:
            vec = model.advance(items, actions, ts, lengths, base.detach()).state.h
        else:
            vec = model.replay_read(items, actions, ts, lengths, base)
        replayed = live.index_copy(0, idx, vec.to(live.dtype))
    ok = torch.as_tensor(n_notes > 0, device=device)
    vectors = model.read_user(states, req, mem=live, replayed=replayed, replayed_ok=ok)
    return StepOut(vectors, live, n_notes, route_loss, route_n, routed)


def _learned_addresses(
    model: MemoryRecommender,
    archive: NoteArchive,
    users: np.ndarray,
    pos: np.ndarray,
    feats: torch.Tensor,
    feats_len: torch.Tensor,
    qs: QuerySet,
    qidx: np.ndarray,
    settings: ReplaySettings,
) -> tuple[list[np.ndarray], torch.Tensor | None, int]:
    """A routing projection's current addresses of each query's eligible notes (from the
    raw archive), and its routing loss over the queries with a target."""
    assert model.route_proj is not None
    W = model.route_proj.weight  # [C, d, K]
    out: list[np.ndarray] = []
    losses = []
    cat = settings.item_cat
    for j, (u, p) in enumerate(zip(users, pos, strict=True)):
        lo, hi = archive.eligible(u, p)
        un = archive.notes_of(u)
        if un is None or hi <= lo:
            out.append(np.zeros((0, W.shape[0], W.shape[1]), np.float32))
            continue
        raw = torch.as_tensor(un.addresses[lo:hi], device=W.device, dtype=W.dtype)
        addr = F.normalize(torch.einsum("nck,cdk->ncd", raw, W), dim=-1, eps=1e-12)
        out.append(l2_normalise(addr.detach().float().cpu().numpy()))
        if qs.targets is None or cat is None or not torch.is_grad_enabled():
            continue
        target = int(qs.targets[qidx[j]])
        if target >= len(cat):
            continue
        holds = np.array([bool(np.any(cat[np.clip(it, 0, len(cat) - 1)][it < len(cat)]
                                      == cat[target])) for it in un.items[lo:hi]])  # fmt: skip
        if holds.all() or not holds.any():
            continue
        n = int(feats_len[j])
        q = F.normalize(feats[j, :n].reshape(n, W.shape[0], -1), dim=-1, eps=1e-12)
        cos = torch.einsum("tcd,ncd->tcn", q, addr)
        strength = cos.max(dim=0).values.sum(dim=0) / ROUTE_TEMPERATURE  # [N]
        pos_mask = torch.as_tensor(holds, device=W.device)
        losses.append(torch.logsumexp(strength, 0) - torch.logsumexp(strength[pos_mask], 0))
    if not losses:
        return out, None, 0
    return out, torch.stack(losses).mean(), len(losses)


class ReplayScorer:
    """Scorer (offline_eval.evaluate) of ``model`` with NoteBank replay computed offline:
    per batch of users one archive over their events up to their last query, the states
    at each query row piece by piece, routes over the archive as it stood at each row."""

    def __init__(
        self,
        model: MemoryRecommender,
        cfg: Config,
        *,
        item_categories: np.ndarray | None = None,
        replay_notes: int | None = None,
        batch_users: int = 256,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.settings = ReplaySettings.from_config(cfg, item_categories, replay_notes)
        self.batch_users = batch_users
        self.stats: dict[str, float] = {"queries": 0, "replayed": 0, "notes_replayed": 0}

    def item_matrix(self) -> torch.Tensor:
        return self.model.item_matrix()

    @torch.no_grad()
    def user_vectors(
        self, seqs: EventSeqs, query_rows: np.ndarray, request_ts: np.ndarray | None = None
    ) -> torch.Tensor:
        rows = np.asarray(query_rows, dtype=np.int64)
        req = next_event_ts(seqs, rows) if request_ts is None else np.asarray(request_ts)
        model = self.model
        result = torch.zeros(len(rows), model.embed_dim, dtype=model.item_matrix().dtype)
        user_of = seqs.user_of_event()[rows]
        qs = QuerySet(user_of, rows - seqs.offsets[user_of] + 1, req)
        self.stats["queries"] += len(rows)
        users = np.unique(user_of)
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(users), self.batch_users):
                batch = users[start : start + self.batch_users]
                sel = np.flatnonzero(np.isin(user_of, batch))
                self._run(seqs, QuerySet(qs.users[sel], qs.positions[sel], req[sel]), sel, result)
        finally:
            model.train(was_training)
        return result.to(model.item_matrix().device)

    def _run(self, seqs: EventSeqs, qs: QuerySet, sel: np.ndarray, result: torch.Tensor) -> None:
        users = np.unique(qs.users)
        upto = np.zeros(seqs.n_users, dtype=np.int64)
        np.maximum.at(upto, qs.users, qs.positions)
        archive = build_note_archive(
            self.model, seqs, users, upto[users], self.cfg.archive, self.cfg.train.seed
        )

        def step(qidx: np.ndarray, states: MemoryState, f: torch.Tensor, fl: torch.Tensor) -> None:
            out = replay_vectors(self.model, seqs, archive, qs, qidx, states, f, fl,
                                 self.settings)  # fmt: skip
            result[torch.as_tensor(sel[qidx])] = out.vectors.to("cpu", result.dtype)
            self.stats["replayed"] += int((out.notes > 0).sum())
            self.stats["notes_replayed"] += int(out.notes.sum())

        piecewise_states(self.model, seqs, qs, self.settings.query_events, step)


# ---------------------------------------------------------------- replay-aware training


@dataclass
class ReplayTrainResult:
    steps: int = 0
    seconds: float = 0.0
    archive_seconds: float = 0.0
    notes: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "archive_seconds": self.archive_seconds,
            "notes": self.notes,
            "history": self.history,
        }


def eligible_targets(
    seqs: EventSeqs, lengths: np.ndarray, chunk_events: int, n_items: int
) -> list[np.ndarray]:
    """Per user the query positions p whose target (event p + 1) is a TRAIN item within the
    first ``lengths[u]`` events and that come after the user's first closed chunk."""
    out = []
    for u in range(seqs.n_users):
        n = int(lengths[u])
        p = np.arange(chunk_events, n)  # events applied; the target is event p + 1
        if len(p):
            tgt = seqs.items[seqs.offsets[u] + p]
            p = p[tgt < n_items]
        out.append(p)
    return out


class _eval_after:
    """Put the model back in eval mode when the block ends (the piecewise pass runs
    the base in eval mode between the training callbacks)."""

    def __init__(self, model: MemoryRecommender) -> None:
        self.model = model

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.model.eval()


def train_replay(
    model: MemoryRecommender,
    seqs: EventSeqs,
    lengths: np.ndarray,
    cfg: Config,
    item_cat: np.ndarray | None,
    device: torch.device | None = None,
) -> ReplayTrainResult:
    """Replay-aware training of ``model`` (see the module docstring) on each user's first
    ``lengths[u]`` events; ``train.replay_steps`` optimizer steps (or ``train.max_seconds``)."""
    tcfg = cfg.train
    if model.fusion is None and model.route_proj is None:
        raise ValueError(
            "train.replay_steps needs something to train: model.replay_fusion or model.route_dim"
        )
    device = device or pick_device(tcfg.device)
    began = time.perf_counter()
    result = ReplayTrainResult()
    learned = model.route_proj is not None and cfg.archive.routing == "native"
    eligible = eligible_targets(seqs, lengths, cfg.archive.chunk_events, model.n_items)
    counts = np.array([len(e) for e in eligible])
    users = np.flatnonzero(counts > 0)
    archive = build_note_archive(
        model, seqs, users, lengths[users], cfg.archive, tcfg.seed, raw=learned
    )
    result.archive_seconds = time.perf_counter() - began
    result.notes = sum(len(u) for u in archive.users.values())
    settings = ReplaySettings.from_config(cfg, item_cat)
    extra = [m for m in (model.fusion, model.route_proj) if m is not None]
    extra_params = [p for m in extra for p in m.parameters()]
    params = extra_params if tcfg.replay_freeze else list(model.parameters())
    keep_grad = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    optim = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    stage = copy.deepcopy(tcfg)
    stage.warmup_steps = min(tcfg.warmup_steps, max(1, tcfg.replay_steps // 10))
    stage.eval_every = max(1, min(tcfg.eval_every, tcfg.replay_steps))
    control = TrainControl(model, optim, stage, None, "ndcg@10")
    rng = np.random.default_rng(tcfg.seed + 1)
    per_user = np.zeros(seqs.n_users, dtype=np.int64)
    per_user[users] = counts[users]
    batch_size = auto_batch_size(tcfg, len(users))
    try:
        while control.step < tcfg.replay_steps and not control.stop:
            for batch in length_batches(np.where(per_user > 0, 2, 0), batch_size, rng):
                loss, n = _replay_step(model, seqs, archive, eligible, batch, cfg, settings,
                                       rng, control, optim, params)  # fmt: skip
                result.history.append({"step": control.step, "loss": loss, "targets": n})
                if control.step >= tcfg.replay_steps or control.stop:
                    break
    finally:
        for p in model.parameters():
            p.requires_grad_(keep_grad[id(p)])
        model.eval()
    result.steps = control.step
    result.seconds = time.perf_counter() - began
    log.info("replay-aware training: %d steps in %.0f s (archive %.0f s, %d notes)",
             result.steps, result.seconds, result.archive_seconds, result.notes)  # fmt: skip
    return result


def _replay_step(
    model: MemoryRecommender,
    seqs: EventSeqs,
    archive: NoteArchive,
    eligible: list[np.ndarray],
    batch: np.ndarray,
    cfg: Config,
    settings: ReplaySettings,
    rng: np.random.Generator,
    control: TrainControl,
    optim: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
) -> tuple[float, int]:
    """One optimizer step on sampled targets of the users ``batch``."""
    tcfg = cfg.train
    users, positions = [], []
    for u in batch:
        e = eligible[u]
        k = min(QUERIES_PER_USER, len(e), max(1, math.ceil(tcfg.replay_share * len(e))))
        users.append(np.full(k, u))
        positions.append(np.sort(rng.choice(e, size=k, replace=False)))
    u_arr, p_arr = np.concatenate(users), np.concatenate(positions)
    rows = seqs.offsets[u_arr] + p_arr  # the targets' rows
    qs = QuerySet(u_arr, p_arr, seqs.ts_ms[rows], seqs.items[rows])
    outs: list[tuple[np.ndarray, StepOut, torch.Tensor | None]] = []
    joint = not tcfg.replay_freeze

    def step(qidx: np.ndarray, states: MemoryState, f: torch.Tensor, fl: torch.Tensor) -> None:
        model.train(joint)  # the base's dropout only when it trains
        with torch.enable_grad(), _eval_after(model):
            feats = model.route_features(f) if archive.raw else f
            out = replay_vectors(model, seqs, archive, qs, qidx, states, feats, fl, settings,
                                 replay_grad=joint)  # fmt: skip
            live = None
            if joint:  # the same targets without replay
                req = torch.as_tensor(qs.request_ts[qidx], device=states.h.device)
                live = model.read_user(states, req)
        outs.append((qidx, out, live))

    piecewise_states(model, seqs, qs, settings.query_events, step, raw_queries=archive.raw)
    qidx = np.concatenate([o[0] for o in outs])
    assert qs.targets is not None
    targets = torch.as_tensor(qs.targets[qidx], device=outs[0][1].vectors.device)
    weight = model.item_weight()
    vectors = torch.cat([o[1].vectors for o in outs])
    loss = F.cross_entropy(vectors @ weight.T, targets)
    lives = [o[2] for o in outs if o[2] is not None]
    if lives:
        loss = loss + F.cross_entropy(torch.cat(lives) @ weight.T, targets)
    route = [(o[1].route_loss, o[1].route_n) for o in outs if o[1].route_loss is not None]
    if route:
        total = sum(n for _, n in route)
        loss = loss + torch.stack([rl * n for rl, n in route if rl is not None]).sum() / total
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    control.before_step()
    optim.step()
    n = len(qidx)
    control.after_step(loss.detach(), n)
    return float(loss.detach()), n
