"""No Docker engine runs here: check what can be checked of docker/ without one."""

import re
from pathlib import Path

import yaml

from recmem.cli import COMMANDS
from recmem.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def compose():
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def test_compose_services_and_kraft():
    services = compose()["services"]
    assert {"kafka", "kafka-init", "train", "recmem", "prometheus"} <= set(services)
    env = services["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "CONTROLLER" in env["KAFKA_CONTROLLER_LISTENER_NAMES"]


def test_compose_commands_are_real_subcommands_with_valid_config():
    services = compose()["services"]
    for name in ("train", "recmem"):
        command = services[name]["command"]
        assert command[0] in COMMANDS, f"{name}: unknown subcommand {command[0]}"
        mounts = dict(v.split(":")[:2] for v in services[name]["volumes"] if v.startswith("./"))
        cfg_path = command[command.index("--config") + 1]
        host_file = next(h for h, c in mounts.items() if c == cfg_path)
        cfg = load_config(DOCKER / host_file, environ={})
        assert cfg.kafka.bootstrap_servers.split(":")[0] == "kafka"


def test_prometheus_scrapes_the_metrics_port():
    cfg = load_config(DOCKER / "recmem.toml", environ={})
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert f"recmem:{cfg.server.metrics_port}" in targets
    ports = compose()["services"]["recmem"]["ports"]
    assert f"{cfg.server.metrics_port}:{cfg.server.metrics_port}" in ports
    assert f"{cfg.server.port}:{cfg.server.port}" in ports


def test_dockerfiles_copy_existing_paths():
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DOCKER / name).read_text()
        assert text.startswith("#") and re.search(r"^FROM \S+", text, re.M)
        for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
            for part in src.split():
                assert (ROOT / part).exists(), f"{name}: COPY source {part} missing"
        assert 'ENTRYPOINT ["recmem"]' in text
