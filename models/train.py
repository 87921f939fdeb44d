"""Training over given event sequences (no files, no datasets): the epoch loop with early
stopping shared by every model, and the memory recommender's epoch.

The memory recommender trains with truncated back-propagation: each batch of users runs
through its sequences in segments of ``segment_len`` events; the ``MemoryState`` is carried
across segments detached, so Proteus positions stay exact while gradients stop at segment
boundaries. The loss is the next-item cross-entropy over the TRAIN catalog (full softmax)
or a sampled softmax with log-Q correction.

``proteus_ffn_mask`` (paper section 2.4) applies the Proteus prefix schedule to the
optimizer updates of the feed-forward weights, keyed on the optimizer step: each FFN tensor
is flattened and split into E = memory.n_blocks blocks; at step i only the coordinates of the
first k(i) blocks (horizon ``proteus_ffn_horizon`` steps) change, and locked coordinates keep
their AdamW moments too (``ProteusUpdateMask``).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from models.config import TrainConfig
from models.embeddings import kjt_available
from models.memory.proteus import open_rows
from models.recommender import MemoryRecommender, padded_batch
from models.sequences import EventSeqs

log = logging.getLogger(__name__)

EpochFn = Callable[[int], float]
"""Runs one training epoch (0-based index) and returns its mean training loss."""
ValidateFn = Callable[[], dict[str, float]]
"""Returns validation metrics (at least ``early_stop_metric``) for the current weights."""


@dataclass
class TrainResult:
    """What ``fit`` did: per-epoch history, the best epoch and its metrics, the time spent."""

    history: list[dict[str, object]] = field(default_factory=list)
    best_epoch: int = -1
    best_valid: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    stopped: str = "epochs"


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_train_config(tcfg: TrainConfig) -> None:
    """Reject settings the loops cannot run with, naming the field."""
    checks = [
        (tcfg.epochs >= 1, "train.epochs must be >= 1"),
        (tcfg.batch_size >= 1, "train.batch_size must be >= 1"),
        (tcfg.segment_len >= 1, "train.segment_len must be >= 1"),
        (tcfg.lr > 0, "train.lr must be > 0"),
        (tcfg.patience >= 1, "train.patience must be >= 1"),
        (tcfg.eval_every >= 1, "train.eval_every must be >= 1"),
        (tcfg.n_negatives >= 1, "train.n_negatives must be >= 1"),
        (tcfg.proteus_ffn_horizon >= 1, "train.proteus_ffn_horizon must be >= 1"),
        (tcfg.loss in ("full", "sampled"), "train.loss must be full or sampled"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def fit(
    model: nn.Module,
    run_epoch: EpochFn,
    tcfg: TrainConfig,
    validate: ValidateFn | None = None,
    early_stop_metric: str = "ndcg@10",
) -> TrainResult:
    """Epoch loop: train, validate every ``eval_every`` epochs, keep the best weights (by
    ``early_stop_metric``), stop after ``patience`` validations without improvement or
    after ``max_seconds``. The model ends holding the best weights."""
    check_train_config(tcfg)
    result = TrainResult()
    best_state: dict[str, torch.Tensor] | None = None
    best_score = -math.inf
    bad = 0
    start = time.perf_counter()
    for epoch in range(tcfg.epochs):
        model.train()
        loss = run_epoch(epoch)
        entry: dict[str, object] = {"epoch": epoch + 1, "train_loss": loss}
        elapsed = time.perf_counter() - start
        last = epoch + 1 == tcfg.epochs
        out_of_time = tcfg.max_seconds > 0 and elapsed >= tcfg.max_seconds
        if validate is not None and ((epoch + 1) % tcfg.eval_every == 0 or last or out_of_time):
            model.eval()
            metrics = validate()
            entry["valid"] = metrics
            score = float(metrics[early_stop_metric])
            log.info(
                "epoch %d: loss %.4f, valid %s %.4f", epoch + 1, loss, early_stop_metric, score
            )
            if score > best_score:
                best_score, bad = score, 0
                best_state = copy.deepcopy(model.state_dict())
                result.best_epoch, result.best_valid = epoch + 1, dict(metrics)
            else:
                bad += 1
        else:
            log.info("epoch %d: loss %.4f", epoch + 1, loss)
        entry["seconds"] = time.perf_counter() - start
        result.history.append(entry)
        if validate is not None and bad >= tcfg.patience:
            result.stopped = "early_stop"
            break
        if out_of_time:
            result.stopped = "max_seconds"
            break
    result.train_seconds = time.perf_counter() - start
    if best_state is not None:
        model.load_state_dict(best_state)
    elif validate is None:
        result.best_epoch = len(result.history)
    model.eval()
    return result


def length_batches(
    lengths: np.ndarray, batch_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Users (indices with length >= 2) grouped into batches of similar length, in random
    order; ties are broken randomly so batches differ between epochs."""
    users = np.nonzero(lengths >= 2)[0]
    users = users[rng.permutation(len(users))]
    users = users[np.argsort(lengths[users], kind="stable")]
    batches = [users[i : i + batch_size] for i in range(0, len(users), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


class ItemSampler:
    """Negatives for the sampled softmax, drawn from the TRAIN item frequency ** 0.75,
    with log Q(item) for the correction."""

    def __init__(self, counts: np.ndarray, device: torch.device, power: float = 0.75) -> None:
        w = np.power(np.maximum(counts.astype(np.float64), 0.0) + 1.0, power)
        self.probs = torch.as_tensor(w / w.sum(), dtype=torch.float32, device=device)
        self.log_q = torch.log(self.probs)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.multinomial(self.probs.cpu(), n, replacement=True, generator=generator).to(
            self.probs.device
        )


def next_item_loss(
    user_vecs: torch.Tensor,
    targets: torch.Tensor,
    item_weight: torch.Tensor,
    sampler: ItemSampler | None = None,
    negatives: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` [N] given user vectors [N, D]: full softmax over
    ``item_weight`` [n_items, D], or, with ``sampler`` and shared ``negatives`` [n], the
    sampled softmax with log-Q correction (accidental hits of the target are masked)."""
    if sampler is None or negatives is None:
        return F.cross_entropy(user_vecs @ item_weight.T, targets)
    pos = (user_vecs * item_weight[targets]).sum(-1) - sampler.log_q[targets]
    neg = user_vecs @ item_weight[negatives].T - sampler.log_q[negatives][None, :]
    neg = neg.masked_fill(negatives[None, :] == targets[:, None], -torch.inf)
    logits = torch.cat([pos[:, None], neg], dim=1)
    return F.cross_entropy(logits, torch.zeros_like(targets))


class ProteusUpdateMask:
    """Proteus prefix mask on optimizer updates (paper section 2.4): around each optimizer
    step, the locked coordinates of ``params`` (flattened) and their optimizer state
    (AdamW's exp_avg, exp_avg_sq) are put back to their values before the step."""

    def __init__(
        self, params: list[nn.Parameter], optim: torch.optim.Optimizer, n_blocks: int, horizon: int
    ) -> None:
        self.params, self.optim = params, optim
        self.n_blocks, self.horizon = n_blocks, horizon
        self.step = 0
        self._saved: list[tuple[torch.Tensor, int, dict[str, torch.Tensor]]] = []

    def open_coords(self, numel: int, step: int) -> int:
        """Leading coordinates (of ``numel``) open at 1-based optimizer step ``step``."""
        return (
            open_rows(step, numel, self.n_blocks, self.horizon) if numel >= self.n_blocks else numel
        )

    def before_step(self) -> None:
        self.step += 1
        self._saved = []
        for p in self.params:
            n = self.open_coords(p.numel(), self.step)
            if n >= p.numel():
                continue
            flat = p.detach().view(-1)
            state = {
                k: v.view(-1)[n:].clone()
                for k, v in self.optim.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape
            }
            self._saved.append((p, n, {"param": flat[n:].clone(), **state}))

    def after_step(self) -> None:
        with torch.no_grad():
            for p, n, saved in self._saved:
                p.view(-1)[n:] = saved["param"]
                st = self.optim.state.get(p, {})
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        # State first created by this step starts at zero where locked.
                        v.view(-1)[n:] = saved.get(k, 0)
        self._saved = []


def ffn_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The feed-forward (MLP) parameters of every memory layer."""
    return [
        p
        for layer in getattr(model, "layers", [])
        if getattr(layer, "ffn", None) is not None
        for p in layer.ffn.parameters()
    ]


class MemoryEpoch:
    """One epoch of truncated-BPTT next-item training of a ``MemoryRecommender``."""

    def __init__(
        self,
        model: MemoryRecommender,
        seqs: EventSeqs,
        lengths: np.ndarray,
        tcfg: TrainConfig,
        device: torch.device,
    ) -> None:
        self.model, self.seqs, self.tcfg, self.device = model, seqs, tcfg, device
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.rng = np.random.default_rng(tcfg.seed)
        self.gen = torch.Generator().manual_seed(tcfg.seed)
        self.optim = torch.optim.AdamW(
            model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay
        )
        self.update_mask: ProteusUpdateMask | None = None
        if tcfg.proteus_ffn_mask:
            mem = model.mem_cfg
            self.update_mask = ProteusUpdateMask(
                ffn_parameters(model), self.optim, mem.n_blocks, tcfg.proteus_ffn_horizon
            )
        self.sampler: ItemSampler | None = None
        if tcfg.loss == "sampled":
            rows = np.concatenate(
                [np.arange(s, s + n) for s, n in zip(seqs.offsets[:-1], self.lengths)]
                or [np.zeros(0, dtype=np.int64)]
            )
            it = seqs.items[rows]
            counts = np.bincount(it[it < model.n_items], minlength=model.n_items)
            self.sampler = ItemSampler(counts, device)
        model.use_kjt = kjt_available(device)

    def __call__(self, epoch: int) -> float:
        tcfg = self.tcfg
        batches = length_batches(self.lengths, tcfg.batch_size, self.rng)
        total, count = 0.0, 0
        bar = tqdm(batches, desc=f"epoch {epoch + 1}", unit="batch", leave=False)
        for users in bar:
            loss_sum, n = self._batch(users)
            total += loss_sum
            count += n
            bar.set_postfix(loss=f"{total / max(count, 1):.4f}")
        return total / max(count, 1)

    def _batch(self, users: np.ndarray) -> tuple[float, int]:
        model, tcfg, device = self.model, self.tcfg, self.device
        lengths = self.lengths[users]
        items, actions, ts, lens = padded_batch(self.seqs, users, lengths, device)
        # Inputs are events 0 .. len-2; the target of input t is item t + 1.
        in_len = lens - 1
        targets = torch.cat([items[:, 1:], items.new_zeros(len(users), 1)], dim=1)
        # the question about input t is asked at the time of event t + 1
        request_ts = torch.cat([ts[:, 1:], ts[:, -1:]], dim=1)
        T = int(in_len.max())
        state = model.init_state(len(users), device)
        loss_sum, n_total = 0.0, 0
        for s in range(0, T, tcfg.segment_len):
            e = min(s + tcfg.segment_len, T)
            seg_len = torch.clamp(in_len - s, min=0, max=e - s)
            res = model.advance(
                items[:, s:e], actions[:, s:e], ts[:, s:e], seg_len, state,
                request_ts=request_ts[:, s:e],
            )  # fmt: skip
            assert res.user is not None
            state = res.state.detach()
            cols = torch.arange(e - s, device=device)[None, :]
            tgt = targets[:, s:e]
            mask = (cols < seg_len[:, None]) & (tgt < model.n_items)
            n = int(mask.sum())
            if n == 0:
                continue
            negatives = None
            if self.sampler is not None:
                negatives = self.sampler.sample(tcfg.n_negatives, self.gen)
            loss = next_item_loss(
                res.user[mask], tgt[mask], model.item_weight(), self.sampler, negatives
            )
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if self.update_mask is not None:
                self.update_mask.before_step()
            self.optim.step()
            if self.update_mask is not None:
                self.update_mask.after_step()
            loss_sum += float(loss.detach()) * n
            n_total += n
        return loss_sum, n_total


def train_memory_model(
    model: MemoryRecommender,
    seqs: EventSeqs,
    tcfg: TrainConfig,
    lengths: np.ndarray | None = None,
    validate: ValidateFn | None = None,
    device: torch.device | None = None,
) -> TrainResult:
    """Train ``model`` on each user's first ``lengths[u]`` events of ``seqs`` (default: all)."""
    device, lens = prepare_training(model, seqs, tcfg, lengths, device)
    return fit(model, MemoryEpoch(model, seqs, lens, tcfg, device), tcfg, validate)


def prepare_training(
    model: nn.Module,
    seqs: EventSeqs,
    tcfg: TrainConfig,
    lengths: np.ndarray | None,
    device: torch.device | None,
) -> tuple[torch.device, np.ndarray]:
    """Seed, place the model, and check the per-user training lengths (default: all)."""
    seed_everything(tcfg.seed)
    device = device or pick_device(tcfg.device)
    model.to(device)
    lens = seqs.lengths() if lengths is None else np.asarray(lengths)
    if len(lens) != seqs.n_users:
        raise ValueError(f"lengths has {len(lens)} entries for {seqs.n_users} users")
    return device, lens
