"""Which torchrec / fbgemm operations accept CUDA tensors with the CPU-only fbgemm build.

The GPU image has torch 2.11 and no torchrec; we carry torchrec 1.6.1 with fbgemm-gpu-cpu
1.6.0 (their CUDA fbgemm is ~470 MB). Users install the CUDA fbgemm matching their torch;
this records what our model's KJT path can and cannot do without it, and checks that
``kjt_available`` (models/embeddings.py) answers accordingly, so the model falls back to
the padded lookups with identical numbers.

    python3 bench/gpu_torchrec_probe.py --out DIR     # writes DIR/torchrec_probe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        out = fn()
        return {"ok": True, **({"value": out} if out is not None else {})}
    except Exception as e:  # noqa: BLE001 - record the failure, go on with the next probe
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                "where": traceback.format_exc().splitlines()[-3][:200]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"},
        "probes": {},
    }  # fmt: skip
    probes = res["probes"]
    probes["import torchrec"] = attempt(lambda: __import__("torchrec").__version__)
    probes["import fbgemm_gpu"] = attempt(lambda: __import__("fbgemm_gpu").__version__)
    if not probes["import torchrec"]["ok"]:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "torchrec_probe.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    import torchrec

    lengths = torch.tensor([2, 0, 3], device=dev)
    values = torch.tensor([1, 2, 0, 1, 2], device=dev)

    def kjt() -> Any:
        return torchrec.KeyedJaggedTensor(keys=["item"], values=values, lengths=lengths)

    probes["KeyedJaggedTensor(...)"] = attempt(lambda: str(kjt().values().device))
    probes["kjt.offsets()"] = attempt(lambda: kjt().offsets().tolist())
    probes["kjt.to_dict()"] = attempt(lambda: list(kjt().to_dict()))
    probes["kjt.permute"] = attempt(lambda: kjt().permute([0]).lengths().tolist())
    probes["jt.to_padded_dense()"] = attempt(
        lambda: kjt().to_dict()["item"].to_padded_dense().shape
    )
    probes["fbgemm.asynchronous_complete_cumsum"] = attempt(
        lambda: torch.ops.fbgemm.asynchronous_complete_cumsum(lengths).tolist()
    )

    def ec_forward() -> Any:
        cfg = torchrec.EmbeddingConfig(
            name="item", embedding_dim=4, num_embeddings=3, feature_names=["item"]
        )
        ec = torchrec.EmbeddingCollection(tables=[cfg], device=torch.device("cpu")).to(dev)
        return list(ec(kjt())["item"].values().shape)

    probes["EmbeddingCollection.forward"] = attempt(ec_forward)

    def model_paths() -> Any:
        from models.embeddings import EventEmbeddings, kjt_available

        emb = EventEmbeddings(50, 8, 16).to(dev)
        B, T = 6, 9
        g = torch.Generator().manual_seed(0)
        items = torch.randint(0, 50, (B, T), generator=g).to(dev)
        acts = torch.randint(0, 2, (B, T), generator=g).to(dev)
        gaps = torch.randint(0, 8, (B, T), generator=g).to(dev)
        lens = torch.tensor([9, 0, 3, 1, 7, 9], device=dev)
        ok = kjt_available(dev)
        a = emb(items, acts, gaps, lens, use_kjt=True)
        b = emb(items, acts, gaps, lens, use_kjt=False)
        return {"kjt_available": ok, "kjt_equals_padded": bool(torch.equal(a, b))}

    probes["recmem EventEmbeddings (KJT vs padded)"] = attempt(model_paths)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torchrec_probe.json").write_text(json.dumps(res, indent=1))
    for name, r in probes.items():
        print(f"{name:45s} {'ok' if r['ok'] else 'FAIL'}  {r.get('value', r.get('error', ''))}")


if __name__ == "__main__":
    main()
