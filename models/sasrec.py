"""SASRec, our own implementation: causal self-attention over a user's last <= 200 items,
learned positions, tied item embeddings, full-catalog cross-entropy.

Windows are left-padded so the latest event always sits in the last slot (position
max_len - 1), in training and at scoring time alike. Implements the Scorer protocol
(``user_vectors``, ``item_matrix``) over EventSeqs and ``encode_history`` for one request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from models.config import TrainConfig
from models.sequences import EventSeqs
from models.train import (
    TrainControl,
    TrainResult,
    ValidateFn,
    auto_batch_size,
    fit,
    prepare_training,
    to_device,
)


@dataclass
class SASRecConfig:
    """SASRec hyper-parameters (the usual values for MovieLens)."""

    embed_dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    max_len: int = 200
    dropout: float = 0.2


class SASRecBlock(nn.Module):
    """Pre-norm causal self-attention + point-wise feed-forward."""

    def __init__(self, d: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(dropout), nn.Linear(d, d))
        self.dropout = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask[:, None],
            dropout_p=self.p if self.training else 0.0,
        )
        x = x + self.dropout(self.proj(a.transpose(1, 2).reshape(B, T, D)))
        return x + self.dropout(self.ffn(self.norm2(x)))


class SASRec(nn.Module):
    """Item table rows: 0 .. n_items-1 TRAIN items, then OOV buckets, then one padding row."""

    def __init__(self, n_items: int, n_oov_buckets: int, cfg: SASRecConfig) -> None:
        super().__init__()
        self.n_items, self.cfg = n_items, cfg
        self.pad = n_items + n_oov_buckets
        self.item_emb = nn.Embedding(self.pad + 1, cfg.embed_dim, padding_idx=self.pad)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.embed_dim)
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.pos_emb.weight, std=0.05)
        with torch.no_grad():
            self.item_emb.weight[self.pad].zero_()
        self.blocks = nn.ModuleList(
            [SASRecBlock(cfg.embed_dim, cfg.n_heads, cfg.dropout) for _ in range(cfg.n_layers)]
        )
        self.norm = nn.LayerNorm(cfg.embed_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    @property
    def embed_dim(self) -> int:
        return self.cfg.embed_dim

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [B, T<=max_len] left-padded with ``self.pad`` -> hidden states [B, T, D]."""
        B, T = windows.shape
        real = windows != self.pad
        x = self.item_emb(windows) * self.embed_dim**0.5
        x = x + self.pos_emb.weight[self.cfg.max_len - T :][None]
        x = self.dropout(x) * real[..., None]
        idx = torch.arange(T, device=windows.device)
        causal = idx[None, :] <= idx[:, None]
        # Keys must be real events; a padding query may see itself so no row is all -inf.
        mask = (causal[None] & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def item_weight(self) -> torch.Tensor:
        return self.item_emb.weight[: self.n_items]

    def item_matrix(self) -> torch.Tensor:
        return self.item_weight().detach()

    def score(self, user_vec: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        if items is None:
            return user_vec @ self.item_weight().T
        return torch.einsum("bd,bcd->bc", user_vec, self.item_emb(items))

    @torch.no_grad()
    def encode_history(self, items: torch.Tensor) -> torch.Tensor:
        """User vector [D] from one user's item history (encoded indices, oldest first);
        only the last max_len events are used: the per-request path of a SASRec service."""
        self.eval()
        w = items[-self.cfg.max_len :].to(self.item_emb.weight.device)
        return self(w[None])[0, -1]

    @torch.no_grad()
    def user_vectors(
        self,
        seqs: EventSeqs,
        query_rows: np.ndarray,
        request_ts: np.ndarray | None = None,
        batch_size: int = 512,
    ) -> torch.Tensor:
        """[n, D]: for each query row r, the last <= max_len events of r's user up to and
        including r, encoded as one left-padded window; windows run in batches. SASRec
        does not use the request time."""
        self.eval()
        device = self.item_emb.weight.device
        rows = np.asarray(query_rows, dtype=np.int64)
        out = torch.zeros(len(rows), self.embed_dim, device=device)
        starts = seqs.offsets[seqs.user_of_event()[rows]] if len(rows) else rows
        for b in range(0, len(rows), batch_size):
            r, s = rows[b : b + batch_size], starts[b : b + batch_size]
            w = window_matrix(seqs.items, r, s, self.cfg.max_len, self.pad)
            out[b : b + len(r)] = self(torch.as_tensor(w, device=device))[:, -1]
        return out


def window_matrix(
    items: np.ndarray, ends: np.ndarray, starts: np.ndarray, max_len: int, pad: int
) -> np.ndarray:
    """[n, T] left-padded windows items[max(start, end - T + 1) .. end], T = the longest
    window needed (<= max_len)."""
    n_real = np.minimum(ends - starts + 1, max_len)
    T = int(n_real.max()) if len(ends) else 0
    idx = ends[:, None] - np.arange(T - 1, -1, -1)[None, :]
    ok = idx >= (ends - n_real + 1)[:, None]
    return np.where(ok, items[np.where(ok, idx, 0)], pad).astype(np.int64)


def training_windows(
    lengths: np.ndarray, offsets: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of training windows of max_len + 1 events (inputs and next-item
    targets), tiling each user's first ``lengths[u]`` events from the end backwards."""
    starts, ends = [], []
    for u, n in enumerate(lengths):
        end = int(offsets[u]) + int(n) - 1
        first = int(offsets[u])
        while end - first >= 1:
            starts.append(first)
            ends.append(end)
            end -= max_len
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


class SASRecEpoch:
    """One epoch over the training windows, full-softmax next-item cross-entropy."""

    def __init__(
        self,
        model: SASRec,
        seqs: EventSeqs,
        lengths: np.ndarray,
        tcfg: TrainConfig,
        device: torch.device,
    ) -> None:
        self.model, self.seqs, self.tcfg, self.device = model, seqs, tcfg, device
        self.starts, self.ends = training_windows(lengths, seqs.offsets, model.cfg.max_len)
        self.batch_size = auto_batch_size(tcfg, int((np.asarray(lengths) >= 2).sum()))
        self.rng = np.random.default_rng(tcfg.seed)
        self.optim: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay
        )

    def __call__(self, epoch: int, control: TrainControl) -> float:
        model, L = self.model, self.model.cfg.max_len
        order = self.rng.permutation(len(self.ends))
        total: torch.Tensor | float = 0.0
        count = 0
        bar = tqdm(
            range(0, len(order), self.batch_size),
            desc=f"sasrec epoch {epoch + 1}",
            leave=False,
        )
        for b in bar:
            sel = order[b : b + self.batch_size]
            w_np = window_matrix(
                self.seqs.items, self.ends[sel], self.starts[sel], L + 1, model.pad
            )
            # targets chosen on the host: no step waits for the device
            mask_np = (w_np[:, :-1] != model.pad) & (w_np[:, 1:] < model.n_items)
            n = int(mask_np.sum())
            if n == 0:
                continue
            w = to_device(torch.from_numpy(w_np), self.device)
            flat = to_device(torch.from_numpy(np.flatnonzero(mask_np)), self.device)
            inputs, targets = w[:, :-1], w[:, 1:]
            h = model(inputs)
            h_sel = h.reshape(-1, h.shape[-1]).index_select(0, flat)
            tgt = targets.reshape(-1).index_select(0, flat)
            loss = F.cross_entropy(h_sel @ model.item_weight().T, tgt)
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            control.before_step()
            self.optim.step()
            step_loss = loss.detach()
            total = step_loss * n + total
            count += n
            bar.set_postfix(step=control.step)
            if control.after_step(step_loss, n):
                break
        return float(total) / max(count, 1)


def train_sasrec(
    model: SASRec,
    seqs: EventSeqs,
    tcfg: TrainConfig,
    lengths: np.ndarray | None = None,
    validate: ValidateFn | None = None,
    device: torch.device | None = None,
) -> TrainResult:
    """Train on each user's first ``lengths[u]`` events of ``seqs`` (default: all)."""
    device, lens = prepare_training(model, seqs, tcfg, lengths, device)
    return fit(model, SASRecEpoch(model, seqs, lens, tcfg, device), tcfg, validate)
