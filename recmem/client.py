"""``RankClient``: a Python client of the rank service that sends each call to the instance
owning the user (docs/scaling.md, Routing).

A user's events are keyed by the user id, so Kafka's default partitioner (murmur2 of the
UTF-8 id, streams/partitioner.py) decides the user's partition, and the consumer group
decides the partition's owner. The client asks any instance for the current map (the
``Routing`` call), computes the partition like the producer did and calls the owner
directly: no extra hop. When the map is out of date it follows the answers: a redirect
(FAILED_PRECONDITION naming ``recmem-owner``) goes to the named owner, UNAVAILABLE (a
partition being restored or moved, an owner that died) is retried after the server's hint
(``grpc-retry-pushback-ms``) until the call's deadline, through another instance when the
owner does not answer, and the map is fetched again.

    from recmem.client import RankClient

    with RankClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        res = client.rank("42", k=10, replay=True)
        print([i.item_id for i in res.items], res.position)

Imports grpc, the generated messages and the partitioner only (no torch, no Kafka client).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from proto.recmem.v1 import event_pb2, rank_pb2, rank_pb2_grpc
from streams.partitioner import partition_for

log = logging.getLogger(__name__)

OWNER = "recmem-owner"
PARTITION = "recmem-partition"
GENERATION = "recmem-generation"
RETRY_PUSHBACK = "grpc-retry-pushback-ms"
"""Trailing metadata of the routing answers (recmem/server/routing.py sends them)."""


class Stubs:
    """``RecMem`` stubs per address over channels kept open, with gRPC's own retries off
    (the caller decides what to retry); TLS when ``creds`` is given. Thread-safe."""

    def __init__(self, creds: grpc.ChannelCredentials | None = None) -> None:
        self._creds = creds
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Any] = {}

    def get(self, address: str) -> Any:
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

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


class RankClient:
    """Routes Rank and InspectUser by user id over the instances of one group.

    ``addresses``: some instances to start from (host:port; comma-separated or a list).
    ``deadline_s``: the longest a call (with its retries) takes unless the call says
    otherwise. ``token``: the bearer token (``server.auth_token``); ``tls_ca``: a PEM file
    to trust (TLS on). ``max_backoff_s`` caps the wait between retries."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        deadline_s: float = 10.0,
        token: str = "",
        tls_ca: str = "",
        max_backoff_s: float = 1.0,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise ValueError("RankClient needs at least one address")
        self.deadline_s = deadline_s
        self.max_backoff_s = max_backoff_s
        self._seeds = list(addresses)
        self._stubs = Stubs(
            grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        )
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._lock = threading.Lock()
        self._generation = -1
        self._partitions = 0
        self._owners: dict[int, str] = {}
        self._down: dict[str, float] = {}
        """Addresses that did not answer, and when (avoided for a while)."""
        self._spread = itertools.count()
        self.counts = {"calls": 0, "redirects": 0, "retries": 0, "refreshes": 0}

    # ---- public API --------------------------------------------------------------------

    def rank(
        self,
        user_id: str,
        k: int = 10,
        *,
        candidates: Iterable[str] = (),
        replay: bool = False,
        notes: int = 0,
        context: Iterable[event_pb2.Event] = (),
        request_ts_ms: int = 0,
        timeout: float | None = None,
    ) -> rank_pb2.RankResponse:
        """Top-k items for ``user_id`` from the instance that owns the user."""
        request = rank_pb2.RankRequest(
            user_id=user_id,
            candidate_item_ids=list(candidates),
            k=k,
            replay=rank_pb2.ReplayOptions(enabled=replay, notes=notes),
            context=list(context),
            request_ts_ms=request_ts_ms,
        )
        return self.call("Rank", request, timeout)  # type: ignore[no-any-return]

    def rank_batch(
        self,
        requests: Sequence[rank_pb2.RankRequest],
        timeout: float | None = None,
        *,
        per_call: int = 256,
    ) -> list[rank_pb2.RankBatchResult]:
        """Many requests at once: one RankBatch call per owning instance (at most
        ``per_call`` requests each, the server's default ``server.max_batch_requests``), a
        result per request in order. A request its instance did not own after all (a stale
        map) or could not serve yet is sent again alone through :meth:`call` (redirects,
        retries); any other failure stays in its result (``code``, ``message``)."""
        deadline = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        self.counts["calls"] += 1
        if self._partitions <= 0:
            self.refresh()
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self._route(r.user_id), []).append(i)
        results = [rank_pb2.RankBatchResult() for _ in requests]  # each filled below
        again: list[int] = []
        for address, idx in groups.items():
            for lo in range(0, len(idx), per_call):
                part = idx[lo : lo + per_call]
                batch = rank_pb2.RankBatchRequest(requests=[requests[i] for i in part])
                try:
                    got = self._stubs.get(address).RankBatch(
                        batch,
                        timeout=max(deadline - time.monotonic(), 0.001),
                        metadata=self._metadata,
                    )
                except grpc.RpcError as e:
                    if _code(e) != grpc.StatusCode.UNAVAILABLE:
                        raise
                    self._mark_down(address)
                    again += part
                    continue
                for i, res in zip(part, got.results):
                    if res.code in _RESEND:
                        again.append(i)
                    else:
                        results[i] = res
        for i in sorted(again):
            try:
                resp = self.call("Rank", requests[i], max(deadline - time.monotonic(), 0.001))
                results[i] = rank_pb2.RankBatchResult(code=0, response=resp)
            except grpc.RpcError as e:
                results[i] = rank_pb2.RankBatchResult(
                    code=_code(e).value[0], message=e.details() if hasattr(e, "details") else ""
                )
        return results

    def inspect(self, user_id: str, timeout: float | None = None) -> rank_pb2.InspectUserResponse:
        return self.call(  # type: ignore[no-any-return]
            "InspectUser", rank_pb2.InspectUserRequest(user_id=user_id), timeout
        )

    def owner_of(self, user_id: str) -> str | None:
        """The address the map says owns ``user_id`` (None: not known)."""
        with self._lock:
            if self._partitions <= 0:
                return None
            return self._owners.get(partition_for(user_id, self._partitions))

    def refresh(self, timeout: float = 2.0) -> bool:
        """Fetch the partition -> owner map from the first instance that answers; True
        when a map (of a generation at least as new) was installed."""
        self.counts["refreshes"] += 1
        for address in self._candidates():
            try:
                res = self._stubs.get(address).Routing(
                    rank_pb2.RoutingRequest(), timeout=timeout, metadata=self._metadata
                )
            except grpc.RpcError as e:
                if _code(e) == grpc.StatusCode.UNAVAILABLE:
                    self._mark_down(address)
                continue
            if res.partitions <= 0:
                continue
            with self._lock:
                if res.generation >= self._generation:
                    self._generation = int(res.generation)
                    self._partitions = int(res.partitions)
                    self._owners = {o.partition: o.address for o in res.owners}
            return True
        return False

    def close(self) -> None:
        self._stubs.close()

    def __enter__(self) -> RankClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- the routed call ---------------------------------------------------------------

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """``method`` (Rank or InspectUser) for ``request.user_id`` at its owner, following
        redirects and retrying UNAVAILABLE until the deadline; other errors raise."""
        deadline = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        self.counts["calls"] += 1
        if self._partitions <= 0:
            self.refresh()
        user_id = request.user_id
        target: str | None = None
        backoff = 0.05
        while True:
            address = target or self._route(user_id)
            target = None
            remaining = deadline - time.monotonic()
            try:
                return getattr(self._stubs.get(address), method)(
                    request, timeout=max(remaining, 0.001), metadata=self._metadata
                )
            except grpc.RpcError as e:
                code = _code(e)
                md = _trailing(e)
                remaining = deadline - time.monotonic()
                if code == grpc.StatusCode.FAILED_PRECONDITION and OWNER in md:
                    self.counts["redirects"] += 1
                    self._learn(md)
                    if md[OWNER] != address:
                        target = md[OWNER]
                        continue
                    raise  # an instance that names itself: not a routing answer
                if code != grpc.StatusCode.UNAVAILABLE or remaining <= 0:
                    raise
                self.counts["retries"] += 1
                if RETRY_PUSHBACK not in md:
                    # the instance itself did not answer: avoid it, ask another for the map
                    self._mark_down(address)
                    self.refresh(timeout=min(1.0, max(remaining, 0.01)))
                    wait = backoff
                    backoff = min(backoff * 2, self.max_backoff_s)
                else:
                    wait = int(md[RETRY_PUSHBACK]) / 1000
                    if int(md.get(GENERATION, "-1")) > self._generation or OWNER in md:
                        self.refresh(timeout=min(1.0, max(remaining, 0.01)))
                time.sleep(max(0.0, min(wait, self.max_backoff_s, deadline - time.monotonic())))

    def _route(self, user_id: str) -> str:
        with self._lock:
            owner = None
            if self._partitions > 0:
                owner = self._owners.get(partition_for(user_id, self._partitions))
            if owner is not None and not self._is_down(owner):
                return owner
        candidates = self._candidates()
        return candidates[next(self._spread) % len(candidates)]

    def _candidates(self) -> list[str]:
        """Every address known (seeds and owners), those that answered last first."""
        with self._lock:
            known = list(dict.fromkeys([*self._owners.values(), *self._seeds]))
            up = [a for a in known if not self._is_down(a)]
            return up + [a for a in known if a not in up]

    def _is_down(self, address: str) -> bool:
        since = self._down.get(address)
        return since is not None and time.monotonic() - since < 2.0

    def _mark_down(self, address: str) -> None:
        with self._lock:
            self._down[address] = time.monotonic()

    def _learn(self, md: dict[str, str]) -> None:
        with self._lock:
            if PARTITION in md and OWNER in md:
                self._owners[int(md[PARTITION])] = md[OWNER]
                self._down.pop(md[OWNER], None)


_RESEND = (
    grpc.StatusCode.FAILED_PRECONDITION.value[0],  # owned elsewhere: a stale map
    grpc.StatusCode.UNAVAILABLE.value[0],  # restoring or moving: retry after the hint
)


def _code(e: grpc.RpcError) -> grpc.StatusCode:
    return e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[no-any-return]


def _trailing(e: grpc.RpcError) -> dict[str, str]:
    md = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return {m.key: m.value for m in (md or ())}
