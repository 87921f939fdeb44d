"""A stopped ``recmem serve`` leaves no gRPC native thread to the interpreter's finalisation:
gRPC's core is shut down (its timer and event-engine threads ended) before ``run_serve``
returns, and the process exits 0. A member whose gRPC timer thread outlived ``main`` was
seen to abort at exit ("terminate called without an active exception", status 134; see
bench/experiments/README.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.server.app import GRPC_THREADS
from streams.broker import free_port

REPO = Path(__file__).resolve().parents[3]

# recmem's console script, with an exit hook (registered first: the last to run) that writes
# the names of the process's threads, native ones included, as the interpreter finalises
WRAPPER = textwrap.dedent(
    """
    import atexit, sys
    from recmem.server.app import native_threads

    out = sys.argv[1]

    def report() -> None:
        with open(out, "w") as f:
            f.write("\\n".join(native_threads()))

    atexit.register(report)
    sys.argv = ["recmem", *sys.argv[2:]]
    from recmem.cli import run

    run()
    """
)


def test_serve_shuts_grpc_down_before_the_interpreter_finalises(tmp_path: Path) -> None:
    port = free_port()
    threads_file = tmp_path / "threads.txt"
    cmd = [
        sys.executable, "-c", WRAPPER, str(threads_file),
        "serve", "--no-ingest", "--init-model",
        "--set", f"server.port={port}", "--set", "server.metrics_port=0",
        "--set", "server.shutdown_grace_s=1",
        "--set", f"server.model_dir={tmp_path / 'model'}",
        "--set", f"state.spill_dir={tmp_path / 'spill'}",
    ]  # fmt: skip
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
    left = [name for name in threads_file.read_text().split("\n") if name in GRPC_THREADS]
    assert not left, f"gRPC threads alive as the interpreter finalised: {left}"
