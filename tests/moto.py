"""An S3 emulator for tests and benchmarks: ``moto_server`` (PyPI moto[server]) as a child
process on a free loopback port, with dummy credentials, and a fresh bucket per use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType

from streams.broker import free_port, wait_for_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Set in this process's environment while a server runs (children inherit them)."""


class MotoServer:
    """``with MotoServer() as s3: s3.bucket()`` -> ``s3://bucket-.../``; ``endpoint`` for
    ``checkpoint.s3_endpoint_url``."""

    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1])
        self._saved: dict[str, str | None] = {}

    def start(self) -> MotoServer:
        for key, value in CREDENTIALS.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        binary = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        cmd = [binary] if binary else [sys.executable, "-m", "moto.server"]
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                [*cmd, "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if not wait_for_port("127.0.0.1", self.port, self.start_timeout_s):
            self.stop()
            raise RuntimeError(f"moto_server did not start; see {self._log}")
        time.sleep(0.1)
        return self

    def client(self):  # boto3 S3 client on this server
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def bucket(self, prefix: str = "ckpt") -> str:
        """A fresh bucket; returns ``s3://bucket/prefix``."""
        name = f"recmem-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}/{prefix}"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()
        self._log.unlink(missing_ok=True)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
