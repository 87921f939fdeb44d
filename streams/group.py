"""What the members of a consumer group tell each other, through Kafka's own group protocol.

Each member publishes a :class:`Member` (where it answers rank calls, and a compatibility
tag: the model version) in the user data of its group subscription. The leader, which sees
every member's subscription when it computes the assignment, hands every member the whole
result in the user data of its assignment: the topic's partition count and, per partition,
the member that owns it in this generation (:class:`GroupView`). So every member learns the
partition -> owner map exactly when ownership changes, with the generation it belongs to,
and nothing outside Kafka is needed to publish it (tansu, the embedded broker, cannot
describe groups, so the map must travel inside the protocol).

Members whose tag differs from the group's get no partitions and a view that says so
(``refused``): instances serving another model never share a group's partitions. The
group's tag is the one of the members that own the most partitions now (under the
cooperative protocol members report what they own), else the one most members carry, ties
going to the leader's own.

:class:`MemberAwareAssignor` wraps one of kafka-python's assignors whose own user data is
empty: ``cooperative-sticky`` (the default: a rebalance moves only the partitions that
must move, KIP-429), ``range`` or ``roundrobin`` (eager: every rebalance revokes every
partition of every member).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

log = logging.getLogger(__name__)

ASSIGNORS: dict[str, type[AbstractPartitionAssignor]] = {
    "cooperative-sticky": CooperativeStickyAssignor,
    "range": RangePartitionAssignor,
    "roundrobin": RoundRobinPartitionAssignor,
}
"""``kafka.assignor`` choices (kafka-python's eager ``sticky`` is left out: it keeps its own
state in the user data this module uses)."""

_FORMAT = 1


@dataclass(frozen=True)
class Member:
    """What one member publishes to its group."""

    address: str = ""
    """Where it answers rank calls (host:port; "" when it serves none)."""
    tag: str = ""
    """Compatibility tag (the model version): members with another tag get no partitions."""

    def encode(self) -> bytes:
        return json.dumps({"v": _FORMAT, "address": self.address, "tag": self.tag}).encode()

    @classmethod
    def decode(cls, data: Any) -> Member:
        """A member's published data; an empty Member when there is none or it does not
        parse (a member that is not recmem, or another format)."""
        if not isinstance(data, bytes | bytearray) or not data:
            return cls()
        try:
            raw = json.loads(bytes(data))
            return cls(str(raw.get("address", "")), str(raw.get("tag", "")))
        except (ValueError, AttributeError):
            return cls()


@dataclass(frozen=True)
class GroupView:
    """The group at one generation, as its leader assigned it."""

    generation: int
    partitions: int
    """Partitions of the topic (0: unknown)."""
    owners: dict[int, Member] = field(default_factory=dict)
    """Partition -> its owner in this generation. A partition missing here has no owner
    now (under the cooperative protocol: moving between members until the next round)."""
    tag: str = ""
    """The group's compatibility tag."""
    refused: bool = False
    """This member got no partitions because its tag is not the group's."""
    members: int = 0
    """Members in this generation (refused ones included)."""
    complete: bool = True
    """False: ``owners`` holds only this member's own partitions (a client that cannot
    carry the member data, streams/confluent.py); the other partitions' owners are unknown."""
    leads: bool = False
    """This member led the generation (it computed the assignment)."""

    def owner(self, partition: int) -> Member | None:
        return self.owners.get(partition)


