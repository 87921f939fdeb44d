"""What a checkpoint records about the service that wrote it, and where a group's
checkpoints live: the settings that shape the stored data (a checkpoint written under
other values is refused) and the checkpoint root of a (topic, consumer group)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from recmem.config import Config

RUNTIME_ONLY = {
    "memory": ("backend", "chunk_size"),
    "model": ("dropout",),
    "archive": ("replay_notes", "min_votes", "routing", "route_candidates", "route_device"),
}
"""Fields of those sections that do not shape stored data: how this machine computes the
rule, training-only settings, and how a rank request picks its notes (the notes and their
addresses are stored the same under every routing)."""


def data_settings(cfg: Config) -> dict[str, Any]:
    """Every setting that shapes what a checkpoint stores, as ``section.field`` -> value:
    the memory and model sections (the states' meaning and the window), the archive's
    note selection and addresses (and the seed of their coordinate selection), and the
    number of latest events kept per user. A checkpoint written under other values is
    refused: its states, notes or tails mean something else."""
    out: dict[str, Any] = {}
    full = cfg.to_dict()
    for section in ("memory", "model", "archive"):
        for name, value in full[section].items():
            if name not in RUNTIME_ONLY.get(section, ()):
                out[f"{section}.{name}"] = value
    out["train.seed"] = cfg.train.seed  # seeds the archive's address coordinates
    out["recent_events"] = max(1, cfg.server.replay_query_events)
    return out


def checkpoint_root(base: str, topic: str, group_id: str) -> str:
    """Where a group's checkpoints of ``topic`` live under ``checkpoint.dir`` (a directory or
    an s3:// location): ``<base>/<topic>/<group id>``, like Kafka Streams' state directory
    per application id. Two groups on one topic (two model versions) never share one."""
    from urllib.parse import quote

    group = quote(group_id, safe="-_.")
    if base.startswith("s3://"):
        return f"{base.rstrip('/')}/{topic}/{group}"
    return os.fspath(Path(base).expanduser() / topic / group)


@functools.cache
def _defaults() -> dict[str, Any]:
    """``data_settings`` of the default configuration: the value a setting that a
    checkpoint does not record had when it was written. A setting added to the memory,
    model or archive sections must therefore default to what the code did before it
    existed, so that older checkpoints stay readable. (Read only: shared by every call.)"""
    return data_settings(Config())


_UNSET = object()


def settings_diff(stored: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Human-readable differences ``name: checkpoint X, this service Y``. A setting that one
    side does not record (a checkpoint written before the setting existed) compares as its
    default, the config's dataclass default; one without a default (a setting this service
    no longer has) differs from anything."""
    defaults = _defaults()

    def value(side: dict[str, Any], name: str) -> Any:
        return side[name] if name in side else defaults.get(name, _UNSET)

    def shown(side: dict[str, Any], name: str) -> str:
        if name in side:
            return repr(side[name])
        if name in defaults:
            return f"<unset: default {defaults[name]!r}>"
        return "<unset>"

    return [
        f"{n}: checkpoint {shown(stored, n)}, this service {shown(ours, n)}"
        for n in sorted(set(stored) | set(ours))
        if value(stored, n) != value(ours, n)
    ]
