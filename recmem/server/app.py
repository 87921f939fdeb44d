"""The gRPC rank server: the RecMem servicer in front of the engine loop (which micro-batches
the requests), standard health checking and reflection, optional TLS and bearer token,
graceful stop.

``GrpcServer`` is the server around any RecMem servicer (the front-end processes of
``server.frontends`` build theirs with it, recmem/server/frontend.py); ``AioGrpcServer`` the
same on ``grpc.aio`` (the asyncio front end of ``server.frontend_mode = "aio"``);
``RankServer`` is the one around the engine loop. This module imports neither torch nor the
engine at import time, so that a front-end process stays light."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.recmem.v1 import rank_pb2, rank_pb2_grpc
from recmem.config import Config
from recmem.server.auth import (
    AioBearerTokenInterceptor,
    BearerTokenInterceptor,
    server_credentials,
)
from recmem.server.guards import AioCallArrivals, AioDecodeGuard, CallArrivals, DecodeGuard
from recmem.server.metrics import RankMetrics

if TYPE_CHECKING:
    from recmem.engine import EngineLoop
    from recmem.server.servicer import Router
    from recmem.server.validation import Limits
    from recmem.vocab import ItemVocab

log = logging.getLogger(__name__)

SERVICE_NAME = rank_pb2.DESCRIPTOR.services_by_name["RecMem"].full_name
DRAIN_QUIET_S = 0.5
"""A stopping server closes its port once no RecMem call has arrived for this long."""


def limits_from_config(cfg: Config) -> Limits:
    from recmem.server.validation import Limits
    from streams.validate import Limits as EventLimits

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


GRPC_THREADS = ("grpc_global_tim", "event_engine", "lifeguard")
"""Names (as /proc shows them, 15 characters at most) of the native threads gRPC's core runs
while it is initialised: its timer thread and its event engine's pool."""


def native_threads() -> list[str]:
    """The names of this process's threads, from /proc/self/task (empty where there is no
    /proc): native threads included, which ``threading.enumerate`` does not list."""
    import os

    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def release_grpc(timeout_s: float = 5.0) -> bool:
    """Let gRPC's core shut down now, on this thread, while the interpreter is whole: collect
    the gRPC objects nothing references any more, ``settle_heap``'s frozen ones included (a
    frozen cycle is never collected, so the server and channels of a stopped service would
    live on), then wait up to ``timeout_s`` for gRPC's native threads (``GRPC_THREADS``) to
    end. Call it once every gRPC server is stopped and every channel closed and dropped, at
    the end of a process.

    Without it gRPC stays initialised to the end, its native timer thread running on through
    the interpreter's finalisation and ``exit()``'s static destructors, one of the native
    threads suspected in the rare abort of ``recmem serve`` at exit (which recurred without
    it; see ``recmem.cli._end_process``). Returns whether no gRPC thread is left."""
    gc.unfreeze()
    gc.collect()
    deadline = time.monotonic() + timeout_s
    while any(name in GRPC_THREADS for name in native_threads()):
        if time.monotonic() > deadline:
            left = sorted(n for n in native_threads() if n in GRPC_THREADS)
            log.warning("gRPC threads still running at exit: %s", left)
            return False
        time.sleep(0.01)
    return True


def _options(cfg: Config, private: str, reuse_port: bool) -> list[tuple[str, int]]:
    options = [("grpc.max_receive_message_length", -1 if private else cfg.server.max_message_bytes)]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    return options


def _listen(server: Any, cfg: Config, private: str, port: int | None) -> int:
    """Bind ``server`` (a grpc.Server or grpc.aio.Server) as ``GrpcServer`` describes;
    returns the port it serves (with ``private``: the public one)."""
    s = cfg.server
    if private:
        if server.add_insecure_port(private) == 0:
            raise ValueError(f"cannot listen on {private}")
        return s.port if port is None else port
    address = f"{s.host}:{s.port if port is None else port}"
    if s.tls_cert:
        bound: int = server.add_secure_port(address, server_credentials(s.tls_cert, s.tls_key))
    else:
        if s.tls_key:
            raise ValueError("server.tls_key is set but server.tls_cert is empty")
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise ValueError(f"cannot listen on {address}")
    return bound


