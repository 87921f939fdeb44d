"""Train one model on a small dataset on the CPU and print every validation: the probe
behind the synthetic diagnostics of reports/suite/README.md ("The read-out", "Loss
weight"). Not a benchmark: one training, seed 0, with the default recipe unless told.

    .venv/bin/python bench/experiments/train_probe.py SECONDS memory|sasrec [DATASET] \\
        [section.field=value ...]

DATASET: ``small-synthetic`` (600 users, 60,000 events; the default) or a split file
(``split:PATH.npz``). Patches of the model for the diagnostics (environment variables, not
options of recmem): NOMEM=1 zeroes every memory layer's read (the layers keep their
residual and feed-forward paths); NOREADOUT=1 skips the read-out's last map (as
``model.readout=identity`` does now); EMBSCALE=1 scales the event embedding by sqrt(D)
instead of its LayerNorm; TOKW=N multiplies each step's mean loss by its targets / N.
Prints ``H step train-loss valid-ndcg valid-loss`` per validation.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import models.hybrid as hybrid  # noqa: E402
import models.recommender as recommender  # noqa: E402
import models.train as train  # noqa: E402
from offline_eval.training import prepare_split, train_on_split  # noqa: E402
from recmem.config import Config, set_value  # noqa: E402


def patch() -> None:
    if os.environ.get("NOMEM"):
        mix = recommender.MemoryLayer._mix
        recommender.MemoryLayer._mix = lambda self, x, y: mix(self, x, torch.zeros_like(y))
    if os.environ.get("NOREADOUT"):
        forward = hybrid.ReadHead.forward

        def no_readout(self, *a, **k):  # type: ignore[no-untyped-def]
            kept, self.readout = self.readout, torch.nn.Identity()
            try:
                return forward(self, *a, **k)
            finally:
                self.readout = kept

        hybrid.ReadHead.forward = no_readout
    if os.environ.get("EMBSCALE"):
        init = recommender.MemoryRecommender.__init__

        class Scale(torch.nn.Module):
            def __init__(self, d: int) -> None:
                super().__init__()
                self.f = d**0.5

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.f

        def scaled(self, *a, **k):  # type: ignore[no-untyped-def]
            init(self, *a, **k)
            self.embed_norm = Scale(self.embed_dim)

        recommender.MemoryRecommender.__init__ = scaled
    if os.environ.get("TOKW"):
        ref, loss = float(os.environ["TOKW"]), train.next_item_loss

        def weighted(user_vecs, targets, *a, **k):  # type: ignore[no-untyped-def]
            return loss(user_vecs, targets, *a, **k) * (targets.shape[0] / ref)

        train.next_item_loss = weighted


def main() -> None:
    seconds, kind = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:]
    data = ["data.dataset=synthetic", "data.synthetic_users=600", "data.synthetic_events=60000"]
    if rest and not rest[0].count("=") and rest[0] != "small-synthetic":
        data = [f"data.dataset={rest[0]}"]
    if rest and "=" not in rest[0]:
        rest = rest[1:]
    cfg = Config()
    for s in [*data, f"train.max_seconds={seconds}", "train.device=cpu", *rest]:
        key, value = s.split("=", 1)
        set_value(cfg, key, value, "cli")
    torch.set_num_threads(1)
    patch()
    _, result = train_on_split(prepare_split(cfg), cfg, kind)
    for h in result.history:
        v = h["valid"]
        print(f"H {h['step']} train {h['train_loss']:.3f} valid ndcg {v['ndcg@10']:.4f} "
              f"loss {v['loss']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