class MemberAwareAssignor(AbstractPartitionAssignor):
    """``base`` (an assignor without user data of its own) plus the member data and the
    group view of this module. ``on_view`` gets each member's :class:`GroupView` when its
    assignment arrives (on kafka-python's network thread: keep it short)."""

    def __init__(
        self,
        base: AbstractPartitionAssignor,
        me: Member,
        on_view: Callable[[GroupView], None] | None = None,
    ) -> None:
        self.base = base
        self.me = me
        self.on_view = on_view
        self.view: GroupView | None = None
        self._assigned = False
        """``assign`` ran in this join round (only the leader's runs): the round starts with
        ``metadata`` (the member's subscription) and ends with ``on_assignment``."""

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.base.name)

    @property
    def version(self) -> int:
        return int(getattr(self.base, "version", 0))

    def supported_protocols(self) -> list[Any]:
        return list(self.base.supported_protocols())

    def metadata(self, topics: Any) -> Any:
        self._assigned = False
        sub = self.base.metadata(topics)
        if sub.user_data:
            raise ValueError(f"assignor {self.base.name} uses the user data itself")
        sub.user_data = self.me.encode()
        return sub

    def assign(self, cluster: Any, members: list[Any]) -> dict[str, Any]:
        self._assigned = True
        infos = {m.member_id: Member.decode(m.metadata.user_data) for m in members}
        tag = self._group_tag(members, infos)
        eligible = [m for m in members if infos[m.member_id].tag == tag]
        refused = [m.member_id for m in members if infos[m.member_id].tag != tag]
        for mid in refused:
            log.error(
                "group member %s (%s) carries tag %r, the group %r: it gets no partitions",
                mid, infos[mid].address, infos[mid].tag, tag,
            )  # fmt: skip
        out = dict(self.base.assign(cluster, eligible)) if eligible else {}
        topics = sorted({t for m in members for t in m.metadata.topics})
        n_partitions = len(cluster.partitions_for_topic(topics[0]) or ()) if topics else 0
        order = sorted(infos)
        index = {mid: i for i, mid in enumerate(order)}
        owners: dict[str, int] = {}
        for mid, assignment in out.items():
            for _topic, parts in assignment.assigned_partitions:
                for p in parts:
                    owners[str(p)] = index[mid]
        shared = {
            "v": _FORMAT,
            "partitions": n_partitions,
            "tag": tag,
            "members": [{"address": infos[m].address, "tag": infos[m].tag} for m in order],
            "owners": owners,
        }
        result = {}
        for m in members:
            assignment = out.get(m.member_id)
            if assignment is None:
                assignment = ConsumerProtocolAssignment(self.version, [], b"")
            assignment.user_data = json.dumps(
                {**shared, "refused": m.member_id in refused}
            ).encode()
            result[m.member_id] = assignment
        return result

    def _group_tag(self, members: list[Any], infos: dict[str, Member]) -> str:
        owned: Counter[str] = Counter()
        for m in members:
            for tp in getattr(m.metadata, "owned_partitions", None) or ():
                owned[infos[m.member_id].tag] += len(tp.partitions)
        counts = owned if owned else Counter(infos[m.member_id].tag for m in members)
        best = max(counts.values())
        tied = sorted(t for t, n in counts.items() if n == best)
        return self.me.tag if self.me.tag in tied else tied[0]

    def on_assignment(self, assignment: Any, generation: int) -> None:
        self.base.on_assignment(assignment, generation)
        view = decode_view(assignment.user_data, generation)
        if self._assigned:
            view = replace(view, leads=True)
        self._assigned = False
        self.view = view
        if self.on_view is not None:
            self.on_view(view)


def decode_view(data: Any, generation: int) -> GroupView:
    """The view in an assignment's user data (an empty one when there is none)."""
    try:
        raw = json.loads(bytes(data)) if data else {}
    except ValueError:
        raw = {}
    members = [
        Member(str(m.get("address", "")), str(m.get("tag", ""))) for m in raw.get("members", [])
    ]
    owners = {int(p): members[i] for p, i in raw.get("owners", {}).items() if 0 <= i < len(members)}
    return GroupView(
        generation=int(generation),
        partitions=int(raw.get("partitions", 0)),
        owners=owners,
        tag=str(raw.get("tag", "")),
        refused=bool(raw.get("refused", False)),
        members=len(members),
    )


class GroupRefused(RuntimeError):
    """This member's tag is not the group's: it was given no partitions."""


def make_assignor(
    name: str, me: Member, on_view: Callable[[GroupView], None] | None = None
) -> MemberAwareAssignor:
    """The assignor ``kafka.assignor`` names, carrying ``me`` and reporting views."""
    try:
        base = ASSIGNORS[name]()
    except KeyError:
        raise ValueError(f"unknown assignor {name!r} (known: {', '.join(ASSIGNORS)})") from None
    return MemberAwareAssignor(base, me, on_view)
