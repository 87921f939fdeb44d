"""The front-end processes of ``server.frontends`` (recmem/server/frontend.py), seen from the
service: the public port they share, the private address of the engine process's server,
their start, supervision and stop.

The port is reserved here first: a TCP socket bound to ``server.host:server.port`` with
SO_REUSEPORT that never listens (so the kernel gives it no connections) holds the port, a
chosen one when ``server.port`` is 0, for as long as the service runs, so a front end that
is restarted binds the same port even when it was the last one listening. The engine's
server listens on a unix socket in a directory that only this user can read (mode 0700,
the socket 0600), removed at stop.

Front ends are separate interpreters started with ``python -m recmem.server.frontend``
(not multiprocessing's spawn, which would import the CLI's main module and with it torch
into every front end): the spec goes in on stdin, and stdin's end tells a front end that
the service is gone, so none outlives it. One that exits while the service runs is logged
and restarted, at most ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S`` (then the service
stops with an error: ``on_failure``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

from recmem.config import Config

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
"""A front end restarted more often than this within the window is given up on."""
READY_TIMEOUT_S = 60.0
"""How long a starting front end may take to listen."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, not listening: it holds the port
    (port 0: a free one, see ``getsockname``) for processes of this user that bind it with
    SO_REUSEPORT, and takes no connections itself."""
    name = host.strip("[]") or None
    family, kind, proto, _, address = socket.getaddrinfo(
        name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


class FrontEnds:
    """``server.frontends`` front-end processes on one public port, in front of the engine
    process's server at ``engine_address`` (bind that before ``start``)."""

    def __init__(
        self, cfg: Config, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        s = cfg.server
        if s.frontends < 1:
            raise ValueError("FrontEnds needs server.frontends >= 1")
        self.cfg = cfg
        self.count = s.frontends
        self._on_failure = on_failure
        self._reserved = reserve_port(s.host, s.port)
        self.port: int = self._reserved.getsockname()[1]
        self.run_dir = tempfile.mkdtemp(prefix="recmem-")  # mode 0700
        self.engine_socket = os.path.join(self.run_dir, "engine.sock")
        self.engine_address = f"unix:{self.engine_socket}"
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        """The front ends' Prometheus values (prometheus_client's multiprocess files), read by
        the service's metrics endpoint; a replaced front end's counts stay in the totals."""
        os.makedirs(self.metrics_dir)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self.restarts: list[collections.deque[float]] = [
            collections.deque() for _ in range(self.count)
        ]
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="frontends", daemon=True)

    def start(self) -> FrontEnds:
        """Start every front end and wait until each listens."""
        if os.path.exists(self.engine_socket):
            os.chmod(self.engine_socket, 0o600)
        starting = [self._spawn(i) for i in range(self.count)]
        for i, proc in enumerate(starting):
            self._await_ready(i, proc)
            self.procs[i] = proc
        log.info(
            "%d front-end processes on %s:%d (pids %s), engine at %s",
            self.count,
            self.cfg.server.host,
            self.port,
            ", ".join(str(p.pid) for p in starting),
            self.engine_address,
        )
        self._watcher.start()
        return self

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        proc = subprocess.Popen(
            [sys.executable, "-m", "recmem.server.frontend"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the service, which stops them
        )
        spec = {
            "index": index,
            "server": self.cfg.to_dict()["server"],
            "engine": self.engine_address,
            "port": self.port,
            "log_level": logging.getLogger().getEffectiveLevel(),
        }
        stdin = cast(IO[bytes], proc.stdin)
        stdin.write((json.dumps(spec) + "\n").encode())
        stdin.flush()
        return proc

    def _await_ready(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        stdout = cast(IO[bytes], proc.stdout)
        ready, _, _ = select.select([stdout], [], [], READY_TIMEOUT_S)
        line = stdout.readline() if ready else b""
        if not line.startswith(b"ready"):
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"front end {index} did not start (exit status {proc.returncode}; its log is above)"
            )

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                log.warning(
                    "front end %d (pid %d) exited with status %s: restarting it",
                    i,
                    proc.pid,
                    proc.returncode,
                )
                self._close_pipes(proc)
                try:
                    self._restart(i)
                except BaseException as e:  # noqa: BLE001 - the service stops with it
                    log.error("front end %d: %s; stopping the service", i, e)
                    self.procs[i] = None
                    if self._on_failure is not None:
                        self._on_failure(e)
                    return

    def _restart(self, index: int) -> None:
        times = self.restarts[index]
        now = time.monotonic()
        while times and now - times[0] > RESTART_WINDOW_S:
            times.popleft()
        if len(times) >= MAX_RESTARTS:
            raise RuntimeError(
                f"restarted {len(times)} times within {RESTART_WINDOW_S:.0f} s; giving up"
            )
        times.append(now)
        proc = self._spawn(index)
        self._await_ready(index, proc)
        self.procs[index] = proc
        log.info("front end %d restarted (pid %d)", index, proc.pid)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def stop(self, grace: float) -> None:
        """Each front end drains its callers and exits, within ``grace`` seconds (killed
        a few seconds after that); then the port and the run directory are given up."""
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join()
        live = [p for p in self.procs if p is not None]
        for proc in live:
            try:
                stdin = cast(IO[bytes], proc.stdin)
                stdin.write(f"stop {grace}\n".encode())
                stdin.close()
            except OSError:
                pass  # it is gone already
        for proc in live:
            try:
                proc.wait(timeout=grace + 5.0)
            except subprocess.TimeoutExpired:
                log.warning("front end (pid %d) did not stop in time: killed", proc.pid)
                proc.kill()
                proc.wait()
            self._close_pipes(proc)
        self.procs = [None] * self.count
        self._reserved.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[Any]) -> None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
