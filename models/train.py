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
from typing import Protocol

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
from models.state import MemoryState
from models.train_step import SegmentBatch, StaticSegmentStep, static_step_fits

log = logging.getLogger(__name__)

LOSS_WEIGHTS = ("step", "target")
BATCH_USERS_DIVISOR = 48
BATCH_MIN, BATCH_MAX = 16, 128
"""``train.batch_size = 0``: users per step = training users / BATCH_USERS_DIVISOR, clipped
to [BATCH_MIN, BATCH_MAX] (ML-100K: 19, ML-1M: 125), so a small dataset still gets enough
optimizer steps per pass and a large one fills the GPU."""

ValidateFn = Callable[[], dict[str, float]]
"""Returns validation metrics (at least ``early_stop_metric``) for the current weights."""


class Epoch(Protocol):
    """One pass over the training data; calls ``control.before_step()`` before and
    ``control.after_step(loss, n)`` after each optimizer step and stops early when the
    latter returns True. Returns the pass's mean training loss."""

    optim: torch.optim.Optimizer

    def __call__(self, epoch: int, control: TrainControl) -> float: ...


@dataclass
class TrainResult:
    """What ``fit`` did: one history entry per validation, the best one, the time spent."""

    history: list[dict[str, object]] = field(default_factory=list)
    best_epoch: int = -1
    best_step: int = -1
    best_valid: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    valid_seconds: float = 0.0
    """Of train_seconds, the time spent validating."""
    steps: int = 0
    targets: int = 0
    """Next-item targets trained on (summed over steps)."""
    stopped: str = "epochs"
    replay: dict[str, object] = field(default_factory=dict)
    """Replay-aware training after the base training (offline_eval/replay_training.py),
    when it ran: steps, seconds, notes, history."""

    def targets_per_second(self) -> float:
        """Training throughput: targets per second of training, validation excluded."""
        return self.targets / max(self.train_seconds - self.valid_seconds, 1e-9)


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def auto_batch_size(tcfg: TrainConfig, n_train_users: int) -> int:
    """``train.batch_size``, or for 0 the size derived from the number of training users."""
    if tcfg.batch_size > 0:
        return tcfg.batch_size
    return int(np.clip(n_train_users // BATCH_USERS_DIVISOR, BATCH_MIN, BATCH_MAX))


def check_train_config(tcfg: TrainConfig) -> None:
    """Reject settings the loops cannot run with, naming the field."""
    checks = [
        (tcfg.epochs >= 1, "train.epochs must be >= 1"),
        (tcfg.batch_size >= 0, "train.batch_size must be >= 0 (0 = from the dataset size)"),
        (tcfg.segment_len >= 1, "train.segment_len must be >= 1"),
        (tcfg.lr > 0, "train.lr must be > 0"),
        (tcfg.warmup_steps >= 0, "train.warmup_steps must be >= 0"),
        (0 < tcfg.lr_decay <= 1, "train.lr_decay must be in (0, 1]"),
        (tcfg.decay_patience >= 0, "train.decay_patience must be >= 0"),
        (tcfg.patience >= 1, "train.patience must be >= 1"),
        (tcfg.eval_every >= 1, "train.eval_every must be >= 1"),
        (tcfg.n_negatives >= 1, "train.n_negatives must be >= 1"),
        (tcfg.proteus_ffn_horizon >= 1, "train.proteus_ffn_horizon must be >= 1"),
        (tcfg.loss in ("full", "sampled"), "train.loss must be full or sampled"),
        (
            tcfg.loss_weight in LOSS_WEIGHTS,
            f"train.loss_weight must be {' or '.join(LOSS_WEIGHTS)}",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


class TrainControl:
    """The recipe every model trains with, counted in optimizer steps and validations (never
    epochs, so one setting fits datasets of any size): linear warmup to ``lr`` over
    ``warmup_steps``; validation every ``eval_every`` steps, keeping the best weights;
    after ``decay_patience`` validations without improvement the rate is multiplied by
    ``lr_decay``; after ``patience`` validations without improvement, or ``max_seconds``,
    training stops."""

    def __init__(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        tcfg: TrainConfig,
        validate: ValidateFn | None,
        metric: str,
    ) -> None:
        self.model, self.optim, self.tcfg = model, optim, tcfg
        self.validate_fn, self.metric = validate, metric
        self.result = TrainResult()
        self.step = 0
        self.epoch = 0
        self.scale = 1.0
        self.best_score = -math.inf
        self.best_state: dict[str, torch.Tensor] | None = None
        self.bad = 0
        self.since_decay = 0
        self.loss_sum: float | torch.Tensor = 0.0
        self.loss_n = 0
        self.start = time.perf_counter()
        self.stop = False
        self.checked_at = -1

    def lr(self) -> float:
        warm = min(1.0, (self.step + 1) / self.tcfg.warmup_steps) if self.tcfg.warmup_steps else 1.0
        return self.tcfg.lr * warm * self.scale

    def before_step(self) -> None:
        for group in self.optim.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # a graphed step reads it on the device
                group["lr"].fill_(self.lr())
            else:
                group["lr"] = self.lr()

    def after_step(self, loss: float | torch.Tensor, n: int) -> bool:
        """Count a step of mean loss ``loss`` over ``n`` targets (a device tensor is read
        only at the next validation); True = stop training."""
        self.step += 1
        self.result.targets += n
        self.loss_sum += loss * n
        self.loss_n += n
        out_of_time = self.tcfg.max_seconds > 0 and self.elapsed() >= self.tcfg.max_seconds
        if self.step % self.tcfg.eval_every == 0 or out_of_time:
            self.check()
        if out_of_time and not self.stop:
            self.stop, self.result.stopped = True, "max_seconds"
        return self.stop

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def check(self) -> None:
        """Validate now (when a validation function was given) and apply the recipe."""
        self.checked_at = self.step
        entry: dict[str, object] = {
            "step": self.step,
            "epoch": self.epoch + 1,
            "lr": self.lr(),
            "train_loss": float(self.loss_sum) / max(self.loss_n, 1),
        }
        self.loss_sum, self.loss_n = 0.0, 0
        if not math.isfinite(entry["train_loss"]):  # type: ignore[arg-type]
            self.diverged(entry)
            return
        if self.validate_fn is not None:
            was_training = self.model.training
            self.model.eval()
            began = time.perf_counter()
            metrics = self.validate_fn()
            self.result.valid_seconds += time.perf_counter() - began
            self.model.train(was_training)
            entry["valid"] = metrics
            score = float(metrics[self.metric])
            if score > self.best_score:
                self.best_score, self.bad, self.since_decay = score, 0, 0
                self.best_state = copy.deepcopy(self.model.state_dict())
                self.result.best_epoch, self.result.best_step = self.epoch + 1, self.step
                self.result.best_valid = dict(metrics)
            else:
                self.bad += 1
                self.since_decay += 1
                if self.tcfg.decay_patience and self.since_decay >= self.tcfg.decay_patience:
                    self.scale *= self.tcfg.lr_decay
                    self.since_decay = 0
            log.info(
                "step %d (epoch %d): loss %.4f, valid %s %.4f, lr %.2e",
                self.step, self.epoch + 1, entry["train_loss"], self.metric, score, self.lr(),
            )  # fmt: skip
            if self.bad >= self.tcfg.patience:
                self.stop, self.result.stopped = True, "early_stop"
        entry["seconds"] = self.elapsed()
        self.result.history.append(entry)

    def diverged(self, entry: dict[str, object]) -> None:
        """A non-finite training loss: stop now; training ends with the best validated
        weights, or fails when there are none."""
        log.warning(
            "step %d (epoch %d): training loss %s: training diverged; stopping with the best "
            "validated weights (step %s)", self.step, self.epoch + 1, entry["train_loss"],
            self.result.best_step,
        )  # fmt: skip
        entry["seconds"] = self.elapsed()
        self.result.history.append(entry)
        self.stop, self.result.stopped = True, "diverged"
        if self.best_state is None:
            raise FloatingPointError(
                f"training diverged (loss {entry['train_loss']}) at step {self.step}, before "
                "any validation: lower train.lr or raise train.warmup_steps"
            )


def fit(
    model: nn.Module,
    run_epoch: Epoch,
    tcfg: TrainConfig,
    validate: ValidateFn | None = None,
    early_stop_metric: str = "ndcg@10",
) -> TrainResult:
    """Train with the recipe of :class:`TrainControl` for at most ``tcfg.epochs`` passes.
    The model ends holding the best validated weights (the last ones without ``validate``)."""
    check_train_config(tcfg)
    control = TrainControl(model, run_epoch.optim, tcfg, validate, early_stop_metric)
    for epoch in range(tcfg.epochs):
        control.epoch = epoch
        model.train()
        run_epoch(epoch, control)
        if control.stop:
            break
    if control.checked_at != control.step:
        control.check()  # the steps since the last validation
    result = control.result
    result.steps = control.step
    result.train_seconds = control.elapsed()
    if control.best_state is not None:
        model.load_state_dict(control.best_state)
    elif validate is None:
        result.best_epoch, result.best_step = control.epoch + 1, control.step
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
        self.batch_size = auto_batch_size(tcfg, int((self.lengths >= 2).sum()))
        self.ref_targets = 1.0
        """Training targets per step over the current epoch (``train.loss_weight`` target)."""
        self.rng = np.random.default_rng(tcfg.seed)
        self.gen = torch.Generator().manual_seed(tcfg.seed)
        self.static: StaticSegmentStep | None = None
        graphed = (
            tcfg.cuda_graphs
            and device.type == "cuda"
            and tcfg.loss == "full"
            and not tcfg.proteus_ffn_mask
            and not model.sched.adaptive  # its decision windows are laid out per segment
            and static_step_fits(self.batch_size, tcfg.segment_len, model.n_items)
        )
        if graphed:
            # a capturable AdamW with a device learning rate: the step replays in a graph
            self.optim: torch.optim.Optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=torch.tensor(tcfg.lr, device=device),
                weight_decay=tcfg.weight_decay,
                capturable=True,
                foreach=True,
            )
            self.static = StaticSegmentStep(
                model, self.optim, self.batch_size, tcfg.segment_len, device, graph=True
            )
        else:
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
        # the graphed step takes the padded embedding lookups (no host syncs)
        model.use_kjt = kjt_available(device) and self.static is None

    def __call__(self, epoch: int, control: TrainControl) -> float:
        batches = length_batches(self.lengths, self.batch_size, self.rng)
        if self.tcfg.loss_weight == "target":
            self.ref_targets = mean_targets_per_step(batches, self.lengths, self.tcfg.segment_len)
        total, count = torch.zeros(()), 0
        bar = tqdm(batches, desc=f"epoch {epoch + 1}", unit="batch", leave=False)
        for users in bar:
            run = self._batch if self.static is None else self._batch_static
            loss_sum, n = run(users, control)
            total = loss_sum + total
            count += n
            bar.set_postfix(step=control.step)
            if control.stop:
                break
        return float(total) / max(count, 1)

    def _batch(self, users: np.ndarray, control: TrainControl) -> tuple[torch.Tensor, int]:
        """Train on one batch of users, segment by segment; (summed loss, targets). The
        targets are chosen on the host, so no step waits for the device."""
        model, tcfg, device = self.model, self.tcfg, self.device
        lengths = self.lengths[users]
        host = padded_batch(self.seqs, users, lengths, "cpu")
        items, actions, ts, lens = (to_device(x, device) for x in host)
        # Inputs are events 0 .. len-2; the target of input t is item t + 1.
        in_len = lens - 1
        targets = torch.cat([items[:, 1:], items.new_zeros(len(users), 1)], dim=1)
        # the question about input t is asked at the time of event t + 1
        request_ts = torch.cat([ts[:, 1:], ts[:, -1:]], dim=1)
        in_len_np = lengths - 1
        targets_np = np.concatenate(
            [host[0].numpy()[:, 1:], np.zeros((len(users), 1), np.int64)], axis=1
        )
        T = int(in_len_np.max())
        state = model.init_state(len(users), device)
        loss_sum, n_total = torch.zeros((), device=device), 0
        for s in range(0, T, tcfg.segment_len):
            e = min(s + tcfg.segment_len, T)
            seg_np = np.clip(in_len_np - s, 0, e - s)
            mask_np = (np.arange(e - s)[None, :] < seg_np[:, None]) & (
                targets_np[:, s:e] < model.n_items
            )
            n = int(mask_np.sum())
            seg_len = torch.clamp(in_len - s, min=0, max=e - s)
            res = model.advance(
                items[:, s:e], actions[:, s:e], ts[:, s:e], seg_len, state,
                request_ts=request_ts[:, s:e],
                host_positions=(np.minimum(in_len_np, s), seg_np),  # no device reads
            )  # fmt: skip
            assert res.user is not None
            state = res.state.detach()
            if n == 0:
                continue  # nothing to learn in this segment; the state still moves on
            flat = to_device(torch.from_numpy(np.flatnonzero(mask_np)), device)
            user_vecs = res.user.reshape(-1, res.user.shape[-1]).index_select(0, flat)
            tgt = targets[:, s:e].reshape(-1).index_select(0, flat)
            negatives = None
            if self.sampler is not None:
                negatives = self.sampler.sample(tcfg.n_negatives, self.gen)
            loss = next_item_loss(user_vecs, tgt, model.item_weight(), self.sampler, negatives)
            step_loss = loss.detach()
            if tcfg.loss_weight == "target":
                loss = loss * (n / self.ref_targets)
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            control.before_step()
            if self.update_mask is not None:
                self.update_mask.before_step()
            self.optim.step()
            if self.update_mask is not None:
                self.update_mask.after_step()
            loss_sum = loss_sum + step_loss * n
            n_total += n
            if control.after_step(step_loss, n):
                break
        return loss_sum, n_total

    def _batch_static(self, users: np.ndarray, control: TrainControl) -> tuple[torch.Tensor, int]:
        """``_batch`` through the fixed-shape (CUDA-graphed) step (models/train_step.py)."""
        assert self.static is not None
        model, seg_len_max = self.model, self.tcfg.segment_len
        lengths = self.lengths[users]
        items, actions, ts, _ = (x.numpy() for x in padded_batch(self.seqs, users, lengths, "cpu"))
        in_len = lengths - 1
        zero = np.zeros((len(users), 1), np.int64)
        targets = np.concatenate([items[:, 1:], zero], axis=1)
        request_ts = np.concatenate([ts[:, 1:], ts[:, -1:]], axis=1)
        state: MemoryState | None = None
        loss_sum, n_total = torch.zeros((), device=self.device), 0
        for s in range(0, int(in_len.max()), seg_len_max):
            e = min(s + seg_len_max, int(in_len.max()))
            seg_len = np.clip(in_len - s, 0, e - s)
            weights = (np.arange(e - s)[None, :] < seg_len[:, None]) & (
                targets[:, s:e] < model.n_items
            )
            n = int(weights.sum())
            norm = self.ref_targets if self.tcfg.loss_weight == "target" else max(n, 1)
            seg = SegmentBatch(
                items[:, s:e], actions[:, s:e], ts[:, s:e], request_ts[:, s:e],
                np.where(weights, targets[:, s:e], 0), weights.astype(np.float32), seg_len,
                float(norm),
            )  # fmt: skip
            control.before_step()
            loss, state = self.static.run(seg, state)
            if self.tcfg.loss_weight == "target":
                loss = loss * (norm / max(n, 1))  # reported: the mean over the step's targets
            loss_sum = loss_sum + loss * n
            n_total += n
            if control.after_step(loss, n):
                break
        return loss_sum, n_total


def mean_targets_per_step(batches: list[np.ndarray], lengths: np.ndarray, segment: int) -> float:
    """Training targets per optimizer step over an epoch of ``batches`` (a user of length n
    has n - 1 targets; a batch takes one step per segment of its longest user)."""
    targets = steps = 0
    for users in batches:
        in_len = lengths[users] - 1
        targets += int(in_len.sum())
        steps += -(-int(in_len.max()) // segment)
    return max(targets / max(steps, 1), 1.0)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` (on the host) on ``device``; to a GPU through pinned memory without waiting."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


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
