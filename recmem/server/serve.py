"""``recmem serve``: the engine loop with its two adapters in one process: the Kafka consumer
(recmem/ingest.py, as ``recmem ingest`` runs it) and the gRPC rank server. With
``server.frontends`` N >= 1 that server listens on a private unix socket only and N
front-end processes serve the public port (recmem/server/frontends.py).

A stop (SIGTERM, SIGINT, or ``RecMemService.stop``) reports NOT_SERVING and drains the
in-flight rank calls (the front ends' first, then the engine's server), then lets the
consumer finish its batch, checkpoint, commit and leave the group, then stops the engine
loop.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from functools import partial
from types import FrameType
from typing import Any

from recmem.config import Config
from recmem.engine.builder import BuiltEngine, build_engine
from recmem.ingest import KafkaIngest, register_gauges
from recmem.routing import ClaimedOwners, OwnerMap
from recmem.server.app import RankServer, release_grpc
from recmem.server.frontends import FrontEnds
from recmem.server.metrics import RankMetrics
from recmem.server.routing import Forwarder
from recmem.server.servicer import Router
from streams.admin import partition_count
from streams.group import Member
from streams.metrics import IngestMetrics

log = logging.getLogger(__name__)


SIGNAL_POLL_S = 0.5
"""How often ``run_serve``'s main thread wakes up to run the handlers of signals received."""


class RecMemService:
    """The whole service of ``recmem serve`` (``ingest=False``: the gRPC side only, on
    whatever the engine holds, e.g. nothing but cold starts). ``built``: an engine already
    built by ``build_engine`` (tests and benchmarks that fill it first), instead of the one
    of ``server.model_dir``; its loop is started here if it is not yet."""

    def __init__(
        self,
        cfg: Config,
        *,
        init_model: bool = False,
        ingest: bool = True,
        device: str | None = None,
        built: BuiltEngine | None = None,
    ) -> None:
        self.cfg = cfg
        if built is None:
            built = build_engine(cfg, device=device, init_model=init_model)
        elif not built.loop.alive:
            built.loop.start()
        self.built: BuiltEngine = built
        # one registry, one endpoint (server.metrics_port) for the rank and ingest figures
        self.metrics = IngestMetrics(prefix="recmem_ingest")
        # with ingest on, calls go where their user's partition is owned (docs/scaling.md)
        self.owners = OwnerMap(me="") if ingest else None
        router = Router(self.owners, None, cfg.server.retry_hint_ms) if self.owners else None
        self.failure: BaseException | None = None
        self._done = threading.Event()
        # server.frontends: the public port belongs to front-end processes, this server to them
        self.frontends = FrontEnds(cfg, self._fail) if cfg.server.frontends > 0 else None
        if self.frontends is not None:  # their recmem_frontend_* figures, on this endpoint
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(self.metrics.registry, path=self.frontends.metrics_dir)
        self.server = RankServer(
            cfg,
            self.built.loop,
            self.built.vocab,
            self.built.model_version,
            RankMetrics(self.metrics.registry),
            router=router,
            private=self.frontends.engine_address if self.frontends else "",
            port=self.frontends.port if self.frontends else None,
        )
        self.forwarder: Forwarder | None = None
        if self.owners is not None and router is not None:
            self.owners.me = self.server.address
            if cfg.server.routing == "forward":
                s = cfg.server
                self.forwarder = Forwarder(self.server.address, s.tls_cert, s.auth_token)
                router.forwarder = self.forwarder
        register_gauges(self.metrics, self.built.engine)
        self.consumer: Any = None
        self.ingest: KafkaIngest | None = None
        self._thread: threading.Thread | None = None
        self.claimed: ClaimedOwners | None = None
        if ingest:
            from streams.clients import make_consumer

            assert self.owners is not None
            kafka = dataclasses.replace(
                cfg.kafka,
                group_id=self.built.group_id,
                metrics_port=0,  # served below instead
            )
            on_view = self.owners.update
            if cfg.kafka.client == "confluent":
                # librdkafka carries no member data: the other partitions' owners are read
                # from their checkpoint claims (recmem/routing.py, docs/streams.md)
                self.claimed = ClaimedOwners(
                    self.owners, self.built.checkpoints(), partial(partition_count, kafka)
                )
                on_view = self.claimed.on_view
            self.ingest = KafkaIngest(
                self.built.loop,
                self.built.checkpoints(),
                cfg,
                on_ready=self.server.mark_ready,
                owner=self.server.address,
                on_view=on_view,
            )
            member = Member(address=self.server.address, tag=self.built.model_version)
            self.consumer = make_consumer(kafka, self.ingest, metrics=self.metrics, member=member)

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> RecMemService:
        # with ingest on, health says SERVING only once the first partitions are restored (or
        # the group gave this instance none: it answers by forwarding)
        self.server.start(ready=self.consumer is None)
        if self.frontends is not None:
            self.frontends.start()
        if self.cfg.server.metrics_port > 0:
            s = self.cfg.server
            self.metrics.serve(s.metrics_port, s.metrics_host, s.metrics_token)
        if self.consumer is not None:
            self._thread = threading.Thread(target=self._consume, name="ingest", daemon=True)
            self._thread.start()
        return self

    def _consume(self) -> None:
        try:
            self.consumer.run()
        except BaseException as e:  # noqa: BLE001 - reported by wait(); the process stops
            log.exception("ingest stopped with an error")
            self._fail(e)
        finally:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        """Stop the service with ``error`` (``wait`` returns; ``run_serve`` exits 1)."""
        self.failure = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the ingest thread ends (error) or ``stop``; True when it ended."""
        return self._done.wait(timeout)

    def stop(self, grace: float | None = None) -> None:
        grace = self.cfg.server.shutdown_grace_s if grace is None else grace
        if self.frontends is not None:
            # NOT_SERVING here shows in every front end's health; they drain their callers
            began = time.monotonic()
            self.server.set_serving(False)
            self.frontends.stop(grace)
            grace = max(grace - (time.monotonic() - began), 0.0)
        self.server.stop(grace)
        if self.consumer is not None:
            self.consumer.stop()
            if self._thread is not None:
                self._thread.join()
        if self.ingest is not None:
            self.ingest.close()
        if self.claimed is not None:
            self.claimed.close()
        if self.forwarder is not None:
            self.forwarder.close()
        self.built.close()
        self.metrics.close()
        self._done.set()


def run_serve(cfg: Config, *, init_model: bool = False, ingest: bool = True) -> int:
    """Run until SIGTERM/SIGINT (or an ingest error); returns the exit status."""
    service = RecMemService(cfg, init_model=init_model, ingest=ingest).start()
    stopping = service._done  # the handler holds the event only, not the service

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    log.info(
        "recmem serve: gRPC on %s:%d (advertised %s), ingest %s",
        cfg.server.host,
        service.port,
        service.server.address,
        f"from {cfg.kafka.topic} in group {service.built.group_id}" if ingest else "off",
    )
    # wake up now and then: Python runs a signal's handler on the main thread only, when that
    # thread next runs, and a SIGTERM the kernel gives another thread (as it may right after a
    # SIGCONT) does not interrupt a wait without a timeout (seen: a resumed member ignored it)
    while not service.wait(SIGNAL_POLL_S):
        pass
    service.stop()  # the last checkpoint and commit are written: nothing below touches data
    code = 1 if service.failure is not None else 0
    # drop the stopped service (its gRPC server and channels) and shut gRPC down before the
    # interpreter finalises: see release_grpc
    del service
    release_grpc()
    return code
