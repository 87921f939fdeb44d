"""Configuration of the model layer: the per-user memory, the recommender around it and
training. Plain dataclasses with no I/O; ``recmem.config.Config`` composes them with the
other sections and owns loading, overrides and validation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryConfig:
    """Per-user neural memory (SPEC section 3)."""

    n_layers: int = 2
    """L: memory layers stacked in the model."""
    n_heads: int = 2
    """H: heads per layer; each head has its own S and M."""
    key_dim: int = 32
    """K: rows of S and M (the dimension Proteus unlocks in blocks)."""
    value_dim: int = 32
    """V: columns of S and M. With the defaults a user's resident state (S and M of every
    layer and head in fp32, the window, the read-out) is 34,064 bytes."""
    momentum: bool = True
    """True: the Titans rule with momentum eta (default). False: eta = 0, the gated delta rule."""
    n_blocks: int = 1
    """E: Proteus blocks along K. E = 1 (the default) is static capacity: every row open from
    the first event. E > 1 turns the Proteus schedule on (the paper uses E = 16 with N =
    256); it did not beat static across the dataset suite (reports/issue12/README.md), so it
    is available but off."""
    horizon: int = 256
    """N: schedule horizon in events; all E blocks are open past event N."""
    qk_l2norm: bool = True
    """L2-normalise the masked key and query (k~, q~) per head, after the Proteus mask."""
    theta_max: float = 1.0
    """Upper bound of the write rate theta = theta_max * sigmoid(.)."""
    backend: str = "auto"
    """Memory kernel outside training: auto, or a backend of models/memory/ops.py:
    reference | recurrent | chunk | chunk_aligned | triton | fla_chunk | fla_recurrent
    (fla_*: CUDA machines with flash-linear-attention; fla = fla_chunk). auto picks triton
    on CUDA and the recurrent or aligned chunked path on CPU."""
    train_backend: str = "auto"
    """Memory kernel of a training step: auto | chunk | triton | fla_chunk | recurrent |
    reference. auto (the default): triton on CUDA once it has matched chunk on a small check
    of the layer's sizes, chunk otherwise (and always on the CPU). chunk: the eager chunked
    form (the path the reports before 2026-12-02 trained with). triton: fused forward and
    backward kernels (both rules), checked against chunk on the GPU (measured:
    bench/results/train_h200_identity.json). fla_chunk: fla's
    chunk_kda with its backward (memory.momentum = false only). A fused path that fails
    logs one warning and the training goes on with chunk (models/memory/training.py)."""
    chunk_size: int = 16
    """Chunk length of the chunked (parallel) form used for training."""
    unlock: str = "uniform"
    """When Proteus opens the next key block (models/memory/schedule.py): uniform = every
    Delta = N // E events (the schedule above); surprise = after every Delta-th event, when
    the mean over those Delta events of the memory's surprise (its key-value loss on the
    event before the write, ||S^T k~ - v||^2 / ||v||^2) is at least ``unlock_threshold``
    times the user's running level (the mean of its interval means so far); drift = the
    same with interest drift (1 - cos of the event's item embedding with the sum of the
    previous W events'; needs a hybrid head's window); narrow = never (one block, K / E
    rows, stays open: the fixed-narrow-capacity control). surprise and drift keep per user
    and layer the unlock count and the signal's sums in the state. Static capacity is
    E = 1."""
    unlock_threshold: float = 1.0
    """Threshold of the surprise / drift unlock rule, relative to the user's running level
    of the signal: 1 = unlock when the last Delta events were at least as surprising (or
    drifting) as usual for the user; 0 = always (the uniform schedule); inf = never."""
    block_order: str = "prefix"
    """Which blocks open, in what order: prefix = 0, 1, 2, ...; reverse = E-1, E-2, ...
    (relabelled key rows: the same model in distribution, a seed-noise control); random =
    a random order per user, keyed on the user's first event. Orders other than prefix need
    key_dim divisible by n_blocks."""


@dataclass
class ModelConfig:
    """The recommender around the memory (SPEC section 4)."""

    embed_dim: int = 64
    """Width of item/action/time embeddings and of the layer residual stream."""
    n_oov_buckets: int = 64
    """Hashed out-of-vocabulary buckets for items unknown to the model."""
    n_time_buckets: int = 16
    """Buckets of log time gap since the user's previous event."""
    dropout: float = 0.2
    """Dropout on embeddings and layer outputs during training (0.2: chosen on the dataset
    suite's VALID, reports/suite/README.md)."""
    ffn_mult: int = 2
    """Feed-forward width multiplier in each layer (0 disables the feed-forward block)."""
    hybrid: str = "mac"
    """How the per-user memory is combined with attention over the user's latest ``window``
    events (Titans' hybrids; models/hybrid.py): none = the memory alone; mac = memory as
    context (the memory read-out is the attention's query and one of its tokens); mag =
    memory as gate (attention over the window from the latest event, mixed with the memory
    read-out by a learned gate)."""
    window: int = 32
    """W: events in the attention window (with a hybrid); kept per user with the state."""
    attn_heads: int = 2
    """Attention heads of the hybrid's window attention."""
    request_time: str = "gap_clock"
    """What the read-out knows of the request's time ("now"; offline, the target's own
    timestamp): none; gap = the time since the user's latest event (and, with a hybrid, the
    age of each window event); gap_clock = gap plus the hour of day and day of week (UTC)."""
    replay_fusion: str = "none"
    """How a NoteBank replay's memory read-out r is combined with the live one m
    (models/fusion.py): none = r replaces m (the rank path without a learned fusion); gate =
    m + a * sigmoid(W [m; r] + b) * (r - m); lowrank = m + B A [m; r] of rank
    ``replay_rank``. Both learned ones start as "no replay" and are trained by replay-aware
    training (``train.replay_steps``)."""
    replay_rank: int = 8
    """Rank of the ``lowrank`` replay fusion."""
    readout: str = "identity"
    """The last map from the read-out head to the user vector, which is scored against the
    tied item table: identity = none, the user vector is the head's normalised output
    (SASRec's form: input and output items share one space); linear = a learned D x D matrix
    (a bilinear score between the two, the default before; it overfits sparse catalogs).
    identity: ahead on every dataset of the suite's VALID (reports/suite/README.md)."""
    route_dim: int = 0
    """0: the NoteBank addresses notes with the masked queries q~ themselves (the archive's
    fixed coordinate selection P, ``archive.address_dim``); d > 0: with a learned projection
    of q~ per layer and head to d dimensions, trained by replay-aware training's routing loss
    (models/fusion.py RouteProjection)."""


