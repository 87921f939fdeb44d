"""Every range, choice and rule of recmem/config_checks.py rejects a bad value with a message
naming the field and accepts its bounds; secrets never reach printed configurations."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest

from models.memory.ops import BACKENDS, backend_names
from recmem import config_checks
from recmem.cli import main
from recmem.config import Config, ConfigError, field_docs, load_config


def numeric_fields() -> dict[str, type]:
    out = {}
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                out[f"{section.name}.{f.name}"] = hints[f.name]
    return out


def bounds(dotted: str) -> tuple[str, float, float, str]:
    m = re.match(r"^([\[(])(\S+), (\S+)([\])])$", config_checks.RANGES[dotted])
    assert m, config_checks.RANGES[dotted]
    return m[1], float(m[2]), float(m[3]), m[4]


def test_every_numeric_field_has_a_range_and_documents_it() -> None:
    fields = numeric_fields()
    assert set(fields) == set(config_checks.RANGES)
    docs = field_docs()
    for dotted in fields:
        assert docs[dotted].endswith(f"Range: {config_checks.RANGES[dotted]}.")


def test_the_defaults_are_valid() -> None:
    assert config_checks.problems(Config()) == []


@pytest.mark.parametrize("dotted", sorted(config_checks.RANGES))
def test_a_value_outside_the_range_is_refused(dotted: str) -> None:
    typ = numeric_fields()[dotted]
    left, lo, hi, right = bounds(dotted)
    step = 1 if typ is int else 0.5
    outside = [lo - step if left == "[" else lo]
    if math.isfinite(hi):
        outside.append(hi + step if right == "]" else hi)
    for value in outside:
        text = str(int(value)) if typ is int else repr(value)
        with pytest.raises(ConfigError, match=re.escape(f"{dotted} = ")):
            load_config(None, [f"{dotted}={text}"], environ={})


@pytest.mark.parametrize("dotted", sorted(config_checks.RANGES))
def test_the_bounds_of_a_range_are_accepted(dotted: str) -> None:
    typ = numeric_fields()[dotted]
    left, lo, hi, right = bounds(dotted)
    tiny = 1 if typ is int else 1e-6
    assert config_checks.out_of_range(dotted, lo if left == "[" else lo + tiny) is None
    top = hi if right == "]" else (hi - tiny if math.isfinite(hi) else 1e12)
    assert config_checks.out_of_range(dotted, top) is None
    assert config_checks.out_of_range(dotted, math.nan) is not None


@pytest.mark.parametrize("dotted", sorted(config_checks.CHOICES))
def test_choices_accept_theirs_and_refuse_others(dotted: str) -> None:
    for value in config_checks.CHOICES[dotted]:
        cfg = load_config(None, [f"{dotted}={value}"], environ={})
        section, name = dotted.split(".")
        assert getattr(getattr(cfg, section), name) == value
    with pytest.raises(ConfigError, match=re.escape(f"{dotted} 'bogus' is not one of")):
        load_config(None, [f"{dotted}=bogus"], environ={})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["memory.key_dim=8", "memory.n_blocks=16"], "memory.n_blocks must be <= memory.key_dim"),
        (["data.valid_frac=0.9", "data.test_frac=0.8"], "valid_frac must be < data.test_frac"),
        (["kafka.heartbeat_interval_ms=3000", "kafka.session_timeout_ms=3000"], "heartbeat"),
        (["archive.replay_notes=8", "server.max_replay_notes=4"], "archive.replay_notes"),
        (["model.hybrid=mag", "model.attn_heads=3"], "attn_heads must be >= 1 and divide"),
        (["model.hybrid=both"], "model.hybrid 'both' is not one of"),
        (["model.request_time=later"], "model.request_time 'later' is not one of"),
    ],
)
def test_rules_between_fields(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides, environ={})


def test_backend_names_come_from_the_kernel_registry() -> None:
    names = backend_names()
    # fla's kernels register only on CUDA machines; their names are known everywhere
    assert {"auto", "chunk_aligned", "fla", "fla_chunk", "fla_recurrent"} <= set(names)
    assert set(BACKENDS) <= set(names)
    for name in names:
        assert load_config(None, [f"memory.backend={name}"], environ={}).memory.backend == name
    with pytest.raises(ConfigError, match="memory.backend 'cuda9' is not one of auto|"):
        load_config(None, ["memory.backend=cuda9"], environ={})


def test_train_backends_come_from_the_training_paths() -> None:
    cfg = load_config(None, ["memory.train_backend=triton"], environ={})
    assert cfg.memory.train_backend == "triton"
    with pytest.raises(ConfigError, match="memory.train_backend 'fast' is not one of"):
        load_config(None, ["memory.train_backend=fast"], environ={})
    with pytest.raises(ConfigError, match="only the rule without momentum"):
        load_config(None, ["memory.train_backend=fla_chunk"], environ={})
    off = ["memory.train_backend=fla_chunk", "memory.momentum=false"]
    assert load_config(None, off, environ={}).memory.train_backend == "fla_chunk"


def test_secrets_are_masked_when_printed(capsys: pytest.CaptureFixture[str]) -> None:
    secrets = {
        "kafka.sasl_password": "pw-1",
        "kafka.metrics_token": "mt-2",
        "server.auth_token": "tok-3",
        "server.metrics_token": "mt-4",
    }
    assert set(secrets) == set(config_checks.SECRETS)
    args = ["config"] + [a for k, v in secrets.items() for a in ("--set", f"{k}={v}")]
    assert main(args) == 0
    out = capsys.readouterr().out
    for value in secrets.values():
        assert value not in out
    assert out.count('= "***"') == len(secrets)
    cfg = load_config(None, [f"{k}={v}" for k, v in secrets.items()], environ={})
    assert cfg.server.auth_token == "tok-3"  # only the printed copy is masked
    assert cfg.to_dict()["server"]["auth_token"] == "tok-3"
    assert cfg.to_dict(redact_secrets=True)["server"]["auth_token"] == "***"
    assert Config().to_dict(redact_secrets=True)["server"]["auth_token"] == ""  # unset: empty
