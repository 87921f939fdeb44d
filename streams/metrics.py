"""Prometheus metrics of the ingest path, on their own registry (several consumers, or a
consumer and the rank server, can live in one process without clashing).

The sink registers its own gauges here (users resident, bytes per user) with :meth:`gauge`,
so one endpoint shows the whole ingest path.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class IngestMetrics:
    """Counters, histograms and gauges of one consumer, optionally served over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "recmem_ingest"):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prefix = prefix
        r = self.registry
        self.events = Counter(f"{prefix}_events", "Valid events handed to the sink", registry=r)
        self.records = Counter(
            f"{prefix}_records", "Records consumed, valid or dead-lettered", registry=r
        )
        self.dead_letters = Counter(
            f"{prefix}_dead_letters",
            "Records sent to the dead-letter topic",
            ["reason"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            f"{prefix}_batch_seconds",
            "Time from poll return to the sink having applied the batch",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            f"{prefix}_checkpoint_seconds",
            "Time to write a checkpoint and commit its offsets",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.lag = Gauge(
            f"{prefix}_consumer_lag",
            "Records behind the partition's highwater (highwater - position)",
            ["partition"],
            registry=r,
        )
        self.assigned = Gauge(
            f"{prefix}_assigned_partitions", "Partitions assigned to this consumer", registry=r
        )
        self._server: Any = None
        self._thread: Thread | None = None

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """A gauge on this registry, named ``<prefix>_<name>`` (for the sink's figures)."""
        return Gauge(f"{self.prefix}_{name}", documentation, labelnames, registry=self.registry)

    def serve(self, port: int, host: str = "127.0.0.1", token: str = "") -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = no endpoint); returns the port. With a
        ``token`` every request must carry ``Authorization: Bearer <token>`` (401 otherwise);
        the endpoint is plain HTTP, so a token on a non-loopback address gets a warning."""
        if port <= 0 or self._server is not None:
            return self.port
        app: WsgiApp = make_wsgi_app(self.registry)
        if token:
            app = _require_bearer(app, token)
            if not _is_loopback(host):
                log.warning(
                    "the metrics endpoint on %s requires a bearer token but is plain HTTP: "
                    "the token crosses the network in clear text",
                    host,
                )
        server_class = type(
            "MetricsServer", (_ThreadingWSGIServer,), {"address_family": _family(host, port)}
        )
        self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        self._thread = Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape otherwise
        pass


def _family(host: str, port: int) -> socket.AddressFamily:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _require_bearer(app: WsgiApp, token: str) -> WsgiApp:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")  # WSGI's header coding
        if not hmac.compare_digest(got, expected):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="metrics"')],
            )
            return [b"missing or invalid bearer token\n"]
        return app(environ, start_response)

    return guarded
