"""The models ``recmem eval`` knows: name -> factory(split, cfg) -> (Scorer, train_seconds,
config). The config records the settings (and for trained models the training history) so the
report can show what was run; a memory model's config has ``"kind": "memory"`` (the paired
intervals compare every model against the best model that is not one).

- ``pop``: TRAIN popularity (offline_eval.baselines), deterministic, so run once per
  ``--seeds``;
- ``sasrec``: our SASRec (max length 200, full-catalog cross-entropy);
- ``memory-static``: the memory recommender with E = 1 (static capacity) whatever the
  configuration says;
- ``memory-proteus``: the memory recommender with the configured E and N (the default
  E = 1 is static capacity; ``memory-proteus[memory.n_blocks=16]`` turns Proteus on);
- ``memory-proteus-notebank``: the same training, evaluated with NoteBank replay
  (offline_eval.notebank_eval, which needs the serving packages: faiss, gRPC, Prometheus).

Trained models train on the split's TRAIN prefixes with early stopping on VALID NDCG@10.
A model whose modules cannot be imported here stays listed, as not available, with a reason
that names the missing package; the other models run.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any

from models.recommender import MemoryRecommender
from models.sasrec import SASRec
from models.train import TrainResult, pick_device, seed_everything
from offline_eval.baselines import make_pop
from offline_eval.evaluate import Scorer
from offline_eval.jobs import REPLAY_FIELDS, base_training_key, replay_training_key
from offline_eval.split import TimeSplit
from offline_eval.training import train_on_split
from recmem.config import Config
from recmem.modelstore import adopt_model_config, load_model

log = logging.getLogger(__name__)

ModelFactory = Callable[[TimeSplit, Config], tuple[Scorer, float, dict[str, Any]]]

DEFAULT_MODELS = (
    "pop",
    "sasrec",
    "memory-proteus",
    "memory-proteus[memory.n_blocks=16]",
    "memory-proteus-notebank",
)
"""What ``recmem eval`` trains without ``--models``: the baselines, the default memory model
(static capacity since E = 1 became the default), the same with the Proteus schedule on
(E = 16), and the default with NoteBank replay on its weights."""

PIP_NAMES = {
    "faiss": "faiss-cpu",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "google": "protobuf",
    "prometheus_client": "prometheus-client",
    "kafka": "kafka-python",
    "fla": "fla-core",
    "torchrec": "torchrec",
    "polars": "polars",
}
"""Top-level module -> the package that provides it, for the "not available" reason."""

_OWN_PACKAGES = ("recmem", "models", "offline_eval", "streams", "proto")


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    factory: ModelFactory | None
    seeded: bool = True
    """Its result depends on ``train.seed``: ``--seeds`` runs it once per seed."""
    reason: str = ""
    """Why it cannot run here; empty when it can."""


_MODELS: dict[str, RegisteredModel] = {}


def register_model(
    name: str, factory: ModelFactory, *, seeded: bool = True, needs: tuple[str, ...] = ()
) -> None:
    """Make ``name`` available to ``recmem eval --models``. ``needs``: modules the factory
    imports when it runs; if one cannot be imported here, the model is listed as not
    available with a reason naming the missing package."""
    for module in needs:
        try:
            importlib.import_module(module)
        except ImportError as e:
            register_unavailable(name, missing_package_reason(name, e), seeded=seeded)
            return
    _MODELS[name] = RegisteredModel(factory, seeded)


def register_unavailable(name: str, reason: str, *, seeded: bool = True) -> None:
    """Declare a model that is known but cannot run now; it is listed with ``reason``."""
    if name not in _MODELS or _MODELS[name].reason:
        _MODELS[name] = RegisteredModel(None, seeded, reason)
        log.info("model %s is not available: %s", name, reason)


def missing_package_reason(name: str, error: ImportError) -> str:
    """ "memory-proteus-notebank needs faiss (pip install faiss-cpu)" for a missing package;
    the error itself when the failing module is one of ours or unnamed."""
    missing = error.name or ""
    top = missing.partition(".")[0]
    if not top or top in _OWN_PACKAGES:
        return f"{name} cannot be imported: {error}"
    return f"{name} needs {missing} (pip install {PIP_NAMES.get(top, top)})"


def available_models() -> dict[str, str]:
    """name -> "" when runnable, else the reason it is not available."""
    return {name: m.reason for name, m in _MODELS.items()}


def model_factory(name: str) -> ModelFactory:
    m = _MODELS[name]
    if m.factory is None:
        raise ValueError(f"model {name} is not available: {m.reason}")
    return m.factory


def is_seeded(name: str) -> bool:
    """Whether ``name`` depends on ``train.seed`` (unknown names: True)."""
    m = _MODELS.get(name)
    return m.seeded if m is not None else True


def _describe(kind: str, cfg: Config, result: TrainResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": kind,
        "train": dataclasses.asdict(cfg.train),
        "model": dataclasses.asdict(cfg.model),
        "best_epoch": result.best_epoch,
        "best_step": result.best_step,
        "steps": result.steps,
        "best_valid": result.best_valid,
        "stopped": result.stopped,
        "valid_seconds": result.valid_seconds,
        "train_targets_per_s": result.targets_per_second(),
        "history": result.history,
    }
    if result.replay:
        out["replay_training"] = result.replay
    if kind == "memory":
        out["memory"] = dataclasses.asdict(cfg.memory)
    return out


def make_sasrec(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    model, result = train_on_split(split, cfg, "sasrec")
    info = _describe("sasrec", cfg, result)
    if isinstance(model, SASRec):
        info["sasrec"] = dataclasses.asdict(model.cfg)
    return model, result.train_seconds, info


def make_memory_static(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    cfg = copy.deepcopy(cfg)
    cfg.memory.n_blocks = 1
    model, result = train_on_split(split, cfg, "memory")
    return model, result.train_seconds, _describe("memory", cfg, result)


_last_memory: tuple[tuple[int, str], MemoryRecommender | SASRec, TrainResult] | None = None
"""The latest memory-proteus training (split id, training settings): memory-proteus and
memory-proteus-notebank of one ``recmem eval`` share it, so replay is compared on the same
weights (and trained once)."""

_last_base: tuple[tuple[int, str], MemoryRecommender, TrainResult] | None = None
"""The latest base training (split id, settings without the replay ones): replay variants
(fusions, routing projections, replay-aware training) of one worker start from it."""


def load_checkpoint_for_split(
    split: TimeSplit, cfg: Config
) -> tuple[MemoryRecommender, TrainResult]:
    """The memory model saved at ``cfg.eval.checkpoint`` (on the training device), after
    checking it was trained on ``split``; ``cfg`` takes its memory and model sections."""
    path = cfg.eval.checkpoint
    model, vocab, model_cfg, extra = load_model(path, pick_device(cfg.train.device))
    if not isinstance(model, MemoryRecommender):
        raise ValueError(f"eval.checkpoint {path}: a {type(model).__name__}, not a memory model")
    if vocab.to_dict() != split.vocab.to_dict():
        raise ValueError(
            f"eval.checkpoint {path}: its item vocabulary differs from the split's "
            f"({vocab.n_items} vs {split.n_items} items); evaluate it on the split it was "
            "trained on"
        )
    trained = extra.get("split", {})
    here = (split.boundary_valid_ts, split.boundary_test_ts)
    there = (trained.get("boundary_valid_ts"), trained.get("boundary_test_ts"))
    if there != here:
        raise ValueError(
            f"eval.checkpoint {path}: trained with split boundaries {there}, the split here has "
            f"{here}; its weights may have seen these TEST events"
        )
    adopt_model_config(cfg, model_cfg)
    result = TrainResult(stopped="checkpoint", train_seconds=0.0)
    log.info("evaluating the trained model at %s (version %s)", path, extra["model_version"])
    return model, result


def _train_memory_proteus(
    split: TimeSplit, cfg: Config
) -> tuple[MemoryRecommender | SASRec, TrainResult, bool]:
    """The memory model of ``cfg``: trained (or loaded from ``eval.checkpoint``) once per
    base setting, then given the replay modules and replay-aware training of ``cfg``
    (offline_eval/replay_training.py) on top of those weights; (model, result, whether this
    exact training was done before in this process)."""
    global _last_memory, _last_base
    key = (id(split), replay_training_key(cfg))
    if _last_memory is not None and _last_memory[0] == key:
        return _last_memory[1], _last_memory[2], True
    base_key = (id(split), base_training_key(cfg) + cfg.eval.checkpoint)
    if _last_base is not None and _last_base[0] == base_key:
        base, base_result = _last_base[1], _last_base[2]
    else:
        base_cfg = copy.deepcopy(cfg)
        for section, names in REPLAY_FIELDS.items():
            defaults = type(getattr(base_cfg, section))()
            for name in names:
                setattr(getattr(base_cfg, section), name, getattr(defaults, name))
        if cfg.eval.checkpoint:
            loaded, base_result = load_checkpoint_for_split(split, base_cfg)
            base = loaded
        else:
            trained, base_result = train_on_split(split, base_cfg, "memory")
            assert isinstance(trained, MemoryRecommender)
            base = trained
        _last_base = (base_key, base, base_result)
    if cfg.eval.checkpoint:
        # the checkpoint's memory and model sections become the configured ones (the
        # caller's copy), less the replay settings the spec asks for
        keep = {n: getattr(cfg.model, n) for n in REPLAY_FIELDS["model"]}
        backend = cfg.memory.backend
        cfg.memory, cfg.model = copy.deepcopy(base.mem_cfg), copy.deepcopy(base.model_cfg)
        cfg.memory.backend = backend
        for name, value in keep.items():
            setattr(cfg.model, name, value)
    model, result = base, base_result
    if any(
        getattr(getattr(cfg, s), n) != getattr(type(getattr(cfg, s))(), n)
        for s, names in REPLAY_FIELDS.items()
        for n in names
    ):
        model, result = _replay_variant(split, cfg, base, base_result)
    _last_memory = (key, model, result)
    return model, result, False


def _replay_variant(
    split: TimeSplit, cfg: Config, base: MemoryRecommender, base_result: TrainResult
) -> tuple[MemoryRecommender, TrainResult]:
    """``base``'s weights in a model built with ``cfg``'s replay modules, after its
    replay-aware training."""
    from offline_eval.replay_training import train_replay

    device = next(base.parameters()).device
    seed_everything(cfg.train.seed)
    model = MemoryRecommender(split.n_items, split.vocab.n_oov, cfg.memory, cfg.model).to(device)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    new = ("fusion.", "route_proj.")
    if unexpected or any(not k.startswith(new) for k in missing):
        raise ValueError(f"replay variant: weights do not fit ({missing}, {unexpected})")
    model.eval()
    result = copy.deepcopy(base_result)
    if cfg.train.replay_steps > 0:
        replay = train_replay(
            model, split.seqs, split.train_prefix_lengths(), cfg, split.item_cat, device
        )
        result.replay = replay.as_dict()
        result.train_seconds += replay.seconds
    return model, result


def make_memory_proteus(split: TimeSplit, cfg: Config) -> tuple[Scorer, float, dict[str, Any]]:
    cfg = copy.deepcopy(cfg)  # a checkpoint's sections replace the configured ones
    model, result, shared = _train_memory_proteus(split, cfg)
    info = _describe("memory", cfg, result)
    info["reused_training"] = shared
    if cfg.eval.checkpoint:
        info["checkpoint"] = cfg.eval.checkpoint
    return model, result.train_seconds, info


def make_memory_proteus_notebank(
    split: TimeSplit, cfg: Config
) -> tuple[Scorer, float, dict[str, Any]]:
    from offline_eval.notebank_eval import NotebankScorer

    cfg = copy.deepcopy(cfg)
    model, result, shared = _train_memory_proteus(split, cfg)
    assert isinstance(model, MemoryRecommender)
    scorer = NotebankScorer(model, cfg, split.vocab, item_categories=split.item_cat)
    info = _describe("memory", cfg, result)
    info["reused_training"] = shared
    if cfg.eval.checkpoint:
        info["checkpoint"] = cfg.eval.checkpoint
    info["notebank"] = scorer.describe()
    return scorer, result.train_seconds, info


register_model("pop", make_pop, seeded=False)
register_model("sasrec", make_sasrec)
register_model("memory-static", make_memory_static)
register_model("memory-proteus", make_memory_proteus)
register_model(
    "memory-proteus-notebank",
    make_memory_proteus_notebank,
    needs=("offline_eval.notebank_eval",),
)
