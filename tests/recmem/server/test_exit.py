"""The end of a ``recmem serve`` process. Once stopped, it shuts gRPC's core down (its timer
and event-engine threads ended) before ``run_serve`` returns, runs its exit hooks, and ends
without the interpreter's finalisation (``recmem.cli._end_process``), with status 0: a member
was seen to abort as the interpreter finalised ("terminate called without an active
exception", status 134; bench/experiments/README.md). And it stops on a SIGTERM whichever
of its threads the kernel gave it to."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.server.app import GRPC_THREADS
from streams.broker import free_port

REPO = Path(__file__).resolve().parents[3]

# recmem's console script, with an exit hook (registered first: the last to run) that writes
# the names of the process's threads, native ones included, and an object that leaves a file
# behind if the interpreter finalises its modules
WRAPPER = textwrap.dedent(
    """
    import atexit, sys
    from recmem.server.app import native_threads

    out = sys.argv[1]

    def report() -> None:
        with open(out, "w") as f:
            f.write("\\n".join(native_threads()))

    class Finalised:
        def __init__(self, path: str) -> None:
            self.path, self.open = path, open  # kept: module globals are gone by then

        def __del__(self) -> None:  # runs as the interpreter finalises its modules
            self.open(self.path, "w").close()

    witness = Finalised(out + ".finalised")
    atexit.register(report)
    sys.argv = ["recmem", *sys.argv[2:]]
    from recmem.cli import run

    run()
    """
)


def serve_args(port: int, tmp_path: Path) -> list[str]:
    """``recmem serve``'s arguments: no ingest, a fresh model, the port, a short grace."""
    return [
        "serve", "--no-ingest", "--init-model",
        "--set", f"server.port={port}", "--set", "server.metrics_port=0",
        "--set", "server.shutdown_grace_s=1",
        "--set", f"server.model_dir={tmp_path / 'model'}",
        "--set", f"state.spill_dir={tmp_path / 'spill'}",
    ]  # fmt: skip


def test_a_stopped_serve_ends_after_its_exit_hooks_without_finalising(tmp_path: Path) -> None:
    port = free_port()
    threads_file = tmp_path / "threads.txt"
    cmd = [sys.executable, "-c", WRAPPER, str(threads_file), *serve_args(port, tmp_path)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ.copy(), stdout=log, stderr=log)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=120)
                health = health_pb2_grpc.HealthStub(ch)
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == (
                    health_pb2.HealthCheckResponse.SERVING
                )
                stub = rank_pb2_grpc.RecMemStub(ch)
                reply = stub.Rank(rank_pb2.RankRequest(user_id="u", k=3), timeout=30)
                assert reply.model_version  # answered
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, log_path.read_text()[-3000:]
    assert "rank service stopped" in log_path.read_text()  # the log is complete
    # the process ended after its exit hooks but before the interpreter's finalisation, where
    # a library's native thread made it abort now and then (recmem.cli._end_process)
    assert not Path(f"{threads_file}.finalised").exists()
    left = [name for name in threads_file.read_text().split("\n") if name in GRPC_THREADS]
    assert not left, f"gRPC threads alive as the interpreter finalised: {left}"


TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


@pytest.mark.skipif(TGKILL is None or not Path("/proc/self/task").exists(), reason="Linux only")
def test_serve_stops_on_a_sigterm_another_thread_received(tmp_path: Path) -> None:
    """The kernel may give a process's SIGTERM to any of its threads (right after a SIGCONT it
    often does); the main thread still runs the handler, within ``SIGNAL_POLL_S``."""
    port = free_port()
    cmd = [sys.executable, "-m", "recmem.cli", *serve_args(port, tmp_path)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ.copy(), stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            # logged once the signal handlers are in place
            while "recmem serve: gRPC on" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, "did not start"
                time.sleep(0.1)
            others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.syscall(TGKILL, proc.pid, others[0], signal.SIGTERM) == 0
            rc = proc.wait(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, log_path.read_text()[-3000:]
