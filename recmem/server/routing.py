"""Routing of rank calls between the instances of a consumer group (docs/scaling.md).

Each call for one user is handled where the user's partition is owned (recmem/routing.py
says where): here, or, for a user owned by another instance, forwarded there in one gRPC
hop (``server.routing = forward``) or answered FAILED_PRECONDITION naming the owner
(``redirect``). A call that arrives forwarded is never forwarded again: if this instance's
map disagrees (the group is rebalancing) the caller gets the redirect. What cannot be
answered now (no assignment yet, a partition being restored or moving, an owner that does
not answer) gets UNAVAILABLE with a retry hint, never a cold start.

Trailing metadata: ``grpc-retry-pushback-ms`` (how long to wait before retrying; gRPC's
own retry policy reads it too), ``recmem-owner`` (host:port of the owner),
``recmem-partition`` and ``recmem-generation``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc

from proto.recmem.v1 import rank_pb2_grpc

FORWARDED = "recmem-forwarded"
"""Request metadata of a forwarded call (its value: the forwarding instance)."""
OWNER = "recmem-owner"
PARTITION = "recmem-partition"
GENERATION = "recmem-generation"
RETRY_PUSHBACK = "grpc-retry-pushback-ms"


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
        self._creds = (
            grpc.ssl_channel_credentials(Path(tls_cert).read_bytes()) if tls_cert else None
        )
        self._metadata: tuple[tuple[str, str], ...] = ((FORWARDED, me),)
        if auth_token:
            self._metadata += (("authorization", f"Bearer {auth_token}"),)
        self._stubs: dict[str, rank_pb2_grpc.RecMemStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> rank_pb2_grpc.RecMemStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                options = [("grpc.enable_retries", 0)]
                channel = (
                    grpc.secure_channel(address, self._creds, options=options)
                    if self._creds is not None
                    else grpc.insecure_channel(address, options=options)
                )
                self._channels[address] = channel
                stub = self._stubs[address] = rank_pb2_grpc.RecMemStub(channel)  # type: ignore[no-untyped-call]
            return stub

    def call(self, method: str, address: str, request: Any, timeout: float | None) -> Any:
        """Send ``request`` to ``address``'s ``method``; raises grpc.RpcError as received."""
        return getattr(self.stub(address), method)(
            request, timeout=timeout, metadata=self._metadata
        )

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


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
