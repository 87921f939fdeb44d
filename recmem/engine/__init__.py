"""The engine (SPEC section 1): per-user memory states, latest events and NoteBank notes,
owned by one engine loop that schedules ingest batches and rank micro-batches.

``engine`` (Engine: the step and the state it owns), ``loop`` (EngineLoop: the owner
thread and its scheduler), ``tails`` (each user's latest events), ``builder`` (the one
builder every entry point uses). docs/ingest.md and docs/serving.md describe both sides.
"""

from recmem.engine.engine import (
    ApplyCounts,
    Engine,
    GroupedBatch,
    UserInfo,
    group_events,
    group_events_reference,
)
from recmem.engine.loop import DeviceOutOfMemory, EngineLoop, LoopStopped, PartitionUnavailable
from recmem.engine.tails import RecentEvents

__all__ = [
    "ApplyCounts",
    "DeviceOutOfMemory",
    "Engine",
    "EngineLoop",
    "GroupedBatch",
    "LoopStopped",
    "PartitionUnavailable",
    "RecentEvents",
    "UserInfo",
    "group_events",
    "group_events_reference",
]
