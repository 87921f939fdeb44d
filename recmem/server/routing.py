"""Routing of rank calls between the instances of a consumer group (docs/scaling.md).

Each call for one user is handled where the user's partition is owned (recmem/routing.py
says where): here, or, for a user owned by another instance, forwarded there in one gRPC
hop (``server.routing = forward``) or answered FAILED_PRECONDITION naming the owner
(``redirect``). A call that arrives forwarded is never forwarded again: if this instance's
map disagrees (the group is rebalancing) the caller gets the redirect. What cannot be
answered now (no assignment yet, a partition being restored or moving, an owner that does
not answer) gets UNAVAILABLE with a retry hint, never a cold start.

Trailing metadata (named in recmem/client.py, which reads them): ``grpc-retry-pushback-ms``
(how long to wait before retrying; gRPC's own retry policy reads it too), ``recmem-owner``
(host:port of the owner), ``recmem-partition`` and ``recmem-generation``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from recmem.client import OWNER, PARTITION, RETRY_PUSHBACK, Stubs

FORWARDED = "recmem-forwarded"
"""Request metadata of a forwarded call (its value: the forwarding instance)."""


class RoutingFailure(Exception):
    """A call answered with a status instead of a response, and its trailing metadata."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


class Forwarder:
    """gRPC channels to the other instances (one per address, kept), with this service's
    own TLS trust (``server.tls_cert`` as the root: instances share a certificate or a CA)
    and bearer token."""

    def __init__(self, me: str, tls_cert: str = "", auth_token: str = "") -> None:
        self.me = me
        self._stubs = Stubs(
            grpc.ssl_channel_credentials(Path(tls_cert).read_bytes()) if tls_cert else None
        )
        self._metadata: tuple[tuple[str, str], ...] = ((FORWARDED, me),)
        if auth_token:
            self._metadata += (("authorization", f"Bearer {auth_token}"),)

    def call(self, method: str, address: str, request: Any, timeout: float | None) -> Any:
        """Send ``request`` to ``address``'s ``method``; raises grpc.RpcError as received."""
        return getattr(self._stubs.get(address), method)(
            request, timeout=timeout, metadata=self._metadata
        )

    def close(self) -> None:
        self._stubs.close()


def passthrough(e: grpc.RpcError, owner: str, partition: int, retry_ms: int) -> RoutingFailure:
    """The owner's error as this call's answer. A connection failure (the owner is gone)
    becomes UNAVAILABLE with a retry hint; so does a redirect from the hop (the two
    instances' maps disagree while the group rebalances: a plain client should retry
    here, not chase an owner that may be gone)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = e.details() if hasattr(e, "details") else str(e)  # type: ignore[attr-defined]
    trailing = tuple((m.key, m.value) for m in (e.trailing_metadata() or ()))  # type: ignore[attr-defined]
    keys = {k for k, _ in trailing}
    extra: tuple[tuple[str, str], ...] = ()
    if code == grpc.StatusCode.FAILED_PRECONDITION and OWNER in keys:
        code = grpc.StatusCode.UNAVAILABLE
        details = f"partition {partition} is moving between instances ({details}); retry shortly"
    if OWNER not in keys:
        extra += ((OWNER, owner), (PARTITION, str(partition)))
    if code == grpc.StatusCode.UNAVAILABLE and RETRY_PUSHBACK not in keys:
        extra += ((RETRY_PUSHBACK, str(retry_ms)),)
        if OWNER not in keys:
            details = f"the owner of partition {partition} ({owner}) did not answer: {details}"
    return RoutingFailure(code, details or code.name, trailing + extra)
