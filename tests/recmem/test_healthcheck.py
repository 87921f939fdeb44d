"""The container health check (recmem/healthcheck.py) against a real rank server on
127.0.0.1: healthy when SERVING with a writable checkpoint directory, else the reasons."""

from __future__ import annotations

from pathlib import Path

import pytest

from recmem import healthcheck
from streams.broker import free_port
from tests.recmem.rank_env import RankEnv, loop_server, make_env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> RankEnv:
    return make_env(tmp_path_factory.mktemp("spill"), n_users=1)


def test_healthy_not_ready_and_unwritable(env: RankEnv, tmp_path: Path, request) -> None:
    cfg = env.cfg
    cfg.checkpoint.dir = str(tmp_path / "checkpoints")
    srv = loop_server(env, cfg).start(ready=False)
    cfg.server.port, cfg.server.host = srv.port, "0.0.0.0"  # probed on loopback
    try:
        (not_ready,) = healthcheck.problems(cfg)
        assert "NOT_SERVING" in not_ready
        srv.mark_ready()
        assert healthcheck.problems(cfg) == []
        (tmp_path / "blocked").write_text("a file where the directory should be")
        cfg.checkpoint.dir = str(tmp_path / "blocked")
        (unwritable,) = healthcheck.problems(cfg)
        assert "checkpoint.dir" in unwritable
        # an object store: healthy when a bucket takes an object, not when it is missing
        s3 = request.getfixturevalue("s3_server")
        cfg.checkpoint.dir = s3.bucket()
        cfg.checkpoint.s3_endpoint_url = s3.endpoint
        assert healthcheck.problems(cfg) == []
        cfg.checkpoint.dir = "s3://no-such-bucket-here/ckpt"
        (missing,) = healthcheck.problems(cfg)
        assert "does not take an object" in missing
    finally:
        cfg.checkpoint.s3_endpoint_url = ""
        srv.stop(grace=0.5)
        cfg.server.port, cfg.server.host = 0, "127.0.0.1"


def test_main_exits_1_when_nothing_listens(tmp_path: Path, capsys) -> None:
    config = tmp_path / "recmem.toml"
    config.write_text(
        f'[server]\nport = {free_port()}\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n'
    )
    assert healthcheck.main(["--config", str(config), "--timeout-s", "1"]) == 1
    assert "unhealthy: gRPC health at 127.0.0.1:" in capsys.readouterr().err
