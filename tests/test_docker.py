"""No Docker engine runs here: check what can be checked of docker/ without one."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from recmem.cli import COMMANDS
from recmem.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def compose():
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def expand(text: str) -> str:
    """Compose's ``${VAR:-default}`` with the defaults (no variables set)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(text))


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> name -> (host, port)."""
    out = {}
    for item in expand(value).split(","):
        name, address = item.split("://")
        host, port = address.rsplit(":", 1)
        out[name] = (host, int(port))
    return out


def served_config():
    return load_config(DOCKER / "recmem.toml", environ={})


def instructions(name: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


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
    cfg = served_config()
    assert cfg.server.metrics_host == "0.0.0.0"  # reachable from the Prometheus container
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


def test_kafka_advertises_an_inside_and_an_outside_listener():
    kafka = compose()["services"]["kafka"]
    env = kafka["environment"]
    bound = listeners(env["KAFKA_LISTENERS"])
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(bound) == set(protocols)
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in bound and controller not in advertised
    assert set(advertised) <= set(bound)
    for name, (_, port) in advertised.items():
        assert bound[name][1] == port, f"{name} is advertised on another port than it binds"
    # the containers use the inside name, which the served configuration bootstraps from
    inside = [n for n, (host, _) in advertised.items() if host == "kafka"]
    assert inside == [env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    assert served_config().kafka.bootstrap_servers == f"kafka:{advertised[inside[0]][1]}"
    # clients on the host use localhost on a published port
    (outside,) = [n for n, (host, _) in advertised.items() if host == "localhost"]
    port = advertised[outside][1]
    assert f"{port}:{port}" in [expand(p) for p in kafka["ports"]]


def test_data_volumes_for_kafka_minio_and_the_service():
    doc = compose()
    services = doc["services"]
    declared = set(doc["volumes"])

    def named_mounts(service):
        mounts = (v.split(":") for v in services[service].get("volumes", []))
        return {target: source for source, target, *_ in mounts if source in declared}

    kafka = named_mounts("kafka")
    assert services["kafka"]["environment"]["KAFKA_LOG_DIRS"] in kafka
    recmem = named_mounts("recmem")
    cfg = served_config()
    minio = named_mounts("minio")
    assert "/data" in minio and minio["/data"] not in kafka.values()
    for path in (cfg.server.model_dir, cfg.state.spill_dir, cfg.data.cache_dir):
        assert any(path.startswith(target + "/") for target in recmem), path
    used = {s for name in services for s in named_mounts(name).values()}
    assert used == declared


def test_checkpoints_go_to_minio_through_the_s3_api():
    """Every instance of the group reaches the same checkpoint store: MinIO's bucket, made
    by minio-init before the service starts, with the credentials the service is given."""
    services = compose()["services"]
    cfg = served_config()
    bucket = cfg.checkpoint.dir.removeprefix("s3://").split("/")[0]
    assert cfg.checkpoint.dir.startswith("s3://")
    assert cfg.checkpoint.s3_endpoint_url == "http://minio:9000"
    assert f"local/{bucket}" in services["minio-init"]["command"][0]
    depends = services["recmem"]["depends_on"]
    assert depends["minio-init"]["condition"] == "service_completed_successfully"
    env = {k: expand(v) for k, v in services["recmem"]["environment"].items()}
    minio_env = {k: expand(v) for k, v in services["minio"]["environment"].items()}
    assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    assert services["minio"]["healthcheck"]["test"][:2] == ["CMD", "mc"]


def test_healthchecks_for_kafka_and_the_service():
    services = compose()["services"]
    kafka = services["kafka"]["healthcheck"]
    assert "--bootstrap-server kafka:9092" in kafka["test"][1]
    assert services["kafka-init"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    check = services["recmem"]["healthcheck"]
    test = check["test"]
    assert test[:4] == ["CMD", "python", "-m", "recmem.healthcheck"]
    assert importlib.util.find_spec(test[3]) is not None
    config_path = test[test.index("--config") + 1]
    assert any(v.split(":")[1] == config_path for v in services["recmem"]["volumes"])
    # the service reports SERVING only after restoring its partitions: give it time
    assert int(check["start_period"].rstrip("s")) >= 60


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_install_dependencies_before_the_code_and_never_uninstall(name):
    steps = instructions(name)
    text = " ".join(args for _, args in steps)
    assert "pip uninstall" not in text
    copies = [i for i, (kw, args) in enumerate(steps) if kw == "COPY"]
    code = min(i for i in copies if steps[i][1].split()[0] in {"recmem", "streams", "models"})
    deps = next(i for i, (kw, args) in enumerate(steps) if kw == "RUN" and "-r /tmp/req" in args)
    assert deps < code
    # before the dependencies are installed, only what lists them is copied
    for i in copies:
        if i < deps:
            assert set(steps[i][1].split()[:-1]) <= {"pyproject.toml", "docker/requirements.py"}
    installs = [args for kw, args in steps[code:] if kw == "RUN" and "pip install" in args]
    assert installs and all("--no-deps" in args for args in installs)


def test_the_cuda_image_has_a_c_compiler_for_triton():
    steps = instructions("Dockerfile.cuda")
    base = next(args for kw, args in steps if kw == "FROM")
    apt = " ".join(args for kw, args in steps if kw == "RUN" and "apt-get install" in args)
    assert "devel" in base or re.search(r"\b(gcc|build-essential|clang)\b", apt)


def test_requirements_script_lists_pyproject_dependencies_but_the_replaced_ones():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    run = [
        sys.executable,
        str(DOCKER / "requirements.py"),
        "--pyproject",
        str(ROOT / "pyproject.toml"),
    ]
    assert subprocess.check_output(run, text=True).split() == deps
    without = ["fbgemm-gpu-cpu", "faiss-cpu"]
    kept = subprocess.check_output([*run, "--without", *without], text=True).split()
    assert len(kept) == len(deps) - 2
    assert not any(d.startswith(tuple(without)) for d in kept)
    # the CUDA image leaves out exactly these, and installs its own builds instead
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    assert "--without fbgemm-gpu-cpu faiss-cpu" in cuda and "FBGEMM_SPEC" in cuda
