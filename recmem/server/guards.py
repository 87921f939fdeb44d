"""Server interceptors around the RecMem methods.

- ``DecodeGuard``: a payload that does not parse as the method's request (raw bytes, invalid
  UTF-8 in a string field) gets INVALID_ARGUMENT with the parser's message. gRPC's own
  deserializer failure answers INTERNAL and logs a traceback per call, which makes flooding
  the log cheap; here such calls log at most one line per ``log_every_s``, with a count.
- ``CallArrivals``: when the latest RecMem call arrived, so that a stopping server can keep
  answering until the calls stop coming (``RankServer.stop``).

``AioDecodeGuard`` and ``AioCallArrivals`` are the same for a ``grpc.aio`` server (the
asyncio front end, ``server.frontend_mode = "aio"``), whose handlers are coroutines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

RECMEM_PREFIX = "/recmem.v1.RecMem/"
"""Full method names of the RecMem service start with this."""
ARRIVAL_PREFIXES = (RECMEM_PREFIX, "/recmem.internal.v1.")
"""The calls a stopping server waits to stop coming: RecMem's, and the front ends' packed
calls to the engine process (recmem/server/packed.py)."""


class Undecodable:
    """What the tolerant deserializer hands the handler instead of a request message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeGuard(grpc.ServerInterceptor):
    """Turns undecodable RecMem requests into INVALID_ARGUMENT; ``on_reject(method)`` is
    called for each (e.g. a metrics counter)."""

    def __init__(
        self, on_reject: Callable[[str], None] | None = None, log_every_s: float = 10.0
    ) -> None:
        self._on_reject = on_reject
        self._log_every_s = log_every_s
        self._lock = threading.Lock()
        self._unlogged = 0
        self._logged_at = -float("inf")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.unary_unary is None or not method.startswith(RECMEM_PREFIX):
            return handler
        behaviour = handler.unary_unary

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                self._reject(method, request.error)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request payload does not parse: {request.error}",
                )
            return behaviour(request, context)

        return handler._replace(  # type: ignore[attr-defined, no-any-return]
            request_deserializer=_tolerant(handler.request_deserializer), unary_unary=guarded
        )

    def _reject(self, method: str, error: Exception) -> None:
        if self._on_reject is not None:
            self._on_reject(method)
        now = time.monotonic()
        with self._lock:
            self._unlogged += 1
            if now - self._logged_at < self._log_every_s:
                return
            count, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning(
            "%d undecodable request(s) answered INVALID_ARGUMENT (at most one line per %.0f s);"
            " the latest, %s: %s",
            count,
            self._log_every_s,
            method,
            error,
        )


def _tolerant(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``parse``, answering ``Undecodable`` instead of raising."""

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data) if parse is not None else data
        except Exception as e:  # noqa: BLE001 - whatever the parser raises, the call is bad
            return Undecodable(e)

    return tolerant


class AioDecodeGuard(DecodeGuard, grpc.aio.ServerInterceptor):
    """``DecodeGuard`` for a ``grpc.aio`` server: the same answer from a coroutine."""

    async def intercept_service(  # type: ignore[override]
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.unary_unary is None or not method.startswith(RECMEM_PREFIX):
            return handler  # type: ignore[no-any-return]
        behaviour = handler.unary_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Undecodable):
                self._reject(method, request.error)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request payload does not parse: {request.error}",
                )
            return await behaviour(request, context)

        return handler._replace(  # type: ignore[no-any-return]
            request_deserializer=_tolerant(handler.request_deserializer), unary_unary=guarded
        )


class CallArrivals(grpc.ServerInterceptor):
    """Notes when the latest RecMem or packed call arrived (health checks and reflection do
    not count)."""

    def __init__(self) -> None:
        self.latest = -math.inf  # monotonic seconds

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(ARRIVAL_PREFIXES):  # type: ignore[attr-defined]
            self.latest = time.monotonic()
        return continuation(handler_call_details)

    def wait_quiet(self, quiet_s: float, deadline: float) -> bool:
        """Block until no call has arrived for ``quiet_s`` seconds (True) or the monotonic
        ``deadline`` passes (False)."""
        while True:
            now = time.monotonic()
            if now - self.latest >= quiet_s:
                return True
            if now >= deadline:
                return False
            time.sleep(min(self.latest + quiet_s, deadline) - now)


class AioCallArrivals(CallArrivals, grpc.aio.ServerInterceptor):
    """``CallArrivals`` for a ``grpc.aio`` server, with a waiting that does not block its
    event loop."""

    async def intercept_service(  # type: ignore[override]
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(ARRIVAL_PREFIXES):  # type: ignore[attr-defined]
            self.latest = time.monotonic()
        return await continuation(handler_call_details)  # type: ignore[no-any-return]

    async def wait_quiet_async(self, quiet_s: float, deadline: float) -> bool:
        """``wait_quiet`` on the event loop."""
        while True:
            now = time.monotonic()
            if now - self.latest >= quiet_s:
                return True
            if now >= deadline:
                return False
            await asyncio.sleep(min(self.latest + quiet_s, deadline) - now)
