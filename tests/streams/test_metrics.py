from __future__ import annotations

import logging
import urllib.error
import urllib.request

import pytest

from streams.broker import free_port
from streams.metrics import IngestMetrics


def test_endpoint_serves_own_registry_and_sink_gauges():
    a, b = IngestMetrics(), IngestMetrics()  # two registries in one process do not clash
    a.events.inc(7)
    a.dead_letters.labels(reason="undecodable").inc()
    a.gauge("bytes_per_user", "bytes of one user's state").set(65_536)
    port = a.serve(free_port())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        a.close()
    assert "recmem_ingest_events_total 7.0" in text
    assert 'recmem_ingest_dead_letters_total{reason="undecodable"} 1.0' in text
    assert "recmem_ingest_bytes_per_user 65536.0" in text
    assert b.port == 0 and b.serve(0) == 0  # port 0: no endpoint
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def scrape(port: int, host: str = "127.0.0.1", token: str | None = None) -> int:
    req = urllib.request.Request(f"http://{host}:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            assert b"recmem_ingest_events_total" in r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_a_token_is_required_when_set(caplog: pytest.LogCaptureFixture) -> None:
    m = IngestMetrics()
    with caplog.at_level(logging.WARNING, logger="streams.metrics"):
        port = m.serve(free_port(), "127.0.0.1", token="m3trics")
    try:
        assert scrape(port) == 401
        assert scrape(port, token="wrong") == 401
        assert scrape(port, token="m3trics") == 200
    finally:
        m.close()
    assert not caplog.records  # on loopback: no warning


def test_a_token_on_a_public_address_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    m = IngestMetrics()
    with caplog.at_level(logging.WARNING, logger="streams.metrics"):
        port = m.serve(free_port(), "0.0.0.0", token="m3trics")
    try:
        assert scrape(port, token="m3trics") == 200
    finally:
        m.close()
    (record,) = caplog.records
    assert "clear text" in record.getMessage()
