"""Training loop: the loss falls, sampled softmax works, runs are deterministic, early
stopping keeps the best weights, segments carry the state exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.recommender import MemoryRecommender
from models.train import (
    ItemSampler,
    ProteusUpdateMask,
    TrainControl,
    auto_batch_size,
    check_train_config,
    fit,
    length_batches,
    mean_targets_per_step,
    next_item_loss,
    train_memory_model,
)
from recmem.config import Config, TrainConfig
from tests.models.synth import cyclic_seqs

N_ITEMS = 30


def tiny_config(**train: object) -> Config:
    cfg = Config()
    cfg.memory.key_dim = cfg.memory.value_dim = 8
    cfg.memory.n_heads = 2
    cfg.memory.n_blocks = 2
    cfg.memory.horizon = 8
    cfg.memory.backend = "recurrent"
    cfg.model.embed_dim = 16
    cfg.model.dropout = 0.0
    cfg.train.epochs = 4
    cfg.train.batch_size = 8
    cfg.train.segment_len = 8
    cfg.train.lr = 1e-2
    cfg.train.warmup_steps = 0
    cfg.train.eval_every = 2
    cfg.train.device = "cpu"
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def make_model(cfg: Config) -> MemoryRecommender:
    torch.manual_seed(cfg.train.seed)
    return MemoryRecommender(N_ITEMS, 4, cfg.memory, cfg.model)


@pytest.mark.parametrize("loss", ["full", "sampled"])
def test_loss_falls(loss: str) -> None:
    cfg = tiny_config(loss=loss, n_negatives=12)
    seqs = cyclic_seqs(n_users=16, n_items=N_ITEMS, max_len=24)
    result = train_memory_model(make_model(cfg), seqs, cfg.train)
    losses = [float(h["train_loss"]) for h in result.history]  # type: ignore[arg-type]
    assert len(losses) >= 4
    assert losses[-1] < losses[0] - 0.05


def test_deterministic_on_cpu() -> None:
    cfg = tiny_config(epochs=2)
    seqs = cyclic_seqs(n_users=12, n_items=N_ITEMS, max_len=20)
    a, b = make_model(cfg), make_model(cfg)
    ra = train_memory_model(a, seqs, cfg.train)
    rb = train_memory_model(b, seqs, cfg.train)
    assert [h["train_loss"] for h in ra.history] == [h["train_loss"] for h in rb.history]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_prefix_lengths_limit_training_events() -> None:
    """Events past a user's training prefix must not influence training at all."""
    cfg = tiny_config(epochs=1)
    seqs = cyclic_seqs(n_users=6, n_items=N_ITEMS, max_len=20)
    lengths = np.minimum(seqs.lengths(), 5)
    changed = cyclic_seqs(n_users=6, n_items=N_ITEMS, max_len=20)
    cols = seqs.position_in_user() > 5
    changed.items[cols] = (changed.items[cols] + 3) % N_ITEMS
    a, b = make_model(cfg), make_model(cfg)
    train_memory_model(a, seqs, cfg.train, lengths)
    train_memory_model(b, changed, cfg.train, lengths)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


class StepEpoch:
    """A stand-in pass of ``steps`` optimizer steps that moves one weight by 1 per step."""

    def __init__(self, model: torch.nn.Linear, steps: int) -> None:
        self.model, self.steps = model, steps
        self.optim: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        self.lrs: list[float] = []

    def __call__(self, epoch: int, control: TrainControl) -> float:
        for _ in range(self.steps):
            control.before_step()
            self.lrs.append(self.optim.param_groups[0]["lr"])
            with torch.no_grad():
                self.model.weight.add_(1.0)
            if control.after_step(1.0, 1):
                break
        return 1.0


def test_fit_counts_validations_not_epochs() -> None:
    """Validation every 3 steps across pass boundaries; the best weights come back; the rate
    warms up, decays after 2 validations without improvement and training stops after 3."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    scores = iter([0.1, 0.5, 0.3, 0.2, 0.4, 0.9])
    epoch = StepEpoch(model, steps=2)
    tcfg = TrainConfig(epochs=50, eval_every=3, patience=3, decay_patience=2, lr_decay=0.5,
                       warmup_steps=4, lr=1.0)  # fmt: skip
    result = fit(model, epoch, tcfg, lambda: {"ndcg@10": next(scores)})
    assert result.stopped == "early_stop"
    assert [e["step"] for e in result.history] == [3, 6, 9, 12, 15]
    assert result.best_step == 6 and result.best_epoch == 3
    assert result.best_valid == {"ndcg@10": 0.5} and result.steps == 15
    assert torch.equal(model.weight, torch.full((1, 2), 6.0))  # the weights after step 6
    assert epoch.lrs[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert epoch.lrs[11] == 1.0 and epoch.lrs[12] == 0.5  # decayed at validation 4 (step 12)


class DivergingEpoch(StepEpoch):
    """StepEpoch whose loss turns NaN from step ``bad_from`` (1-based) on."""

    def __init__(self, model: torch.nn.Linear, steps: int, bad_from: int) -> None:
        super().__init__(model, steps)
        self.bad_from, self.done = bad_from, 0

    def __call__(self, epoch: int, control: TrainControl) -> float:
        for _ in range(self.steps):
            control.before_step()
            self.done += 1
            with torch.no_grad():
                self.model.weight.add_(1.0)
            loss = math.nan if self.done >= self.bad_from else 1.0
            if control.after_step(torch.tensor(loss), 1):
                break
        return 1.0


def test_fit_stops_when_the_loss_diverges() -> None:
    """A NaN training loss stops training at the next validation with the best validated
    weights, never validating the diverged ones; with none validated yet, training fails."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    calls: list[int] = []
    tcfg = TrainConfig(epochs=50, eval_every=3, patience=5, warmup_steps=0)
    valid = lambda: calls.append(1) or {"ndcg@10": float(len(calls))}  # noqa: E731
    result = fit(model, DivergingEpoch(model, steps=4, bad_from=8), tcfg, valid)
    assert result.stopped == "diverged" and len(calls) == 2  # steps 3 and 6 validated
    assert result.best_step == 6 and result.steps == 9
    assert torch.equal(model.weight, torch.full((1, 2), 6.0))
    assert not math.isfinite(result.history[-1]["train_loss"])
    with pytest.raises(FloatingPointError, match="diverged .* at step 3, before any validation"):
        fit(model, DivergingEpoch(model, steps=4, bad_from=1), tcfg, valid)


