"""The gRPC rank server: the RecMem servicer in front of the engine loop (which micro-batches
the requests), standard health checking and reflection, optional TLS and bearer token,
graceful stop."""

from __future__ import annotations

import gc
import logging
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.config import Config
from recmem.engine import EngineLoop
from recmem.server.auth import BearerTokenInterceptor, server_credentials
from recmem.server.guards import CallArrivals, DecodeGuard
from recmem.server.metrics import RankMetrics
from recmem.server.servicer import RecMemServicer, Router
from recmem.server.validation import Limits
from recmem.vocab import ItemVocab
from streams.validate import Limits as EventLimits

log = logging.getLogger(__name__)

SERVICE_NAME = rank_pb2.DESCRIPTOR.services_by_name["RecMem"].full_name
DRAIN_QUIET_S = 0.5
"""A stopping server closes its port once no RecMem call has arrived for this long."""


def limits_from_config(cfg: Config) -> Limits:
    s = cfg.server
    return Limits(
        max_k=s.max_k,
        max_candidates=s.max_candidates,
        max_context_events=s.max_context_events,
        max_batch_requests=s.max_batch_requests,
        max_replay_notes=s.max_replay_notes,
        default_replay_notes=cfg.archive.replay_notes,
        events=EventLimits.from_config(cfg.kafka),
    )


def advertised_address(configured: str, host: str, port: int) -> str:
    """``server.advertised_address``, else ``host:port`` with a wildcard host replaced by
    this machine's host name (what other machines can resolve)."""
    import socket

    if configured:
        return configured
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


def settle_heap() -> float:
    """Collect garbage once, then move every surviving object to the collector's permanent
    generation (``gc.freeze``): later collections only walk objects made after this, so
    none stalls a rank call for a pass over the whole long-lived heap. Returns seconds."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - began
    log.info("heap settled: %d objects frozen in %.2f s", gc.get_freeze_count(), took)
    return took


class RankServer:
    """Owns the grpc.Server and the health servicer, in front of an engine loop (started
    and stopped by its owner: the service stops it after the last checkpoint).

    ``start()`` binds ``server.host:server.port`` (port 0 picks a free port; see ``port``),
    ``stop(grace)`` reports NOT_SERVING, drains, then lets in-flight calls finish.
    """

    def __init__(
        self,
        cfg: Config,
        loop: EngineLoop,
        vocab: ItemVocab,
        model_version: str,
        metrics: RankMetrics | None = None,
        router: Router | None = None,
    ) -> None:
        if vocab.n_items != loop.ranker.n_items:
            raise ValueError(
                f"vocabulary has {vocab.n_items} items, the model {loop.ranker.n_items}"
            )
        s = cfg.server
        self.cfg = cfg
        self.loop = loop
        self.metrics = metrics if metrics is not None else RankMetrics()
        loop.add_batch_observer(self.metrics.batch_size.observe)
        self.arrivals = CallArrivals()
        guard = DecodeGuard(lambda method: self.metrics.undecodable.labels(method=method).inc())
        interceptors: list[grpc.ServerInterceptor] = [self.arrivals]
        if s.auth_token:
            interceptors.append(BearerTokenInterceptor(s.auth_token))
        interceptors.append(guard)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.threads, thread_name_prefix="grpc"),
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", s.max_message_bytes)],
        )
        servicer = RecMemServicer(
            loop,
            vocab,
            limits_from_config(cfg),
            model_version,
            timeout_s=s.request_timeout_s,
            metrics=self.metrics,
            router=router,
        )
        rank_pb2_grpc.add_RecMemServicer_to_server(servicer, self.server)  # type: ignore[no-untyped-call]
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        address = f"{s.host}:{s.port}"
        if s.tls_cert:
            self.port = self.server.add_secure_port(
                address, server_credentials(s.tls_cert, s.tls_key)
            )
        else:
            if s.tls_key:
                raise ValueError("server.tls_key is set but server.tls_cert is empty")
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise ValueError(f"cannot listen on {address}")
        self.tls = bool(s.tls_cert)
        self.address = advertised_address(s.advertised_address, s.host, self.port)
        """Where the other instances and clients reach this one."""

    def start(self, ready: bool = True) -> RankServer:
        """Start listening. ``ready=False`` reports NOT_SERVING until ``mark_ready()`` (the
        service calls it once its first partitions are restored, so a load balancer does
        not send traffic that would get cold-start answers for known users)."""
        self.server.start()
        if ready:
            self.mark_ready()
        else:
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info(
            "rank service on %s:%d (%s%s)",
            self.cfg.server.host,
            self.port,
            "TLS" if self.tls else "plaintext",
            ", bearer token" if self.cfg.server.auth_token else "",
        )
        if self.cfg.server.auth_token and not self.tls:
            log.warning(
                "server.auth_token is set but TLS is off: the bearer token crosses the network "
                "in clear text (set server.tls_cert and server.tls_key)"
            )
        return self

    def mark_ready(self) -> None:
        """Report SERVING (after settling the heap, ``server.freeze_gc``)."""
        if self.cfg.server.freeze_gc:
            settle_heap()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` passes (False)."""
        timed_out = self.server.wait_for_termination(timeout)
        return not timed_out

    def stop(self, grace: float | None = None) -> None:
        """Drain, then stop, within ``grace`` seconds (default ``server.shutdown_grace_s``):
        health turns NOT_SERVING at once; calls are answered as before until none has arrived
        for DRAIN_QUIET_S (clients and load balancers watching health go elsewhere); then the
        port closes and the calls still running get the rest of ``grace`` (at least its last
        second, or half of a shorter ``grace``) to finish. The engine loop is stopped by its
        owner."""
        grace = self.cfg.server.shutdown_grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        self.arrivals.wait_quiet(DRAIN_QUIET_S, deadline - min(1.0, grace / 2))
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        log.info("rank service stopped")
