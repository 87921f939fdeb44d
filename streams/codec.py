"""The wire format: protobuf ``recmem.v1.Event`` values keyed by user id (SPEC section 2).

Actions travel as the ``Action`` enum; value v in 1..6 is ``proto.actions.ACTIONS[v - 1]``
and ``ACTION_UNSPECIFIED`` (0, what a producer that never sets the field sends) reads as
"other".
"""

from __future__ import annotations

from proto.actions import ACTIONS
from proto.recmem.v1 import event_pb2

Event = event_pb2.Event
"""The generated message class."""

OTHER_INDEX = ACTIONS.index("other")


def action_to_wire(action: int | str) -> int:
    """Enum value for an action given by name (``"click"``) or index into ACTIONS."""
    if isinstance(action, str):
        try:
            return ACTIONS.index(action.lower()) + 1
        except ValueError:
            raise ValueError(f"unknown action {action!r} (known: {', '.join(ACTIONS)})") from None
    if not 0 <= action < len(ACTIONS):
        raise ValueError(f"action index {action} is outside 0..{len(ACTIONS) - 1}")
    return int(action) + 1


def action_from_wire(value: int) -> int | None:
    """Index into ACTIONS for an enum value; None for a value this version does not know."""
    if value == event_pb2.ACTION_UNSPECIFIED:
        return OTHER_INDEX
    if 1 <= value <= len(ACTIONS):
        return value - 1
    return None


def make_event(
    user_id: str,
    item_id: str,
    ts_ms: int,
    action: int | str = "other",
    value: float = 0.0,
    session_id: str | None = None,
    event_id: str | None = None,
) -> event_pb2.Event:
    """An Event message from plain fields (action by name or ACTIONS index)."""
    event = Event(
        user_id=user_id,
        item_id=item_id,
        ts_ms=int(ts_ms),
        action=action_to_wire(action),  # type: ignore[arg-type]
        value=float(value),
    )
    if session_id is not None:
        event.session_id = session_id
    if event_id is not None:
        event.event_id = event_id
    return event


def encode_event(event: event_pb2.Event) -> tuple[bytes, bytes]:
    """(Kafka key, Kafka value) for an event: key = user id in UTF-8."""
    return event.user_id.encode(), event.SerializeToString()


def decode_event(value: bytes) -> event_pb2.Event:
    """Parse a Kafka value; raises ``google.protobuf.message.DecodeError`` on bad bytes."""
    return Event.FromString(value)