def test_fit_validates_the_last_steps_once() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    calls = []
    tcfg = TrainConfig(epochs=2, eval_every=4, patience=5, warmup_steps=0)
    result = fit(
        model, StepEpoch(model, steps=3), tcfg, lambda: calls.append(1) or {"ndcg@10": len(calls)}
    )
    assert [e["step"] for e in result.history] == [4, 6] and result.stopped == "epochs"
    assert result.best_step == 6


def test_auto_batch_size_follows_the_dataset() -> None:
    assert auto_batch_size(TrainConfig(batch_size=0), 943) == 19
    assert auto_batch_size(TrainConfig(batch_size=0), 6040) == 125
    assert auto_batch_size(TrainConfig(batch_size=0), 100) == 16
    assert auto_batch_size(TrainConfig(batch_size=0), 10**6) == 128
    assert auto_batch_size(TrainConfig(batch_size=7), 10**6) == 7


def test_length_batches_cover_trainable_users_once() -> None:
    lengths = np.array([1, 5, 2, 0, 9, 3, 3, 7])
    batches = length_batches(lengths, 3, np.random.default_rng(0))
    users = np.concatenate(batches)
    assert sorted(users.tolist()) == [1, 2, 4, 5, 6, 7]
    assert all(len(b) <= 3 for b in batches)


def test_sampled_loss_with_log_q() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    u = torch.randn(5, 4, generator=g)
    tgt = torch.tensor([0, 3, 3, 9, 1])
    sampler = ItemSampler(np.ones(10), torch.device("cpu"))
    # With every item as a negative and a uniform Q, the sampled softmax equals the full
    # one except that the target's own negative column is masked.
    full = next_item_loss(u, tgt, w)
    sampled = next_item_loss(u, tgt, w, sampler, torch.arange(10))
    assert torch.allclose(full, sampled, atol=1e-6)


def test_proteus_ffn_update_mask_locks_trailing_coordinates() -> None:
    cfg = tiny_config(epochs=1, proteus_ffn_mask=True, proteus_ffn_horizon=1000)
    cfg.memory.n_blocks = 4
    model = make_model(cfg)
    ffn = model.layers[0].ffn[0].weight  # type: ignore[index]
    before = ffn.detach().clone().view(-1)
    other = model.head.norm.weight.detach().clone()
    seqs = cyclic_seqs(n_users=8, n_items=N_ITEMS, max_len=10)
    train_memory_model(model, seqs, cfg.train)
    after = ffn.detach().view(-1)
    d = ffn.numel() // 4
    # Far below the horizon only the first of 4 blocks is open.
    assert not torch.equal(after[:d], before[:d])
    assert torch.equal(after[d:], before[d:])
    assert not torch.equal(model.head.norm.weight, other)


def test_proteus_update_mask_schedule() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    optim = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1)
    mask = ProteusUpdateMask([p], optim, n_blocks=2, horizon=4)
    opened = []
    for _ in range(4):
        p.grad = torch.ones(10)
        mask.before_step()
        optim.step()
        mask.after_step()
        opened.append(int((p.detach() != 0).sum()))
        assert torch.all(optim.state[p]["exp_avg"][opened[-1] :] == 0)
    assert opened == [5, 5, 10, 10]


def test_bad_train_settings_are_rejected() -> None:
    cfg = tiny_config(segment_len=0)
    seqs = cyclic_seqs(n_users=4, n_items=N_ITEMS, max_len=6)
    with pytest.raises(ValueError, match="segment_len"):
        train_memory_model(make_model(cfg), seqs, cfg.train)
    with pytest.raises(ValueError, match="lengths"):
        train_memory_model(make_model(tiny_config()), seqs, tiny_config().train, np.ones(3))


def test_mean_targets_per_step_counts_segments() -> None:
    lengths = np.array([3, 11, 2, 21])
    # batches {0, 1}: 2 + 10 targets, longest 10 -> 2 steps of 5; {2, 3}: 1 + 20, 4 steps
    got = mean_targets_per_step([np.array([0, 1]), np.array([2, 3])], lengths, segment=5)
    assert got == (12 + 21) / (2 + 4)


def test_target_loss_weight_trains_and_is_checked() -> None:
    cfg = tiny_config(epochs=3, loss_weight="target")
    model = make_model(cfg)
    seqs = cyclic_seqs(n_users=16, n_items=N_ITEMS, max_len=24)
    result = train_memory_model(model, seqs, cfg.train)
    losses = [float(h["train_loss"]) for h in result.history]  # type: ignore[arg-type]
    assert losses[-1] < losses[0]
    assert all(0 < x < 2 * np.log(N_ITEMS) for x in losses)  # a mean cross-entropy
    with pytest.raises(ValueError, match="train.loss_weight"):
        check_train_config(tiny_config(loss_weight="user").train)
