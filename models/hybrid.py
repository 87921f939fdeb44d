"""The read-out head: from the memory layers' output at a user's latest event to the user
vector, optionally through attention over the user's latest W events (Titans' hybrids) and
conditioned on the time of the request (SPEC section 4).

One function, ``ReadHead.forward``, serves every caller: training and offline evaluation
call it with every event of a segment as a query (each query sees the W events up to and
including its own), the rank path with one query per user over the stored window. The keys
are the window's event tokens, the same embeddings the memory layers take in.

Modes (``model.hybrid``):

- ``none``: z = m (the memory read-out);
- ``mac``, memory as context: the attention's query is projected from m (+ the request-time
  features); its tokens are the window's events plus m itself; z = m + attention output;
- ``mag``, memory as gate: the attention's query is the query event's own token (+ the
  request-time features), over the window's events; a = token + attention output, and a
  learned gate mixes the branches: z = g * m + (1 - g) * a.

Request time (``model.request_time``): ``gap`` adds an embedding of the (log-bucketed) time
from the user's latest event to the request, and with a hybrid a per-head bias on each
window event's age at the request; ``gap_clock`` adds the request's hour of day and day of
week (UTC). With a hybrid or request time, z then passes a LayerNorm and a feed-forward
block; the user vector is ``readout(z)`` (``model.readout``: a learned linear map, or the
identity).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.features import time_gap_buckets

HYBRIDS = ("none", "mac", "mag")
REQUEST_TIMES = ("none", "gap", "gap_clock")
READOUTS = ("linear", "identity")
REQUEST_GAP_BUCKETS = 32
"""Log buckets of the time from the latest event (or a window event) to the request."""
QUERY_BLOCK = 256
"""Queries per block of the banded attention (bounds its memory on long histories)."""
MS_PER_HOUR = 3_600_000


def check_head_config(model: ModelConfig) -> None:
    """Reject head settings that cannot be built, naming the field."""
    if model.hybrid not in HYBRIDS:
        raise ValueError(f"model.hybrid {model.hybrid!r} is not one of {'|'.join(HYBRIDS)}")
    if model.request_time not in REQUEST_TIMES:
        raise ValueError(
            f"model.request_time {model.request_time!r} is not one of {'|'.join(REQUEST_TIMES)}"
        )
    if model.readout not in READOUTS:
        raise ValueError(f"model.readout {model.readout!r} is not one of {'|'.join(READOUTS)}")
    if model.hybrid != "none" and model.window < 1:
        raise ValueError("model.window must be >= 1 with a hybrid")
    if model.hybrid != "none" and (model.attn_heads < 1 or model.embed_dim % model.attn_heads):
        raise ValueError("model.attn_heads must be >= 1 and divide model.embed_dim")


def request_gap_buckets(request_ts: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """Bucket of ``request_ts - ts`` (ts < 0: no event, bucket 0)."""
    return time_gap_buckets(request_ts, ts, REQUEST_GAP_BUCKETS)


class RequestTime(nn.Module):
    """Embedding of the request's time relative to the user's latest event (+ clock)."""

    def __init__(self, dim: int, clock: bool) -> None:
        super().__init__()
        self.gap = nn.Embedding(REQUEST_GAP_BUCKETS, dim)
        self.clock = clock
        if clock:
            self.hour = nn.Embedding(24, dim)
            self.dow = nn.Embedding(7, dim)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, request_ts: torch.Tensor, last_ts: torch.Tensor) -> torch.Tensor:
        out = self.gap(request_gap_buckets(request_ts, last_ts))
        if self.clock:
            hours = torch.div(torch.clamp(request_ts, min=0), MS_PER_HOUR, rounding_mode="floor")
            # 1970-01-01 was a Thursday: day 0 -> index 3 with Monday = 0
            out = (
                out
                + self.hour(hours % 24)
                + self.dow((torch.div(hours, 24, rounding_mode="floor") + 3) % 7)
            )
        return out


class WindowAttention(nn.Module):
    """Multi-head attention of each query over the (at most W) window events up to and
    including its own, with per-head biases for the relative position and (with request
    time) the age of each event at the request. ``with_memory``: one more token per query,
    the memory read-out (MAC)."""

    def __init__(self, cfg: ModelConfig, with_memory: bool, age_bias: bool) -> None:
        super().__init__()
        D, H = cfg.embed_dim, cfg.attn_heads
        self.H, self.W, self.dh = H, cfg.window, D // H
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.out = nn.Linear(D, D)
        self.pos_bias = nn.Parameter(torch.zeros(cfg.window, H))
        self.age_bias = nn.Parameter(torch.zeros(REQUEST_GAP_BUCKETS, H)) if age_bias else None
        self.mem_kv = nn.Linear(D, 2 * D) if with_memory else None
        self.mem_bias = nn.Parameter(torch.zeros(H)) if with_memory else None
        self.dropout = cfg.dropout

    def forward(
        self,
        query: torch.Tensor,
        tokens: torch.Tensor,
        token_ts: torch.Tensor,
        token_ok: torch.Tensor,
        first: int,
        request_ts: torch.Tensor,
        memory: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [B, T, D]; tokens [B, N, D] with token_ts, token_ok [B, N]; query t's own
        event is token ``first + t`` (it sees tokens first + t - W + 1 .. first + t);
        request_ts [B, T]; memory [B, T, D] (MAC) -> [B, T, D]."""
        B, T, D = query.shape
        W = self.W
        blocks = []
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(T, t0 + QUERY_BLOCK)
            lo = max(0, first + t0 - W + 1)
            hi = first + t1
            blocks.append(
                self._block(
                    query[:, t0:t1],
                    tokens[:, lo:hi],
                    token_ts[:, lo:hi],
                    token_ok[:, lo:hi],
                    first + t0 - lo,
                    request_ts[:, t0:t1],
                    None if memory is None else memory[:, t0:t1],
                )
            )
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    def _block(
        self,
        query: torch.Tensor,
        tokens: torch.Tensor,
        token_ts: torch.Tensor,
        token_ok: torch.Tensor,
        first: int,
        request_ts: torch.Tensor,
        memory: torch.Tensor | None,
    ) -> torch.Tensor:
        B, T, D = query.shape
        N = tokens.shape[1]
        H, dh = self.H, self.dh
        q = self.q(query).view(B, T, H, dh).transpose(1, 2)  # [B, H, T, dh]
        k, v = self.kv(tokens).view(B, N, 2, H, dh).permute(2, 0, 3, 1, 4)  # [B, H, N, dh]
        logits = q @ k.transpose(-1, -2) / math.sqrt(dh)  # [B, H, T, N]
        dev = query.device
        dist = (first + torch.arange(T, device=dev))[:, None] - torch.arange(N, device=dev)[None]
        band = (dist >= 0) & (dist < self.W)  # [T, N]
        # F.embedding, not indexing: its backward sums the many repeats of a few rows fast
        bias = F.embedding(dist.clamp(0, self.W - 1), self.pos_bias).permute(2, 0, 1)
        logits = logits + bias[None]  # [H, T, N] per-head relative-position bias
        if self.age_bias is not None:
            age = request_gap_buckets(request_ts[:, :, None], token_ts[:, None, :])  # [B, T, N]
            logits = logits + F.embedding(age, self.age_bias).permute(0, 3, 1, 2)
        ok = band[None] & token_ok[:, None, :]  # [B, T, N]
        logits = logits.masked_fill(~ok[:, None], -torch.inf)
        if self.mem_kv is not None and memory is not None and self.mem_bias is not None:
            mk, mv = self.mem_kv(memory).view(B, T, 2, H, dh).permute(2, 0, 3, 1, 4)
            mem_logit = (q * mk).sum(-1, keepdim=True) / math.sqrt(dh) + self.mem_bias[
                :, None, None
            ]
            logits = torch.cat([logits, mem_logit], dim=-1)
        else:
            mk = mv = None
        # a query with no valid token (a padding query) gets zeros, not NaN
        logits = torch.where(torch.isinf(logits).all(-1, keepdim=True), 0.0, logits)
        p = torch.softmax(logits, dim=-1)
        p = F.dropout(p, self.dropout, self.training)
        if mv is not None:
            ctx = p[..., :N] @ v + p[..., N:] * mv
        else:
            ctx = p @ v
        return self.out(ctx.transpose(1, 2).reshape(B, T, D))


