import pytest

from recmem.cli import main
from recmem.config import Config, ConfigError, field_docs, load_config


def test_defaults_documented_and_roundtrip(tmp_path):
    cfg = Config()
    docs = field_docs()
    for section, values in cfg.to_dict().items():
        for name in values:
            assert f"{section}.{name}" in docs, f"{section}.{name} has no documentation"
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path, environ={}) == cfg


def test_precedence_file_env_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[memory]\nn_blocks = 8\nhorizon = 100\n")
    cfg = load_config(path, ["memory.horizon=300"], environ={"RECMEM__MEMORY__N_BLOCKS": "4"})
    assert cfg.memory.n_blocks == 4
    assert cfg.memory.horizon == 300


@pytest.mark.parametrize(
    "override, message",
    [
        ("memory.n_blocks=zero", "expected an integer"),
        ("memory.nope=1", "unknown field"),
        ("bogus.x=1", "unknown section"),
        ("memory.n_blocks", "section.field=value"),
        ("memory.backend=cuda9", "is not one of"),
        ("memory.n_blocks=1000", "n_blocks must be <= memory.key_dim"),
    ],
)
def test_bad_values_give_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override], environ={})


def test_cli_config_error_exit_code(capsys):
    assert main(["config", "--set", "memory.n_heads=-1"]) == 2
    assert "n_heads" in capsys.readouterr().err


def test_cli_prints_toml(capsys):
    assert main(["config", "--set", "memory.n_blocks=2"]) == 0
    assert "n_blocks = 2" in capsys.readouterr().out
