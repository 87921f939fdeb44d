"""NoteBank replay, the model side: the learned fusion of the live and the replayed memory
read-out, and the learned routing projection (SPEC section 5, "may be combined with the
live one by a learned fusion"; "learned projections").

``ReplayFusion`` (``model.replay_fusion``) takes the live read-out m (the state's ``h``, or
the read-out after a request's context events) and the read-out r after the routed notes
were replayed on a copy of the state, and gives the read-out the head turns into the user
vector:

- ``gate``: m + a * sigmoid(W [m; r] + b) * (r - m), a per-dimension scale a that starts
  at 0;
- ``lowrank``: m + B A [m; r], a rank-``model.replay_rank`` adapter with B = 0 at the start
  (LoRA's initialisation).

Both start as "no replay": the output is m until training moves them. Without a fusion
(``none``) replay replaces the read-out by r, as the rank path always did.

``RouteProjection`` (``model.route_dim`` > 0) maps each channel's masked query q~ [K] to a
learned routing address [route_dim] (one matrix per layer and head), in place of the fixed
random coordinate selection P; it starts as a coordinate selection and learns from the
routing loss of replay-aware training (offline_eval/replay_training.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

FUSIONS = ("none", "gate", "lowrank")


def check_fusion_config(fusion: str, rank: int, route_dim: int, key_dim: int) -> None:
    """Reject replay settings of the model that cannot be built, naming the field."""
    if fusion not in FUSIONS:
        raise ValueError(f"model.replay_fusion {fusion!r} is not one of {'|'.join(FUSIONS)}")
    if fusion == "lowrank" and rank < 1:
        raise ValueError("model.replay_rank must be >= 1 with replay_fusion = lowrank")
    if route_dim < 0 or route_dim > key_dim:
        raise ValueError(f"model.route_dim must be in 0..memory.key_dim ({key_dim})")


class ReplayFusion(nn.Module):
    """The learned fusion of the live read-out m and the replayed one r, [.., D] each."""

    def __init__(self, mode: str, dim: int, rank: int) -> None:
        super().__init__()
        self.mode = mode
        if mode == "gate":
            self.gate = nn.Linear(2 * dim, dim)
            self.scale = nn.Parameter(torch.zeros(dim))
        elif mode == "lowrank":
            self.down = nn.Linear(2 * dim, rank, bias=False)
            self.up = nn.Linear(rank, dim, bias=False)
            nn.init.zeros_(self.up.weight)
        else:
            raise ValueError(f"unknown replay fusion {mode!r}")

    def forward(self, live: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
        both = torch.cat([live, replayed], dim=-1)
        if self.mode == "gate":
            g = torch.sigmoid(self.gate(both)) * self.scale
            return live + g * (replayed - live)
        return live + self.up(self.down(both))


class RouteProjection(nn.Module):
    """Per channel (layer, head) a learned map of q~ [K] to a routing address [d]."""

    def __init__(self, n_channels: int, key_dim: int, dim: int) -> None:
        super().__init__()
        # start as a fixed coordinate selection (the native addresses' kind of map)
        coords = np.sort(np.random.default_rng(0).choice(key_dim, size=dim, replace=False))
        w = torch.zeros(n_channels, dim, key_dim)
        w[:, torch.arange(dim), torch.as_tensor(coords)] = 1.0
        self.weight = nn.Parameter(w)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q~ [..., L, H, K] -> addresses [..., L, H, d]."""
        *lead, L, H, K = q.shape
        flat = q.reshape(*lead, L * H, K)
        out = torch.einsum("...ck,cdk->...cd", flat, self.weight.to(q.dtype))
        return out.reshape(*lead, L, H, -1)