def _log_started(cfg: Config, port: int, tls: bool) -> None:
    log.info(
        "rank service on %s:%d (%s%s)",
        cfg.server.host,
        port,
        "TLS" if tls else "plaintext",
        ", bearer token" if cfg.server.auth_token else "",
    )
    if cfg.server.auth_token and not tls:
        log.warning(
            "server.auth_token is set but TLS is off: the bearer token crosses the network "
            "in clear text (set server.tls_cert and server.tls_key)"
        )


def _undecodable_counting(
    metrics: RankMetrics | None, undecodable: Callable[[str], None] | None
) -> tuple[RankMetrics | None, Callable[[str], None]]:
    """A server's metrics and what counts an undecodable call by method: ``undecodable``
    when given (a front end: its own counter, and no RankMetrics, whose values would land
    in the service's metrics beside the engine's under the same names), else the
    metrics' counter (``metrics``, or new ones)."""
    if undecodable is not None:
        return metrics, undecodable
    rank = metrics if metrics is not None else RankMetrics()
    return rank, lambda method: rank.undecodable.labels(method=method).inc()


class GrpcServer:
    """Owns a grpc.Server serving ``servicer`` (the RecMem API) with the health servicer,
    reflection and the interceptors (call arrivals, bearer token, undecodable payloads).

    Public (``private=""``): binds ``server.host:server.port`` (port 0 picks a free port;
    see ``port``; ``port`` given: that one instead) with TLS and the bearer token as
    configured; ``reuse_port`` lets several processes bind the same port (SO_REUSEPORT:
    the kernel spreads connections over them). Private (``private`` a gRPC address such as
    ``unix:/run/dir/engine.sock``): binds only that, without TLS or token (the caller keeps
    it private: a socket in a directory only this user reads), and accepts messages of any
    size (a front end's RankBatch carries many requests of up to ``server.max_message_bytes``).

    ``start()`` starts it, ``stop(grace)`` reports NOT_SERVING, drains, then lets in-flight
    calls finish.
    """

    def __init__(
        self,
        cfg: Config,
        servicer: rank_pb2_grpc.RecMemServicer,
        metrics: RankMetrics | None = None,
        *,
        private: str = "",
        port: int | None = None,
        reuse_port: bool = False,
        undecodable: Callable[[str], None] | None = None,
    ) -> None:
        s = cfg.server
        self.cfg = cfg
        self.metrics, count_undecodable = _undecodable_counting(metrics, undecodable)
        self.arrivals = CallArrivals()
        guard = DecodeGuard(count_undecodable)
        interceptors: list[grpc.ServerInterceptor] = [self.arrivals]
        if s.auth_token and not private:
            interceptors.append(BearerTokenInterceptor(s.auth_token))
        interceptors.append(guard)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.threads, thread_name_prefix="grpc"),
            interceptors=interceptors,
            options=_options(cfg, private, reuse_port),
        )
        rank_pb2_grpc.add_RecMemServicer_to_server(servicer, self.server)  # type: ignore[no-untyped-call]
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.private = private
        self.tls = bool(s.tls_cert) and not private
        self.port = _listen(self.server, cfg, private, port)
        self.address = advertised_address(s.advertised_address, s.host, self.port)
        """Where the other instances and clients reach this service (with ``private``: the
        public port the front ends serve)."""

    def start(self, ready: bool = True) -> GrpcServer:
        """Start listening. ``ready=False`` reports NOT_SERVING until ``mark_ready()`` (the
        service calls it once its first partitions are restored, so a load balancer does
        not send traffic that would get cold-start answers for known users)."""
        self.server.start()
        if ready:
            self.mark_ready()
        else:
            self.set_serving(False)
        if self.private:
            log.info("rank service on %s (private, for the front ends)", self.private)
            return self
        _log_started(self.cfg, self.port, self.tls)
        return self

    def mark_ready(self) -> None:
        """Report SERVING (after settling the heap, ``server.freeze_gc``)."""
        if self.cfg.server.freeze_gc:
            settle_heap()
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """Health of the service (``""`` and the RecMem service name) as reported."""
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            self.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` passes (False)."""
        timed_out = self.server.wait_for_termination(timeout)
        return not timed_out

    def stop(self, grace: float | None = None) -> None:
        """Drain, then stop, within ``grace`` seconds (default ``server.shutdown_grace_s``):
        health turns NOT_SERVING at once; calls are answered as before until none has arrived
        for DRAIN_QUIET_S (clients and load balancers watching health go elsewhere); then the
        port closes and the calls still running get the rest of ``grace`` (at least its last
        second, or half of a shorter ``grace``) to finish."""
        grace = self.cfg.server.shutdown_grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        self.arrivals.wait_quiet(DRAIN_QUIET_S, deadline - min(1.0, grace / 2))
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        log.info("rank service stopped")


class AioGrpcServer:
    """``GrpcServer`` on ``grpc.aio``, public only (the asyncio front end's): one event loop
    answers every call, the servicer's methods being coroutines. The same interceptors
    (their aio forms), health (grpc_health's asyncio servicer), reflection, TLS, bearer
    token, message size limit and ``reuse_port``; ``start``, ``set_serving`` and ``stop``
    (the same drain) are coroutines. Build it inside the running event loop."""

    def __init__(
        self,
        cfg: Config,
        servicer: rank_pb2_grpc.RecMemServicer,
        metrics: RankMetrics | None = None,
        *,
        port: int | None = None,
        reuse_port: bool = False,
        undecodable: Callable[[str], None] | None = None,
    ) -> None:
        from grpc_health.v1 import _async as health_async

        s = cfg.server
        self.cfg = cfg
        self.metrics, count_undecodable = _undecodable_counting(metrics, undecodable)
        self.arrivals = AioCallArrivals()
        guard = AioDecodeGuard(count_undecodable)
        interceptors: list[grpc.aio.ServerInterceptor] = [self.arrivals]
        if s.auth_token:
            interceptors.append(AioBearerTokenInterceptor(s.auth_token))
        interceptors.append(guard)
        self.server = grpc.aio.server(
            interceptors=interceptors, options=_options(cfg, "", reuse_port)
        )
        rank_pb2_grpc.add_RecMemServicer_to_server(servicer, self.server)  # type: ignore[no-untyped-call]
        self.health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.tls = bool(s.tls_cert)
        self.port = _listen(self.server, cfg, "", port)

    async def start(self, ready: bool = True) -> AioGrpcServer:
        """Start listening; ``ready``: as ``GrpcServer.start`` (no heap settling here)."""
        await self.server.start()
        await self.set_serving(ready)
        _log_started(self.cfg, self.port, self.tls)
        return self

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """``GrpcServer.stop``: NOT_SERVING at once, answer until no call has arrived for
        DRAIN_QUIET_S, then close the port and let running calls finish, within ``grace``."""
        grace = self.cfg.server.shutdown_grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        await self.health.enter_graceful_shutdown()
        await self.arrivals.wait_quiet_async(DRAIN_QUIET_S, deadline - min(1.0, grace / 2))
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        log.info("rank service stopped")


class RankServer(GrpcServer):
    """The server around the engine loop (started and stopped by its owner: the service
    stops it after the last checkpoint): a ``RecMemServicer`` over ``loop``, whose micro-batch
    sizes go to ``metrics``. ``private`` and ``port``: see ``GrpcServer`` (the service of
    ``server.frontends`` binds a private address and advertises the front ends' port)."""

    def __init__(
        self,
        cfg: Config,
        loop: EngineLoop,
        vocab: ItemVocab,
        model_version: str,
        metrics: RankMetrics | None = None,
        router: Router | None = None,
        *,
        private: str = "",
        port: int | None = None,
    ) -> None:
        from recmem.server.servicer import RecMemServicer

        if vocab.n_items != loop.ranker.n_items:
            raise ValueError(
                f"vocabulary has {vocab.n_items} items, the model {loop.ranker.n_items}"
            )
        s = cfg.server
        metrics = metrics if metrics is not None else RankMetrics()
        self.loop = loop
        loop.add_batch_observer(metrics.batch_size.observe)
        servicer = RecMemServicer(
            loop,
            vocab,
            limits_from_config(cfg),
            model_version,
            timeout_s=s.request_timeout_s,
            metrics=metrics,
            router=router,
        )
        super().__init__(cfg, servicer, metrics, private=private, port=port)
        if private:  # the front ends' packed path (recmem/server/packed.py)
            self.server.add_generic_rpc_handlers((servicer.packed_handler(),))
