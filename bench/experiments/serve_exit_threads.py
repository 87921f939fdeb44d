"""The exit of ``recmem serve --no-ingest`` (a fresh model), per source tree: what native
threads are still alive as the interpreter finalises, the exit status, and whether the log
says "terminate called" (the rare abort of bench/experiments/frozen_member_exit_abort.json).

    PYTHONPATH=. .venv/bin/python bench/experiments/serve_exit_threads.py \\
        --root before=DIR --rounds 10 [--freeze 2] --json OUT.json

This tree (as ``new``) and each ``--root NAME=DIR`` (e.g. ``git archive`` of an older
commit) run in turn, the order alternating between rounds. A round: start the service
under an exit hook (registered first, so the last to run) that writes the names of the
process's threads from /proc (native ones included), wait until it reports SERVING, answer
one Rank call, optionally freeze it (SIGSTOP) for ``--freeze`` seconds and resume it, then
SIGTERM it. Core files are enabled (the child's cwd is its round's folder; the kernel's
core_pattern there is ``core``); a core found is read with gdb and its backtraces kept."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]

import grpc  # noqa: E402
from benchinfo import git_commit, machine_facts, write_result  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc  # noqa: E402
from streams.broker import free_port  # noqa: E402

WRAPPER = textwrap.dedent(
    """
    import atexit, os, sys
    out = sys.argv[1]

    def report() -> None:
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:
                pass
        with open(out, "w") as f:
            f.write("\\n".join(names))

    atexit.register(report)
    sys.argv = ["recmem", *sys.argv[2:]]
    from recmem.cli import run

    run()
    """
)


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _stacks(pid: int) -> str:
    """The Python stacks (py-spy, where PYSPY names it) and native backtraces (gdb) of a
    live process."""
    out = ""
    pyspy = os.environ.get("PYSPY")
    if pyspy:
        got = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        out += got.stdout[-15000:] + got.stderr[-2000:]
    got = subprocess.run(["gdb", "-q", "-batch", "-p", str(pid), "-ex", "thread apply all bt 25"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    return out + got.stdout[-30000:]


def one_round(root: str, work: Path, model_dir: Path, freeze_s: float) -> dict:
    work.mkdir(parents=True)
    port = free_port()
    threads_file = work / "threads.txt"
    cmd = [
        sys.executable, "-c", WRAPPER, str(threads_file),
        "serve", "--no-ingest", "--init-model",
        "--set", f"server.port={port}", "--set", "server.metrics_port=0",
        "--set", "server.shutdown_grace_s=1",
        "--set", f"server.model_dir={model_dir}",
        "--set", f"state.spill_dir={work / 'spill'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": root, "PYTHONFAULTHANDLER": "1"}
    log_path = work / "serve.log"
    error = ""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=log,
                                preexec_fn=_cores_on)  # fmt: skip
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=180)
                deadline = time.monotonic() + 60
                health = health_pb2_grpc.HealthStub(ch)
                serving = health_pb2.HealthCheckResponse.SERVING
                while health.Check(health_pb2.HealthCheckRequest(), timeout=30).status != serving:
                    assert time.monotonic() < deadline, "not SERVING"
                    time.sleep(0.05)
                stub = rank_pb2_grpc.RecMemStub(ch)
                stub.Rank(rank_pb2.RankRequest(user_id="u", k=3), timeout=30)
            if freeze_s > 0:
                proc.send_signal(signal.SIGSTOP)
                time.sleep(freeze_s)
                proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        except Exception as e:  # noqa: BLE001 - recorded; the round goes on
            error = repr(e)[-500:]
            if proc.poll() is None:  # where it is stuck, before it is killed
                error += "\n" + _stacks(proc.pid)
            proc.kill()
            rc = proc.wait()
    text = log_path.read_text(errors="replace")
    threads = threads_file.read_text().split("\n") if threads_file.exists() else None
    row = {"rc": rc, "terminate": "terminate called" in text, "error": error,
           "threads_at_exit": threads}  # fmt: skip
    cores = sorted(work.glob("core*"))
    if cores:
        bt = subprocess.run(
            ["gdb", "-q", "-batch", "-ex", "thread apply all bt 30", sys.executable, str(cores[0])],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        row["backtraces"] = bt.stdout[-20000:]
    if rc != 0:
        row["log_tail"] = text[-3000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--root-commit", action="append", default=[], help="NAME=SHA of a tree")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--freeze", type=float, default=0.0, help="seconds frozen before SIGTERM")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    roots = {"new": str(HERE.parents[2]), **dict(r.split("=", 1) for r in args.root)}
    commits = {"new": git_commit(), **dict(c.split("=", 1) for c in args.root_commit)}
    tmp = Path(tempfile.mkdtemp(prefix="serve-exit-"))
    rows = []
    names = list(roots)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            row = {"tree": name, "round": rnd,
                   **one_round(roots[name], tmp / f"{name}-{rnd}", tmp / f"model-{name}",
                               args.freeze)}  # fmt: skip
            rows.append(row)
            if args.json is not None:  # so far: a run cut short keeps its rounds
                args.json.write_text(json.dumps({"rounds": rows}, indent=1))
            print(json.dumps({k: v for k, v in row.items() if k != "backtraces"}), flush=True)
    grpc_names = ("grpc_global_tim", "event_engine", "lifeguard")
    summary = {
        name: {
            "rounds": sum(r["tree"] == name for r in rows),
            "exit_0": sum(r["tree"] == name and r["rc"] == 0 for r in rows),
            "aborts": sum(
                r["tree"] == name and (r["rc"] in (-6, 134) or r["terminate"]) for r in rows
            ),  # fmt: skip
            "grpc_thread_alive_at_exit": sum(
                r["tree"] == name and any(t in grpc_names for t in r["threads_at_exit"] or [])
                for r in rows
            ),
        }
        for name in names
    }
    result = {
        "benchmark": "serve_exit_threads",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "trees": {n: {"root": roots[n], "commit": commits.get(n, "")} for n in names},
        "machine": machine_facts(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {"rounds": args.rounds, "freeze_s": args.freeze},
        "summary": summary,
        "rounds": rows,
    }
    if args.json is not None:
        write_result(args.json, result)
    else:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
