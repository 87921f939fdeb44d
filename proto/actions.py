"""Action names, read from the ``Action`` enum of proto/recmem/v1/event.proto: the one
definition that the wire format (streams) and the model's action embedding (models) share.
Index i names enum value i + 1; ``ACTION_UNSPECIFIED`` (0) has no name here."""

from __future__ import annotations

from proto.recmem.v1 import event_pb2

ACTIONS: tuple[str, ...] = tuple(
    name.removeprefix("ACTION_").lower()
    for name, value in sorted(event_pb2.Action.items(), key=lambda kv: kv[1])
    if value > 0
)
"""("view", "click", "cart", "purchase", "rating", "other")"""
