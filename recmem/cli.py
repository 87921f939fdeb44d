"""The ``recmem`` command: the composition root that wires models, streams, the engine and
offline_eval into subcommands. Each handler is thin; the work lives in the packages.

Every subcommand takes ``--config FILE`` and any number of ``--set section.field=value``;
``RECMEM__SECTION__FIELD`` environment variables apply in between (see recmem/config.py).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from recmem.config import Config, ConfigError, field_docs, load_config
from recmem.datasets import DATASET_SPECS, STREAM_SPECS

log = logging.getLogger("recmem")

Handler = Callable[[argparse.Namespace, Config], int]


def _cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    if args.docs:
        for key, doc in field_docs().items():
            print(f"{key}: {doc}")
    else:
        print(cfg.to_toml(redact_secrets=True))
    return 0


def _cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    from offline_eval.training import SPLIT_PREFIX, run_train

    if args.dataset:
        cfg.data.dataset = args.dataset
    if args.split:
        cfg.data.dataset = SPLIT_PREFIX + args.split
    metrics = run_train(cfg, Path(args.out), kind=args.model)
    best = metrics.get("best_valid", {})
    print(
        f"trained {args.model} on {metrics['dataset']}: VALID "
        + ", ".join(f"{k}={v:.4f}" for k, v in best.items() if k != "n")
    )
    print(f"checkpoint and metrics.json in {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace, cfg: Config) -> int:
    from offline_eval.training import apply_demo_preset, run_train
    from recmem.demo import format_demo, run_demo

    if not args.verbose:  # kafka-python logs every connection at INFO
        logging.getLogger("kafka").setLevel(logging.WARNING)
    apply_demo_preset(cfg)
    result = run_demo(cfg, Path(args.out), run_train, n_users=args.users, k=args.k)
    print(format_demo(result, cfg.data.dataset))
    print(f"\nmodel and metrics.json in {args.out}; processes and temporary files cleaned up")
    return 0


def _parse_seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--seeds: expected integers such as 0,1,2; got {text!r}") from e


def _cmd_eval(args: argparse.Namespace, cfg: Config) -> int:
    from offline_eval.results import available
    from offline_eval.runner import DEFAULT_MODELS, parse_models, run_eval

    dataset = args.dataset or cfg.data.dataset
    if args.prepare_split:
        from offline_eval.runner import prepare_split

        split_path = Path(args.prepare_split)
        prepared = prepare_split(cfg, dataset, split_path)
        print(f"{prepared.dataset}: {prepared.n_events} events, split saved to {split_path}")
        return 0
    if not args.out:
        raise ValueError("--out is required (or --prepare-split PATH)")
    if args.from_runs:
        from offline_eval.runner import report_from_runs

        if args.seeds:
            raise ValueError("--seeds trains models; --from-runs combines runs already made")
        picked = parse_models(args.models, check_known=False) if args.models else None
        runs = [Path(d) for d in args.from_runs.split(",") if d.strip()]
        summary = report_from_runs(cfg, runs, Path(args.out), picked)
    else:
        models = parse_models(args.models or ",".join(DEFAULT_MODELS))
        split = Path(args.split) if args.split else None
        seeds = _parse_seeds(args.seeds) if args.seeds else None
        summary = run_eval(
            cfg, dataset, models, Path(args.out), split_path=split, jobs=args.jobs, seeds=seeds
        )
    sp = summary["split"]
    print(f"{summary['dataset']}: {sp['n_test_targets']} TEST targets")
    for name, entry in summary["models"].items():
        o = entry["overall"]
        if not available(entry):
            print(f"  {name:26s} not available: {entry['config'].get('reason', '')}")
        else:
            seeds = entry.get("seeds", [])
            mean = f"  (mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""
            print(f"  {name:26s} NDCG@10 {o['ndcg@10']:.4f}  HR@10 {o['hr@10']:.4f}{mean}")
    print(f"summary.json and report.md in {args.out}")
    return 0


def _log_group_changes(args: argparse.Namespace) -> None:
    """A consumer group member logs its group's joins and rebalances at INFO (kafka-python's
    group coordinator: a few lines per rebalance; the rest of kafka stays quiet unless -v)."""
    if not args.verbose:
        logging.getLogger("kafka.coordinator").setLevel(logging.INFO)


def _cmd_ingest(args: argparse.Namespace, cfg: Config) -> int:
    from recmem.ingest import run_ingest

    _log_group_changes(args)
    built, totals = run_ingest(cfg, init_model=args.init_model)
    print(
        f"ingest stopped: {built.engine.totals.events} events applied in {totals.batches} "
        f"batches, {totals.checkpoints} checkpoints written"
    )
    return 0


def _cmd_produce(args: argparse.Namespace, cfg: Config) -> int:
    from recmem.event_columns import write_event_file
    from recmem.producing import open_stream, produce_stream

    if not args.verbose:  # kafka-python logs every connection at INFO
        logging.getLogger("kafka").setLevel(logging.WARNING)
    stream = open_stream(args.dataset, cfg)
    if args.write:
        n = write_event_file(Path(args.write), stream, limit=args.limit)
        print(f"wrote {n} events of {stream.name} to {args.write}")
        return 0
    if args.bootstrap:
        cfg.kafka.bootstrap_servers = args.bootstrap
    topic = args.topic or cfg.kafka.topic
    n = produce_stream(cfg, stream, topic, rate=args.rate, limit=args.limit)
    print(f"produced {n} events of {stream.name} to {topic} on {cfg.kafka.bootstrap_servers}")
    return 0


def _cmd_broker(args: argparse.Namespace, cfg: Config) -> int:
    import signal
    import threading

    from streams.admin import ensure_topics
    from streams.broker import EmbeddedBroker

    if not args.verbose:  # kafka-python logs every connection at INFO
        logging.getLogger("kafka").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    with EmbeddedBroker(port=args.port, host=args.host, bin_dir=cfg.kafka.broker_bin_dir) as b:
        if args.topics:
            cfg.kafka.bootstrap_servers = b.bootstrap
            ensure_topics(
                cfg.kafka, {cfg.kafka.topic: cfg.kafka.partitions, cfg.kafka.dead_letter_topic: 1}
            )
        print(f"tansu broker on {b.bootstrap} (in-memory storage; Ctrl-C stops it)", flush=True)
        while b.is_running() and not stop.wait(0.5):
            pass
        if not stop.is_set():
            b.stop(keep_log=True)
            print(f"recmem broker: the broker exited; see {b.log_path}", file=sys.stderr)
            return 1
    print("broker stopped")
    return 0


def _cmd_serve(args: argparse.Namespace, cfg: Config) -> int:
    from recmem.server.serve import run_serve

    global _end_without_finalising
    _log_group_changes(args)
    code = run_serve(cfg, init_model=args.init_model, ingest=not args.no_ingest)
    _end_without_finalising = True  # the service stopped: see _end_process
    return code


COMMANDS: dict[str, tuple[str, Handler]] = {
    "config": ("print the effective configuration (or --docs: every field explained)", _cmd_config),
    "train": ("train a memory model on the TRAIN part of the time split", _cmd_train),
    "eval": (
        "time-split offline evaluation of several models (summary.json, report.md)",
        _cmd_eval,
    ),
    "produce": (
        "stream a dataset or the benchmark workload into a Kafka topic in timestamp order",
        _cmd_produce,
    ),
    "broker": ("run the embedded Kafka-compatible broker (tansu) on loopback", _cmd_broker),
    "demo": ("the main job on the embedded default (see README)", _cmd_demo),
    "serve": ("consumer + engine + archive + gRPC rank service in one process", _cmd_serve),
    "ingest": ("consume the events topic into per-user memories (until SIGTERM)", _cmd_ingest),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recmem",
        description="recmem: streaming per-user recommender memory (train, eval, ingest, serve, demo).",
        epilog="Every subcommand takes --config FILE and --set section.field=value; see recmem config --docs.",
    )
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
            p.add_argument("--dataset", help=DATASET_SPECS)
            p.add_argument(
                "--out", required=True, help="output directory for checkpoint and metrics.json"
            )
            p.add_argument(
                "--split", help="a prepared split (.npz from recmem eval --prepare-split) to use"
            )
            p.add_argument(
                "--model", choices=("memory", "sasrec"), default="memory", help="what to train"
            )
        if name == "eval":
            p.add_argument(
                "--dataset",
                help=DATASET_SPECS,
            )
            p.add_argument(
                "--models",
                help="comma-separated model specs, each NAME or NAME[section.field=value;...] "
                "(default: pop,sasrec,memory-proteus,memory-proteus[memory.n_blocks=16],"
                "memory-proteus-notebank)",
            )
            p.add_argument(
                "--out",
                help="output directory (required): summary.json, report.md (with paired "
                "bootstrap intervals against the best baseline), by_position.json, "
                "ranks/*.npz (per-target ranks), plots",
            )
            p.add_argument("--split", help="a prepared split (.npz from TimeSplit.save) to use")
            p.add_argument(
                "--prepare-split",
                metavar="PATH",
                help="only build the split and save it at PATH (.npz + .json), then exit",
            )
            p.add_argument(
                "--seeds",
                metavar="S[,S...]",
                help="train every trained model once per seed (train.seed; pop runs once); "
                "the report gives mean and spread over seeds",
            )
            p.add_argument(
                "--jobs",
                type=int,
                help="trainings run at once in worker processes (models and seeds), spread "
                "over the GPUs (default: eval.jobs)",
            )
            p.add_argument(
                "--from-runs",
                metavar="DIR[,DIR...]",
                help="train nothing: combine earlier runs (same split; e.g. one per seed) into "
                "one report in --out, a model's runs with different seeds as its seeds (refused "
                "when they trained it with different settings); --models picks and orders "
                "the entries",
            )
        if name == "ingest":
            p.add_argument(
                "--init-model",
                action="store_true",
                help="if server.model_dir holds no model, save a freshly initialised one there",
            )
        if name == "serve":
            p.add_argument(
                "--init-model",
                action="store_true",
                help="if server.model_dir holds no model, save a freshly initialised one there",
            )
            p.add_argument(
                "--no-ingest", action="store_true", help="the gRPC side only (no Kafka consumer)"
            )
        if name == "produce":
            p.add_argument(
                "--dataset",
                required=True,
                help=f"{STREAM_SPECS}. workload: the benchmark workload, sized and shaped by "
                "the [workload] settings (--set workload.users=N, workload.events=N, "
                "workload.items=N, workload.user_zipf=S, workload.item_zipf=S, "
                "workload.mean_gap_ms=MS, workload.seed=N; recmem config --docs); "
                "npz:PATH: an events file written by --write",
            )
            p.add_argument(
                "--write",
                metavar="PATH",
                help="write the events to PATH (an events file, .npz; --limit applies) instead "
                "of producing them, then exit; produce it later with --dataset npz:PATH",
            )
            p.add_argument("--topic", help="target topic (default: kafka.topic)")
            p.add_argument("--bootstrap", help="HOST:PORT (default: kafka.bootstrap_servers)")
            p.add_argument("--rate", type=float, default=0.0, help="events per second (0 = max)")
            p.add_argument("--limit", type=int, default=0, help="send at most N events (0 = all)")
        if name == "broker":
            p.add_argument("--port", type=int, default=9092, help="listen port (default 9092)")
            p.add_argument("--host", default="127.0.0.1", help="listen address")
            p.add_argument(
                "--topics",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="create kafka.topic (kafka.partitions) and the dead-letter topic at start",
            )
        if name == "demo":
            p.add_argument(
                "--out", default="runs/demo-model", help="where the demo model is written"
            )
            p.add_argument("--users", type=int, default=3, help="users to rank for (1-3)")
            p.add_argument("--k", type=int, default=10, help="items per ranking")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Our own packages report progress at INFO; libraries (fbgemm, faiss, kafka) stay quiet
    # unless -v.
    for name in ("recmem", "streams", "models", "offline_eval"):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
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
    except Exception as e:
        from streams.dead_letters import DeadLetterError

        if isinstance(e, DeadLetterError):  # the message names the record and the topic
            print(f"recmem {args.command}: {e}", file=sys.stderr)
            return 3
        # an unreachable or misconfigured Kafka cluster is the user's to fix: say so plainly
        if type(e).__module__.startswith("kafka."):
            bootstrap = cfg.kafka.bootstrap_servers
            print(f"recmem {args.command}: Kafka at {bootstrap}: {e}", file=sys.stderr)
            return 3
        raise


_end_without_finalising = False
"""Set by ``recmem serve`` once its service has stopped: ``run`` then ends the process with
``_end_process``."""


def _end_process(code: int) -> NoReturn:
    """End the process with ``code`` without the interpreter's finalisation: run the exit
    hooks (``atexit``: logging's flush and close among them), flush stdout and stderr, then
    ``os._exit``.

    Why: a stopped ``recmem serve`` process now and then aborted while the interpreter
    finalised ("terminate called without an active exception", status 134, about 1 round in
    10-30 of bench/experiments/freeze_exit.py), on a native thread of a library, after a
    clean stop (bench/experiments/README.md); shutting gRPC down first did not stop it. Only
    called once the service has stopped: its last checkpoint is written, its offsets
    committed and the group left, so nothing durable is left to do; no library's teardown
    runs after this, and no thread of one can race it."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing to write
            stream.flush()
    os._exit(code)


def run() -> None:
    """The console-script entry point: process-wide settings, then ``main``."""
    from models.memory.ops import flush_denormals

    flush_denormals()  # this process computes memories: flush denormal floats (see there)
    code = main()
    if _end_without_finalising:
        _end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