@dataclass
class TrainConfig:
    """Training on the TRAIN part of the strict global time split."""

    epochs: int = 200
    """Cap on passes over the training users (a guard: early stopping, counted in
    validations, ends training)."""
    batch_size: int = 0
    """Users per optimisation step (SASRec: training windows of up to 200 events); 0 = from
    the dataset's size: the number of training users / BATCH_USERS_DIVISOR, clipped to
    [BATCH_MIN, BATCH_MAX] (models/train.py)."""
    segment_len: int = 200
    """Truncated back-propagation length: longer histories run in segments of this many
    events, the memory state carried (detached) between segments so positions stay exact."""
    lr: float = 1e-3
    """AdamW peak learning rate (reached after the warmup)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 100
    """Optimizer steps of linear learning-rate warmup from 0 to ``lr``."""
    lr_decay: float = 0.3
    """On a plateau (``decay_patience`` validations without a VALID improvement) the
    learning rate is multiplied by this."""
    decay_patience: int = 4
    """Validations without improvement before the learning rate decays (0 = never; 4: chosen
    on the dataset suite's VALID, reports/suite/README.md)."""
    loss: str = "full"
    """full: full-softmax cross-entropy over the catalog; sampled: sampled softmax."""
    loss_weight: str = "target"
    """How the memory model weighs its training targets across optimizer steps. target: each
    step's loss is its targets' sum over the epoch's mean number of targets per step, so
    every training target weighs the same; step (the default before 2026-12-02): each
    step's loss is the mean over its targets, so every step counts the same and a step over
    a batch of short histories (few targets) weighs each of its targets more. target was
    ahead on every dataset of the suite, paired on the same targets
    (reports/suite/README.md, "Loss weight"). SASRec's training does not read it."""
    n_negatives: int = 1024
    """Negatives per step for the sampled softmax."""
    patience: int = 6
    """Early stopping: validations without a VALID NDCG@10 improvement before stopping
    (counted in validations, so the same value fits datasets of any size)."""
    eval_every: int = 100
    """Validate every this many optimizer steps (and once at the end)."""
    seed: int = 0
    """Seed for weights, batching and sampling."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    max_seconds: float = 0.0
    """Stop training after this many seconds (0 = no limit); the best checkpoint is kept."""
    cuda_graphs: bool = True
    """On a CUDA device, run the memory model's training step at a fixed batch shape,
    captured once in a CUDA graph and replayed (models/train_step.py). The capture needs
    the fused training kernels (memory.train_backend auto or triton): the eager chunked
    form's backward reads values on the host (cumprod checks for zeros), and its capture
    fails and falls back to eager steps (measured: reports/suite/fast-train/). Not with the
    sampled loss, proteus_ffn_mask or an adaptive unlock schedule (memory.unlock surprise |
    drift); no effect on the CPU."""
    proteus_ffn_mask: bool = False
    """Paper section 2.4: apply the Proteus prefix mask (E = memory.n_blocks) to the
    feed-forward weight updates of the memory model, keyed on the optimizer step."""
    proteus_ffn_horizon: int = 2000
    """Optimizer steps after which every feed-forward block is open (with proteus_ffn_mask)."""
    replay_steps: int = 0
    """Replay-aware training (offline_eval/replay_training.py): after the base training,
    this many optimizer steps in which a share of each batch's targets is scored through a
    NoteBank replay (the archive as it stood before the target, routed by
    ``archive.routing``, replayed on a copy of the state, the read-outs combined by the
    model's ``model.replay_fusion``); 0 = off. Needs a replay fusion or a routing
    projection to train."""
    replay_share: float = 0.25
    """Share of each user's eligible targets (those after its first closed chunk) replayed
    in a replay-aware step."""
    replay_freeze: bool = True
    """Replay-aware training trains only the replay fusion and the routing projection; the
    base model keeps its weights (so replay off answers exactly as before). False: every
    weight trains on the replayed targets and, without replay, on the same targets. Measured
    (reports/issue12/README.md): False restarts the optimizer at ``train.lr`` on the trained
    base and cost 0.030 NDCG@10 on ML-1M and 0.038 on ML-100K in 200 steps, replay or not."""
