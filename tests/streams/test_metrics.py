from __future__ import annotations

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
