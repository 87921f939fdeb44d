"""Which instance owns a user: the user's partition (Kafka's default partitioner over the
user id, as the producer keyed the events, streams/partitioner.py) and that partition's
owner in the group's current generation (streams/group.py: every member learns the map
with each assignment). The rank service asks this before it ranks (recmem/server), the
client library the same question through the ``Routing`` call (recmem/client.py).

Like Kafka Streams' ``queryMetadataForKey``: a query for a key owned elsewhere is sent
there (or the caller is told where), never answered from an empty store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from streams.group import GroupView, Member
from streams.partitioner import partition_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Where one user's rank call belongs."""

    partition: int | None
    """The user's partition (None: the partition count is not known yet)."""
    owner: str | None
    """The owner's rank address (None: no owner now, or not known yet)."""
    local: bool
    """This instance owns the partition."""
    generation: int = -1


@dataclass(frozen=True)
class Ownership:
    """The partition -> owner address map of one generation."""

    generation: int = -1
    partitions: int = 0
    owners: dict[int, str] = field(default_factory=dict)


class OwnerMap:
    """The current :class:`Ownership`, replaced whole on each group view (any thread)."""

    def __init__(self, me: str) -> None:
        self.me = me
        """This instance's own rank address, as it publishes it to the group."""
        self._current = Ownership()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def update(self, view: GroupView) -> None:
        owners = {p: m.address for p, m in view.owners.items() if m.address}
        with self._changed:
            if view.generation < self._current.generation:
                return
            self._current = Ownership(view.generation, view.partitions, owners)
            self._changed.notify_all()

    @property
    def current(self) -> Ownership:
        return self._current

    def route(self, user_id: str) -> Route:
        own = self._current
        if own.partitions <= 0:
            return Route(None, None, False, own.generation)
        p = partition_for(user_id, own.partitions)
        owner = own.owners.get(p)
        return Route(p, owner, owner == self.me, own.generation)

    def owned_here(self) -> list[int]:
        own = self._current
        return sorted(p for p, a in own.owners.items() if a == self.me)

    def wait_for(self, generation: int, timeout: float) -> bool:
        """Block until a view of at least ``generation`` arrived (tests, tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._current.generation >= generation, timeout)


class ClaimStore(Protocol):
    """What :class:`ClaimedOwners` reads: a partition's newest claim (its ``owner`` and
    ``generation``; recmem/checkpoint/store.py's ``CheckpointStore.fence``)."""

    def fence(self, partition: int) -> Any: ...


CLAIMS_POLL_S = 0.5
"""How often :class:`ClaimedOwners` reads the other partitions' claims again."""


class ClaimedOwners:
    """The owner map of a member whose Kafka client cannot carry the group's member data
    (librdkafka, streams/confluent.py: its views hold this member's own partitions only,
    ``complete=False``). The other partitions' owners come from the checkpoint store: each
    owner claims a partition with its rank address before it restores it
    (recmem/checkpoint), so a partition's newest claim names the member that took it last.

    A claim is a hint, never a licence to answer: this member answers locally only for
    the partitions of its own assignment (a claim naming this member for a partition it
    does not hold is ignored: it held it before), and the member a call is forwarded to
    answers only for its own assignment too, else it redirects, which the forwarder turns
    into UNAVAILABLE with a retry hint. A stale claim (the owner lost the partition, the
    new owner has not claimed it yet, or the claimant is gone) therefore costs a retry,
    never a wrong answer. Claims are read again every ``poll_s`` and at each view."""

    def __init__(
        self,
        owners: OwnerMap,
        store: ClaimStore,
        partition_count: Callable[[], int],
        poll_s: float = CLAIMS_POLL_S,
    ) -> None:
        self.owners = owners
        self.store = store
        self._partition_count = partition_count
        self.poll_s = poll_s
        self._count = 0
        self._view: GroupView | None = None
        self._claims: dict[int, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claimed-owners", daemon=True)
        self._thread.start()

    def on_view(self, view: GroupView) -> None:
        """A view of the consumer (any thread): complete ones are used as they are."""
        if view.complete:
            self.owners.update(view)
            return
        with self._lock:
            self._view = view
            self._publish()
        self._wake.set()

    def _publish(self) -> None:
        """This member's own partitions plus the claims last read (under ``_lock``)."""
        view = self._view
        if view is None:
            return
        me = self.owners.me
        owners = dict(view.owners)
        for p, address in self._claims.items():
            if p not in owners and address != me and p < self._count:
                owners[p] = Member(address=address)
        self.owners.update(
            GroupView(
                generation=view.generation,
                partitions=view.partitions or self._count,
                owners=owners,
                tag=view.tag,
                complete=False,
            )
        )

    def refresh(self) -> None:
        """Read the claims of the partitions this member does not hold, and publish."""
        view = self._view
        if view is None:
            return
        if self._count <= 0:
            self._count = view.partitions or self._partition_count()
        claims: dict[int, str] = {}
        for p in range(self._count):
            if p in view.owners:
                continue
            try:
                fence = self.store.fence(p)
            except (OSError, ValueError) as e:
                log.debug("partition %d: claim unreadable (%s)", p, e)
                continue
            if fence.owner:
                claims[p] = str(fence.owner)
        with self._lock:
            self._claims = claims
            self._publish()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a hint source: the next round tries again
                log.warning("reading the partitions' claims failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
