"""``python -m recmem.healthcheck --config FILE``: exit 0 when the rank service answers
SERVING on gRPC health checking and the checkpoint store takes an object (a directory takes
a file; an s3:// location a small object written, read back and removed), else 1 with the
reasons on stderr. The container health check of docker/docker-compose.yml; it reads the
same configuration as the service (host 0.0.0.0 or :: is probed on loopback). It imports
neither torch nor the server, so that a check every few seconds stays cheap."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.recmem.v1 import rank_pb2
from recmem.config import Config, load_config

SERVICE_NAME = rank_pb2.DESCRIPTOR.services_by_name["RecMem"].full_name

WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


def problems(cfg: Config, timeout_s: float = 3.0, tls_name: str = "") -> list[str]:
    """What is wrong with the running service of ``cfg`` (empty: healthy)."""
    found = []
    ck = cfg.checkpoint
    if ck.dir.startswith("s3://"):
        from recmem.blobstore import S3Settings, open_blobs, probe

        try:
            probe(open_blobs(ck.dir, S3Settings(ck.s3_endpoint_url, ck.s3_region)))
        except Exception as e:  # noqa: BLE001 - whatever the store says is the reason
            found.append(f"checkpoint.dir {ck.dir} does not take an object: {e}")
    else:
        path = Path(ck.dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".healthcheck-"):
                pass
        except OSError as e:
            found.append(f"checkpoint.dir {path} does not take a file: {e}")
    s = cfg.server
    target = f"{WILDCARDS.get(s.host, s.host)}:{s.port}"
    if s.tls_cert:
        creds = grpc.ssl_channel_credentials(Path(s.tls_cert).read_bytes())
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            found.append(f"gRPC health at {target} is {status}")
    except grpc.RpcError as e:
        found.append(f"gRPC health at {target}: {e.code().name} {e.details()}")
    finally:
        channel.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the service's TOML configuration")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="gRPC health deadline")
    parser.add_argument("--tls-name", default="", help="name the TLS certificate is valid for")
    args = parser.parse_args(argv)
    found = problems(load_config(args.config), args.timeout_s, args.tls_name)
    for line in found:
        print(f"unhealthy: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
