"""What a valid configuration is: the range of every numeric field, the choices of the
enumerated ones, the rules that tie fields together, and which fields are secrets.

``recmem.config.load_config`` applies :func:`problems` after loading and overrides;
``recmem config --docs`` prints each field's range next to its documentation; secrets are
shown as ``***`` wherever a configuration is printed or written out
(``Config.to_dict(redact_secrets=True)``). Plain data and functions of a ``Config``-shaped
object, so that this module imports nothing of the configuration itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

RANGES: dict[str, str] = {
    "memory.n_layers": "[1, inf)",
    "memory.n_heads": "[1, inf)",
    "memory.key_dim": "[1, inf)",
    "memory.value_dim": "[1, inf)",
    "memory.n_blocks": "[1, inf)",
    "memory.horizon": "[1, inf)",
    "memory.theta_max": "(0, 1]",
    "memory.chunk_size": "[1, inf)",
    "memory.unlock_threshold": "[0, inf]",
    "model.embed_dim": "[1, inf)",
    "model.n_oov_buckets": "[1, inf)",
    "model.n_time_buckets": "[1, inf)",
    "model.dropout": "[0, 1)",
    "model.ffn_mult": "[0, inf)",
    "model.window": "[0, inf)",
    "model.attn_heads": "[1, inf)",
    "model.replay_rank": "[1, inf)",
    "model.route_dim": "[0, inf)",
    "train.epochs": "[1, inf)",
    "train.batch_size": "[0, inf)",
    "train.segment_len": "[1, inf)",
    "train.lr": "(0, inf)",
    "train.warmup_steps": "[0, inf)",
    "train.lr_decay": "(0, 1]",
    "train.decay_patience": "[0, inf)",
    "train.weight_decay": "[0, inf)",
    "train.n_negatives": "[1, inf)",
    "train.patience": "[1, inf)",
    "train.eval_every": "[1, inf)",
    "train.seed": "[0, inf)",
    "train.max_seconds": "[0, inf)",
    "train.proteus_ffn_horizon": "[1, inf)",
    "train.replay_steps": "[0, inf)",
    "train.replay_share": "(0, 1]",
    "data.valid_frac": "(0, 1)",
    "data.test_frac": "(0, 1)",
    "data.synthetic_users": "[1, inf)",
    "data.synthetic_events": "[1, inf)",
    "data.synthetic_seed": "[0, inf)",
    "eval.recent_window": "[1, inf)",
    "eval.repeat_gap": "[0, inf)",
    "eval.batch_users": "[1, inf)",
    "eval.jobs": "[1, inf)",
    "kafka.max_poll_records": "[1, inf)",
    "kafka.consumer_processes": "[0, 64]",
    "kafka.max_wait_ms": "[0, inf)",
    "kafka.session_timeout_ms": "[1, inf)",
    "kafka.heartbeat_interval_ms": "[1, inf)",
    "kafka.min_ts_ms": "[0, inf)",
    "kafka.max_past_ms": "[0, inf)",
    "kafka.max_future_ms": "[0, inf)",
    "kafka.max_field_bytes": "[1, inf)",
    "kafka.partitions": "[1, inf)",
    "kafka.metrics_port": "[0, 65535]",
    "state.device_capacity": "[1, inf)",
    "state.host_capacity": "[0, inf)",
    "state.dedupe_window": "[0, inf)",
    "state.piece_cells": "[0, inf)",
    "checkpoint.interval_s": "[0, inf)",
    "checkpoint.keep": "[1, inf)",
    "checkpoint.full_every": "[0, inf)",
    "checkpoint.restore_threads": "[1, inf)",
    "checkpoint.prefetch_mb": "[0, inf)",
    "archive.chunk_events": "[1, inf)",
    "archive.window": "[1, inf)",
    "archive.spans_per_chunk": "[1, inf)",
    "archive.max_span": "[1, inf)",
    "archive.session_gap_s": "[0, inf)",
    "archive.address_dim": "[1, inf)",
    "archive.notes_per_user": "[1, inf)",
    "archive.replay_notes": "[1, inf)",
    "archive.min_votes": "[0, inf)",
    "archive.route_candidates": "[1, inf)",
    "server.port": "[0, 65535]",
    "server.max_k": "[1, inf)",
    "server.max_candidates": "[0, inf)",
    "server.max_context_events": "[0, inf)",
    "server.max_batch_requests": "[1, inf)",
    "server.batch_window_ms": "[0, inf)",
    "server.frontend_window_ms": "[-1, inf)",
    "server.frontend_in_flight": "[1, 64]",
    "server.max_batch": "[1, inf)",
    "server.metrics_port": "[0, 65535]",
    "server.max_replay_notes": "[0, inf)",
    "server.replay_query_events": "[0, inf)",
    "server.threads": "[1, inf)",
    "server.frontends": "[0, 64]",
    "server.request_timeout_s": "(0, inf)",
    "server.max_message_bytes": "[1, 2147483647]",
    "server.torch_threads": "[0, inf)",
    "server.replay_cache_users": "[0, inf)",
    "server.shutdown_grace_s": "[0, inf)",
    "server.retry_hint_ms": "[0, inf)",
    "workload.users": "[1, 2147483647]",
    "workload.events": "[1, inf)",
    "workload.items": "[1, 2147483647]",
    "workload.user_zipf": "[0, inf)",
    "workload.item_zipf": "[0, inf)",
    "workload.mean_gap_ms": "[1, inf)",
    "workload.seed": "[0, inf)",
}
"""``section.field`` -> the interval its value must lie in (``[`` / ``]`` closed, ``(`` /
``)`` open). Every int and float field has one (a test checks)."""

CHOICES: dict[str, tuple[str, ...]] = {
    "train.loss": ("full", "sampled"),
    "eval.exclude_seen": ("auto", "yes", "no"),
    "archive.routing": ("native", "lexical", "candidates"),
    "archive.route_device": ("cpu", "rank"),
    "state.length_buckets": ("auto", "on", "off"),
    "state.packed_advance": ("auto", "on", "off"),
    "state.compile_step": ("auto", "on", "off"),
    "kafka.on_topic_mismatch": ("fail", "earliest", "latest"),
    "kafka.on_offset_out_of_range": ("fail", "earliest", "latest"),
    "kafka.security_protocol": ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    "kafka.sasl_mechanism": ("", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
    "kafka.assignor": ("cooperative-sticky", "range", "roundrobin"),
    "kafka.client": ("kafka-python", "confluent"),
    "server.routing": ("forward", "redirect"),
    "server.frontend_mode": ("threads", "aio"),
}
"""``section.field`` -> its allowed values. ``memory.backend``, ``memory.train_backend``,
``model.hybrid``, ``model.request_time``, ``model.replay_fusion``, ``memory.unlock`` and
``memory.block_order`` are checked against the code that implements them instead."""

SECRETS: tuple[str, ...] = (
    "kafka.sasl_password",
    "kafka.metrics_token",
    "server.auth_token",
    "server.metrics_token",
)
"""Fields never printed or written out: a set one is shown as ``***``."""

MASK = "***"

_INTERVAL = re.compile(r"^([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])$")


def _get(cfg: Any, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def out_of_range(dotted: str, value: float) -> str | None:
    """Why ``value`` is outside ``RANGES[dotted]``, or None when it is inside."""
    m = _INTERVAL.match(RANGES[dotted])
    assert m is not None, f"bad interval for {dotted}: {RANGES[dotted]}"
    left, lo_text, hi_text, right = m.groups()
    lo, hi = float(lo_text), float(hi_text)
    inside = (
        not math.isnan(value)
        and (value >= lo if left == "[" else value > lo)
        and (value <= hi if right == "]" else value < hi)
    )
    return None if inside else f"{dotted} = {value!r} is outside {RANGES[dotted]}"


def _backend_problem(cfg: Any) -> str | None:
    from models.memory.ops import backend_names  # the kernel registry (imports torch)

    name, known = cfg.memory.backend, backend_names()
    return None if name in known else f"memory.backend {name!r} is not one of {'|'.join(known)}"


def _train_backend_problem(cfg: Any) -> str | None:
    from models.memory.training import check_train_backend  # the training paths (torch)

    try:
        check_train_backend(cfg.memory.train_backend, cfg.memory.momentum)
    except ValueError as e:
        return str(e)
    return None


def _schedule_problem(cfg: Any) -> str | None:
    from models.memory.schedule import check_schedule_config  # the schedules' own rules

    mem = cfg.memory
    window = cfg.model.window if cfg.model.hybrid != "none" else 0
    try:
        check_schedule_config(mem.unlock, mem.block_order, mem.key_dim, mem.n_blocks, window)
    except ValueError as e:
        return str(e)
    return None


def _fusion_problem(cfg: Any) -> str | None:
    from models.fusion import check_fusion_config  # the replay fusion's own rules

    m = cfg.model
    try:
        check_fusion_config(m.replay_fusion, m.replay_rank, m.route_dim, cfg.memory.key_dim)
    except ValueError as e:
        return str(e)
    return None


def _head_problem(cfg: Any) -> str | None:
    from models.hybrid import check_head_config  # the head's own rules (imports torch)

    try:
        check_head_config(cfg.model)
    except ValueError as e:
        return str(e)
    return None


RULES: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda c: c.memory.n_blocks <= c.memory.key_dim, "memory.n_blocks must be <= memory.key_dim"),
    (lambda c: c.data.valid_frac < c.data.test_frac, "data.valid_frac must be < data.test_frac"),
    (
        lambda c: c.kafka.heartbeat_interval_ms < c.kafka.session_timeout_ms,
        "kafka.heartbeat_interval_ms must be < kafka.session_timeout_ms",
    ),
    (
        lambda c: c.archive.replay_notes <= c.server.max_replay_notes,
        "archive.replay_notes (the default R) must be <= server.max_replay_notes",
    ),
    (
        lambda c: c.workload.events >= c.workload.users,
        "workload.events must be >= workload.users (every user has at least one event)",
    ),
    (
        lambda c: c.model.route_dim <= c.archive.address_dim,
        "model.route_dim must be <= archive.address_dim (the archive keeps every dimension "
        "of a learned routing address)",
    ),
)
"""Rules between fields: (holds, the message when it does not)."""


def problems(cfg: Any) -> list[str]:
    """Every way ``cfg`` breaks the ranges, choices and rules above (empty: valid)."""
    out = [msg for dotted in RANGES if (msg := out_of_range(dotted, _get(cfg, dotted))) is not None]
    out += [
        f"{dotted} {_get(cfg, dotted)!r} is not one of {', '.join(map(repr, allowed))}"
        for dotted, allowed in CHOICES.items()
        if _get(cfg, dotted) not in allowed
    ]
    if out:  # the rules below assume every field is in range
        return out
    out = [message for holds, message in RULES if not holds(cfg)]
    return out + [
        msg
        for check in (
            _backend_problem,
            _train_backend_problem,
            _head_problem,
            _schedule_problem,
            _fusion_problem,
        )
        if (msg := check(cfg))
    ]


def redact(data: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of a configuration dict (``section -> field -> value``) with every set secret
    replaced by ``***`` (an unset one stays empty, so that one can see it is unset)."""
    out = {section: dict(values) for section, values in data.items()}
    for dotted in SECRETS:
        section, name = dotted.split(".")
        if out.get(section, {}).get(name):
            out[section][name] = MASK
    return out
