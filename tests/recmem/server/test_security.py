"""The service's own security settings: the metrics endpoint listens on server.metrics_host
(not server.host) and takes an optional bearer token; a gRPC bearer token without TLS is
warned about once at start."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from recmem.server.serve import RecMemService
from streams.broker import free_port
from tests.recmem.rank_env import RankEnv, loop_server, make_env
from tests.recmem.test_server import self_signed


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"), n_users=1)


def status(url: str, token: str | None = None) -> int | str:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return "refused"


def test_metrics_follow_their_own_host_and_token(env: RankEnv, tmp_path: Path) -> None:
    from recmem.modelstore import save_model

    cfg = env.cfg
    cfg.server.model_dir = str(tmp_path / "model")
    save_model(cfg.server.model_dir, env.model, env.vocab, cfg, {"popularity": env.popularity})
    cfg.server.host = "127.0.0.1"
    cfg.server.metrics_host = "127.0.0.2"  # loopback too on Linux, but another address
    cfg.server.metrics_port = free_port()
    cfg.server.metrics_token = "scrape-me"
    svc = RecMemService(cfg, ingest=False, device="cpu").start()
    try:
        port = cfg.server.metrics_port
        assert status(f"http://127.0.0.1:{port}/metrics", "scrape-me") == "refused"
        url = f"http://127.0.0.2:{port}/metrics"
        assert status(url) == 401 and status(url, "nope") == 401
        assert status(url, "scrape-me") == 200
    finally:
        svc.stop(grace=0.5)
        cfg.server.metrics_host, cfg.server.metrics_token = "127.0.0.1", ""
        cfg.server.metrics_port = 0


def test_a_token_without_tls_is_warned_about_once(
    env: RankEnv, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def warnings_at_start() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="recmem.server.app"):
            srv = loop_server(env).start()
        srv.stop(grace=0.5)
        return [r.getMessage() for r in caplog.records if "clear text" in r.getMessage()]

    env.cfg.server.auth_token = "s3cret"
    try:
        assert len(warnings_at_start()) == 1
        cert, key = self_signed(tmp_path)
        env.cfg.server.tls_cert, env.cfg.server.tls_key = str(cert), str(key)
        assert warnings_at_start() == []
    finally:
        env.cfg.server.auth_token = env.cfg.server.tls_cert = env.cfg.server.tls_key = ""
    assert warnings_at_start() == []  # no token