class ReadHead(nn.Module):
    """Memory read-out (+ window attention) (+ request time) -> user vector."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_head_config(cfg)
        D = cfg.embed_dim
        self.mode = cfg.hybrid
        self.window = cfg.window if cfg.hybrid != "none" else 0
        self.time: RequestTime | None = None
        if cfg.request_time != "none":
            self.time = RequestTime(D, clock=cfg.request_time == "gap_clock")
        self.attn: WindowAttention | None = None
        if cfg.hybrid != "none":
            self.attn = WindowAttention(cfg, cfg.hybrid == "mac", self.time is not None)
            self.query_norm = nn.LayerNorm(D)
        if cfg.hybrid == "mag":
            self.gate = nn.Linear(2 * D, D)
        self.final = cfg.hybrid != "none" or self.time is not None
        if self.final:
            self.norm = nn.LayerNorm(D)
            hidden = max(1, cfg.ffn_mult) * D
            self.ffn = nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden, D))
            self.norm2 = nn.LayerNorm(D)
        self.dropout = nn.Dropout(cfg.dropout)
        self.readout: nn.Module = nn.Linear(D, D) if cfg.readout == "linear" else nn.Identity()

    def forward(
        self,
        mem: torch.Tensor,
        last_ts: torch.Tensor,
        request_ts: torch.Tensor,
        tokens: torch.Tensor | None = None,
        token_ts: torch.Tensor | None = None,
        token_ok: torch.Tensor | None = None,
        first: int = 0,
    ) -> torch.Tensor:
        """mem [B, T, D] the memory read-out after each query's event; last_ts [B, T] that
        event's time; request_ts [B, T]; with a hybrid, the window's tokens [B, N, D], their
        times and validity [B, N] and the token index ``first`` of query 0's own event (the
        queries' events are consecutive tokens). -> [B, T, D]."""
        tau = None if self.time is None else self.time(request_ts, last_ts)
        z = mem
        if self.attn is not None:
            assert tokens is not None and token_ts is not None
            assert token_ok is not None
            if self.mode == "mac":
                base = mem
            else:
                base = tokens[:, first : first + mem.shape[1]]
            qin = self.query_norm(base if tau is None else base + tau)
            a = self.attn(qin, tokens, token_ts, token_ok, first, request_ts,
                          mem if self.mode == "mac" else None)  # fmt: skip
            a = self.dropout(a)
            if self.mode == "mac":
                z = mem + a
            else:
                a = base + a
                g = torch.sigmoid(self.gate(torch.cat([mem, a], dim=-1)))
                z = g * mem + (1 - g) * a
        if self.final:
            z = self.norm(z if tau is None else z + tau)
            z = self.norm2(z + self.dropout(self.ffn(z)))
        return self.readout(z)
