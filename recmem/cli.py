"""The ``recmem`` command: the composition root that wires models, streams, the engine and
offline_eval into subcommands. Each handler is thin; the work lives in the packages.

Every subcommand takes ``--config FILE`` and any number of ``--set section.field=value``;
``RECMEM__SECTION__FIELD`` environment variables apply in between (see recmem/config.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from recmem.config import Config, ConfigError, field_docs, load_config

log = logging.getLogger("recmem")

Handler = Callable[[argparse.Namespace, Config], int]


def _cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    if args.docs:
        for key, doc in field_docs().items():
            print(f"{key}: {doc}")
    else:
        print(cfg.to_toml())
    return 0


def _cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    from offline_eval.training import run_train

    if args.dataset:
        cfg.data.dataset = args.dataset
    metrics = run_train(cfg, Path(args.out))
    best = metrics.get("best_valid", {})
    print(
        f"trained on {cfg.data.dataset}: VALID "
        + ", ".join(f"{k}={v:.4f}" for k, v in best.items() if isinstance(v, float))
    )
    print(f"checkpoint and metrics.json in {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace, cfg: Config) -> int:
    from offline_eval.training import run_train

    out = Path(args.out)
    metrics = run_train(cfg, out)
    best = metrics.get("best_valid", {})
    print("\nrecmem demo: small memory model on MovieLens-100K (strict global time split)")
    for key in ("hr@10", "ndcg@10", "mrr@10", "hr@50"):
        if key in best:
            print(f"  VALID {key:8s} {best[key]:.4f}")
    print(f"  checkpoint: {out}")
    return 0


COMMANDS: dict[str, tuple[str, Handler]] = {
    "config": ("print the effective configuration (or --docs: every field explained)", _cmd_config),
    "train": ("train a memory model on the TRAIN part of the time split", _cmd_train),
    "demo": ("the main job on the embedded default (see README)", _cmd_demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recmem", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help="TOML configuration file")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.FIELD=VALUE",
            help="override one configuration field (repeatable)",
        )
        if name == "config":
            p.add_argument("--docs", action="store_true", help="list every field with its meaning")
        if name == "train":
            p.add_argument(
                "--dataset", help="ml-100k | ml-1m | synthetic | csv:PATH | parquet:PATH"
            )
            p.add_argument(
                "--out", required=True, help="output directory for checkpoint and metrics.json"
            )
        if name == "demo":
            p.add_argument(
                "--out", default="runs/demo-model", help="where the demo model is written"
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"recmem: configuration error: {e}", file=sys.stderr)
        return 2
    _, handler = COMMANDS[args.command]
    try:
        return handler(args, cfg)
    except KeyboardInterrupt:
        print("recmem: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"recmem {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
