"""Per-user Titans-style memory with the Proteus schedule: reference, fast paths, dispatch."""

from models.memory.naive import memory_scan_reference, memory_step_reference
from models.memory.ops import memory_scan
from models.memory.proteus import open_rows, proteus_row_mask, unlocked_blocks

__all__ = [
    "memory_scan",
    "memory_scan_reference",
    "memory_step_reference",
    "open_rows",
    "proteus_row_mask",
    "unlocked_blocks",
]
