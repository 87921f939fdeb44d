"""Quality vs resident bytes per user on ML-1M (issue 10 item 6): reads
reports/suite/recipe0/ml-1m/summary.json, writes bytes_curve.png and bytes_curve.json beside it.
Run: .venv/bin/python reports/suite/bytes_curve.py"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from models.config import MemoryConfig, ModelConfig  # noqa: E402
from recmem.state_store import StateLayout  # noqa: E402

HERE = Path(__file__).parent / "recipe0" / "ml-1m"
POINTS = {  # model label in summary.json -> memory overrides
    "memory-proteus[memory.n_heads=4;memory.key_dim=16;memory.value_dim=16]": (4, 16),
    "memory-proteus": (2, 32),
    "memory-proteus[memory.n_heads=4;memory.key_dim=64;memory.value_dim=64]": (4, 64),
}


def main() -> None:
    models = json.loads((HERE / "summary.json").read_text())["models"]
    rows = []
    for label, (heads, dim) in POINTS.items():
        mem = MemoryConfig(n_heads=heads, key_dim=dim, value_dim=dim)
        nbytes = StateLayout.from_config(mem, ModelConfig()).bytes_per_user()
        entry = models[label]
        rows.append(
            {
                "model": label,
                "bytes_per_user": nbytes,
                "ndcg@10": entry["overall"]["ndcg@10"],
                "long_term_ndcg@10": entry["long_term"]["ndcg@10"],
                "seeds": entry.get("seeds"),
                "stopped": entry.get("config", {}).get("stopped"),
            }
        )
    (HERE / "bytes_curve.json").write_text(json.dumps(rows, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [r["bytes_per_user"] / 1024 for r in rows]
    ax.plot(x, [r["ndcg@10"] for r in rows], "o-", label="overall")
    ax.plot(x, [r["long_term_ndcg@10"] for r in rows], "s--", label="LONG-TERM")
    ax.axvline(64, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ticks = [16, 32, 64, 128, 256]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.text(64, ax.get_ylim()[0], " 64 KiB goal", color="grey", va="bottom", fontsize=8)
    ax.set_xlabel("resident state per user (KiB, fp32)")
    ax.set_ylabel("TEST NDCG@10")
    ax.set_title("ML-1M: quality vs bytes per user")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "bytes_curve.png", dpi=120)


if __name__ == "__main__":
    main()
