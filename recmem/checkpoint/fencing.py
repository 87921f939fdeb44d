"""Fencing of stale owners (docs/scaling.md, Fencing): the group generation a writer holds,
the claims that record which generation owns a partition, and the rule a restore applies to
what an older generation wrote after the newest claim. The store (recmem/checkpoint/store.py)
checks and commits them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
CKPT = re.compile(r"^ckpt-(\d+)(?:-g(-?\d+)-[0-9a-f]+)?$")
"""A checkpoint's name: its sequence number, and the writer's generation (absent in names of
checkpoints written before fencing)."""
FENCE = re.compile(r"^fence-(\d+)\.json$")
NO_GENERATION = -1
"""The generation of a writer outside any consumer group (tests, tools): never fenced by
one, refused once a group member has claimed the partition."""


class Fenced(RuntimeError):
    """A later group generation claimed the partition: this writer no longer owns it."""


@dataclass(frozen=True)
class Fence:
    """The newest claim of a partition: the claimant's group generation, who it was, and
    the checkpoint it started from (None: there was none)."""

    generation: int = NO_GENERATION
    owner: str = ""
    base: str | None = None
    claimed_unix: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "owner": self.owner,
            "base": self.base,
            "claimed_unix": self.claimed_unix,
        }

    @classmethod
    def from_json(cls, raw: Any) -> Fence:
        if not isinstance(raw, dict):
            return cls()
        base = raw.get("base")
        return cls(
            int(raw.get("generation", NO_GENERATION)),
            str(raw.get("owner", "")),
            base if isinstance(base, str) and NAME_OK.match(base) else None,
            float(raw.get("claimed_unix", 0.0)),
        )


def seq_of(name: str) -> int:
    m = CKPT.match(name)
    return int(m.group(1)) if m else -1


def generation_of(name: str) -> int:
    """The writer's generation in a checkpoint's name (NO_GENERATION for the older names)."""
    m = CKPT.match(name)
    return int(m.group(2)) if m and m.group(2) is not None else NO_GENERATION


def is_stale(name: str, fence: Fence) -> bool:
    """Written by an older generation after ``fence``'s claim (it cannot be the restore
    point: the claimant did not start from it)."""
    base = seq_of(fence.base) if fence.base else 0
    return generation_of(name) < fence.generation and seq_of(name) > base
