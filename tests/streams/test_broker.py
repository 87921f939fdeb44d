from __future__ import annotations

import socket

import pytest

from streams.broker import EmbeddedBroker, free_port, tansu_binary, wait_for_port


def test_binary_is_cached_and_executable():
    path = tansu_binary()
    assert path.is_file()
    assert tansu_binary() == path


def test_start_stop_frees_the_port(tmp_path):
    log = tmp_path / "tansu.log"
    with EmbeddedBroker(log_path=log) as broker:
        assert broker.is_running()
        assert wait_for_port(broker.host, broker.port, 1.0)
        port = broker.port
    assert not broker.is_running()
    assert log.exists()
    assert not wait_for_port("127.0.0.1", port, 0.3)


def test_start_fails_clearly_when_the_port_is_taken():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        broker = EmbeddedBroker(port=port, start_timeout_s=3.0)
        with pytest.raises(RuntimeError, match="did not start"):
            broker.start()
        assert not broker.is_running()
