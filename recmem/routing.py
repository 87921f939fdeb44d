"""Which instance owns a user: the user's partition (Kafka's default partitioner over the
user id, as the producer keyed the events, streams/partitioner.py) and that partition's
owner in the group's current generation (streams/group.py: every member learns the map
with each assignment). The rank service asks this before it ranks (recmem/server), the
client library the same question through the ``Routing`` call (recmem/client.py).

Like Kafka Streams' ``queryMetadataForKey``: a query for a key owned elsewhere is sent
there (or the caller is told where), never answered from an empty store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from streams.group import GroupView
from streams.partitioner import partition_for


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
