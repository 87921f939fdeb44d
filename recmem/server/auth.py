"""Transport security of the rank service: optional TLS (server.tls_cert/tls_key) and an
optional bearer token (server.auth_token) checked by a server interceptor.

Health checking and reflection stay open without the token, so that load balancers and
tooling can probe the service; only the RecMem methods require it. ``AioBearerTokenInterceptor``
is the same check for a ``grpc.aio`` server (the asyncio front end).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

PROTECTED_PREFIX = "/recmem.v1.RecMem/"
"""Methods whose full name starts with this need the token."""


def _deny(message: str) -> grpc.RpcMethodHandler:
    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires metadata ``authorization: Bearer <token>`` on the RecMem methods."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("BearerTokenInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def refusal(self, handler_call_details: grpc.HandlerCallDetails) -> str | None:
        """Why the call is refused (None: it may go on)."""
        method = handler_call_details.method  # type: ignore[attr-defined]
        if not method.startswith(PROTECTED_PREFIX):
            return None
        metadata = handler_call_details.invocation_metadata or ()  # type: ignore[attr-defined]
        values = [v for k, v in metadata if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        got = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
        if not hmac.compare_digest(got, self._expected):
            return "invalid bearer token"
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        refused = self.refusal(handler_call_details)
        if refused is not None:
            return _deny(refused)
        return continuation(handler_call_details)


def _deny_async(message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class AioBearerTokenInterceptor(BearerTokenInterceptor, grpc.aio.ServerInterceptor):
    """``BearerTokenInterceptor`` for a ``grpc.aio`` server."""

    async def intercept_service(  # type: ignore[override]
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        refused = self.refusal(handler_call_details)
        if refused is not None:
            return _deny_async(refused)
        return await continuation(handler_call_details)  # type: ignore[no-any-return]


def server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; a clear ValueError when either is missing."""
    if not key_path:
        raise ValueError("server.tls_cert is set but server.tls_key is empty")
    paths = {"server.tls_cert": Path(cert_path), "server.tls_key": Path(key_path)}
    for name, p in paths.items():
        if not p.is_file():
            raise ValueError(f"{name}: file not found: {p}")
    return grpc.ssl_server_credentials(
        [(paths["server.tls_key"].read_bytes(), paths["server.tls_cert"].read_bytes())]
    )
