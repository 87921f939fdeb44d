"""Event feature embeddings: item (+ hashed OOV buckets), action and time-gap bucket, summed.

The tables live in a torchrec ``EmbeddingCollection`` and are looked up on a
``KeyedJaggedTensor`` of per-user event lists (features item/action/gap). A padded path
does the same lookups with ``F.embedding`` on the same weight tensors and gives identical
numbers; it is used where the KJT path is not available (torchrec missing, or its jagged
ops lacking kernels for the device) and on the engine's hot path. ``kjt_available`` probes
the path once per device. On an H200 with torchrec 1.6.1 and the CPU-only fbgemm 1.6.0,
KJT construction, ``to_dict`` and ``EmbeddingCollection.forward`` ran on CUDA tensors and
equalled the padded path, while fbgemm's jagged kernels (``asynchronous_complete_cumsum``
behind ``KeyedJaggedTensor.offsets``, ``permute_2D_sparse_data``, ``jagged_to_padded_dense``)
had no CUDA kernels (bench/results/torchrec_probe_h200.json); a torchrec version whose
lookups need them falls back to the padded path through the probe. If torchrec cannot be imported, a plain module with the same attribute
layout holds the tables, so checkpoints load either way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.features import N_ACTIONS

log = logging.getLogger(__name__)

FEATURES = ("item", "action", "gap")
INIT_STD = 0.05

_KJT_OK: dict[str, bool] = {}


def _torchrec() -> Any | None:
    try:
        import torchrec
    except Exception:  # noqa: BLE001 - any import failure means "use the padded path"
        return None
    return torchrec


class _PlainCollection(nn.Module):
    """Stand-in for torchrec's EmbeddingCollection: same ``embeddings`` ModuleDict layout."""

    def __init__(self, sizes: dict[str, int], dim: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict({n: nn.Embedding(s, dim) for n, s in sizes.items()})


def _build_kjt(
    torchrec: Any, feats: list[torch.Tensor], valid: torch.Tensor, lengths: torch.Tensor
) -> Any:
    values = torch.cat([f[valid] for f in feats])
    return torchrec.KeyedJaggedTensor(
        keys=list(FEATURES),
        values=values,
        lengths=torch.cat([lengths] * len(feats)).to(torch.int64),
    )


class EventEmbeddings(nn.Module):
    """x[b, t] = E_item[item] + E_action[action] + E_gap[gap] ([B, T, D], zeros at padding)."""

    def __init__(self, n_item_rows: int, n_time_buckets: int, dim: int) -> None:
        super().__init__()
        sizes = {"item": n_item_rows, "action": N_ACTIONS, "gap": n_time_buckets}
        tr = _torchrec()
        if tr is not None:
            tables = [
                tr.EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=s, feature_names=[n])
                for n, s in sizes.items()
            ]
            self.ec: nn.Module = tr.EmbeddingCollection(tables=tables, device=torch.device("cpu"))
        else:
            self.ec = _PlainCollection(sizes, dim)
        with torch.no_grad():
            for name in FEATURES:
                self.table(name).normal_(0.0, INIT_STD)

    def table(self, name: str) -> torch.Tensor:
        tables: nn.ModuleDict = self.ec.embeddings  # type: ignore[assignment]
        weight = tables[name].weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def item_weight(self) -> torch.Tensor:
        """[n_items + n_oov, D] the item table (tied with the output scores)."""
        return self.table("item")

    def forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        gaps: torch.Tensor,
        lengths: torch.Tensor,
        use_kjt: bool = False,
    ) -> torch.Tensor:
        B, T = items.shape
        valid = torch.arange(T, device=items.device)[None, :] < lengths[:, None]
        feats = [items, actions, gaps]
        if use_kjt and kjt_available(items.device):
            tr = _torchrec()
            out = self.ec(_build_kjt(tr, feats, valid, lengths))
            flat = out["item"].values() + out["action"].values() + out["gap"].values()
            x = items.new_zeros((B, T, flat.shape[-1]), dtype=flat.dtype)
            x[valid] = flat
            return x
        x = F.embedding(items, self.table("item"))
        x = x + F.embedding(actions, self.table("action")) + F.embedding(gaps, self.table("gap"))
        return x * valid[..., None]


def kjt_available(device: torch.device) -> bool:
    """Whether torchrec's EmbeddingCollection/KJT lookups run on ``device`` (probed once)."""
    key = str(device)
    if key not in _KJT_OK:
        tr = _torchrec()
        ok = tr is not None
        if tr is not None:
            try:
                tables = [
                    tr.EmbeddingConfig(name=n, embedding_dim=2, num_embeddings=3, feature_names=[n])
                    for n in FEATURES
                ]
                ec = tr.EmbeddingCollection(tables=tables, device=torch.device("cpu")).to(device)
                idx = torch.tensor([[1, 2], [0, 0]], device=device)
                lengths = torch.tensor([2, 1], device=device)
                valid = torch.tensor([[True, True], [True, False]], device=device)
                ec(_build_kjt(tr, [idx, idx, idx], valid, lengths))
            except Exception as e:  # noqa: BLE001 - any failure means "not on this device"
                log.info("torchrec KJT path unavailable on %s (%s); using padded lookups", key, e)
                ok = False
        _KJT_OK[key] = ok
    return _KJT_OK[key]
