"""docker-compose.yml and .env.example, resolved by Docker Compose v2 itself (`config`, no engine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest

from embeddings.tooling.local_redis import EMBEDDING_CACHE_EVICTION
from embeddings.tooling.triton_server import TRITON_PING_FLAGS
from tests.deploy.env_files import (
    generated_secret,
    read_env_file,
    seconds,
    settings_check_deploy,
    write_env_file,
)
from tests.processes import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
# make setup puts the binary beside the interpreter (Makefile: $(COMPOSE)).
COMPOSE_BINARY = Path(sys.executable).parent / "docker-compose"
SECRETS = ("DJANGO_SECRET_KEY", "POSTGRES_PASSWORD")
APP_SERVICES = {"export", "migrate", "web", "worker", "beat"}


def compose_config(tmp_path: Path, **overrides: str) -> subprocess.CompletedProcess:
    """`docker-compose config --format json` on the repository's file, with .env.example's values
    (secrets filled in as an operator would) and `overrides`, in an otherwise empty environment."""
    if not COMPOSE_BINARY.exists():
        pytest.fail(f"{COMPOSE_BINARY} is missing: `make setup` installs it", pytrace=False)
    values = read_env_file(ENV_EXAMPLE) | {name: generated_secret() for name in SECRETS} | overrides
    env_file = write_env_file(tmp_path / "compose.env", values)
    return subprocess.run(
        [
            *(str(COMPOSE_BINARY), "--project-directory", str(REPO_ROOT), "--file", str(COMPOSE_FILE)),
            *("--env-file", str(env_file), "config", "--format", "json"),
        ],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def resolved(tmp_path: Path, **overrides: str) -> dict:
    done = compose_config(tmp_path, **overrides)
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


@pytest.fixture
def gpu_stack(tmp_path: Path) -> dict:
    return resolved(tmp_path)


@pytest.fixture
def cpu_stack(tmp_path: Path) -> dict:
    return resolved(tmp_path, COMPOSE_PROFILES="cpu")


def test_the_default_profile_runs_the_whole_stack_on_a_gpu(gpu_stack: dict) -> None:
    services = gpu_stack["services"]
    assert set(services) == {"postgres", "redis", "redis-jobs", "redis-cache", "triton", *APP_SERVICES}
    triton = services["triton"]
    assert triton["image"].startswith("nvcr.io/nvidia/tritonserver:")
    assert "--model-config-name=gpu" in triton["command"]
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"


def test_the_cpu_profile_runs_triton_on_the_cpu_config_under_the_same_name(cpu_stack: dict) -> None:
    services = cpu_stack["services"]
    assert set(services) == {"postgres", "redis", "redis-jobs", "redis-cache", "triton-cpu", *APP_SERVICES}
    triton = services["triton-cpu"]
    assert "--model-config-name=cpu" in triton["command"]
    assert "devices" not in triton.get("deploy", {}).get("resources", {}).get("reservations", {})
    # The app reaches whichever Triton runs as `triton`.
    assert triton["networks"]["default"]["aliases"] == ["triton"]
    assert services["web"]["environment"]["TRITON_SERVER_URL"] == "dns:///triton:8001"
    assert (REPO_ROOT / "model_repository" / "minilm" / "configs" / "cpu.pbtxt").is_file()


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_app_reads_the_model_config_triton_runs(tmp_path: Path, profile: str) -> None:
    """Models loaded after start are sent the config named TRITON_MODEL_CONFIG_NAME: it must be the
    one the running Triton was started with, and Triton loads only MiniLM at start."""
    services = resolved(tmp_path, COMPOSE_PROFILES=profile)["services"]
    (triton,) = (services[name] for name in ("triton", "triton-cpu") if name in services)
    assert "--model-control-mode=explicit" in triton["command"]
    assert [arg for arg in triton["command"] if arg.startswith("--load-model")] == ["--load-model=minilm"]
    for app in APP_SERVICES:
        config_name = services[app]["environment"]["TRITON_MODEL_CONFIG_NAME"]
        assert f"--model-config-name={config_name}" in triton["command"], app
    # The app may ping its calls' connections often (TRITON_KEEPALIVE_S): Triton must allow it.
    assert set(TRITON_PING_FLAGS) <= set(triton["command"])


@pytest.mark.parametrize("secret", SECRETS)
def test_compose_refuses_to_start_without_each_secret(tmp_path: Path, secret: str) -> None:
    done = compose_config(tmp_path, **{secret: ""})
    assert done.returncode != 0
    assert f"required variable {secret} is missing a value" in done.stderr


def test_secrets_come_only_from_the_environment(tmp_path: Path) -> None:
    secret_key, password = generated_secret(), generated_secret()
    stack = resolved(tmp_path, DJANGO_SECRET_KEY=secret_key, POSTGRES_PASSWORD=password)
    for name in APP_SERVICES:
        environment = stack["services"][name]["environment"]
        assert environment["DJANGO_SECRET_KEY"] == secret_key
        assert environment["DATABASE_URL"] == f"postgres://embedsite:{password}@postgres:5432/embedsite"
    assert stack["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == password
    example = read_env_file(ENV_EXAMPLE)
    assert all(example[name] == "" for name in (*SECRETS, "API_KEY_HMAC_SECRET"))


def test_every_variable_compose_reads_is_in_env_example_and_each_there_is_read() -> None:
    read_by_compose = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", COMPOSE_FILE.read_text()))
    # COMPOSE_PROFILES is read by compose itself, and interpolated (TRITON_MODEL_CONFIG_NAME).
    in_example = set(read_env_file(ENV_EXAMPLE))
    assert read_by_compose - in_example == set(), "missing from .env.example"
    assert in_example - read_by_compose == set(), "in .env.example but never read"


def test_services_start_in_order_on_healthy_dependencies(gpu_stack: dict) -> None:
    services = gpu_stack["services"]

    def waits_for(service: str) -> dict[str, str]:
        return {name: dep["condition"] for name, dep in services[service]["depends_on"].items()}

    assert waits_for("migrate") == {
        "postgres": "service_healthy",
        "export": "service_completed_successfully",
    }
    assert waits_for("triton") == {"export": "service_completed_successfully"}
    for app in ("web", "worker", "beat"):
        assert waits_for(app)["migrate"] == "service_completed_successfully"
        assert waits_for(app)["redis"] == waits_for(app)["redis-jobs"] == "service_healthy"
    # The cache's Redis starts before the two that use it, which never wait for it to be healthy:
    # a cache not up yet is a miss, not a failure.
    for app in ("web", "worker"):
        assert waits_for(app)["redis-cache"] == "service_started"
    assert waits_for("web")["triton"] == "service_healthy"
    assert services["postgres"]["healthcheck"]["test"][1] == "pg_isready"
    for redis_service in ("redis", "redis-jobs", "redis-cache"):
        assert services[redis_service]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for redis_service in ("redis", "redis-jobs"):
        assert {volume["source"] for volume in services[redis_service]["volumes"]} == {redis_service}
    assert {volume["source"] for volume in services["postgres"]["volumes"]} == {"postgres"}
    assert "migrate --noinput" in " ".join(services["migrate"]["command"])
    # Version 1: the one the catalog pins for minilm; an outdated export is redone in place.
    assert "export_model --if-missing --version 1 " in " ".join(services["export"]["command"])


def redis_options(command: list[str]) -> dict[str, str]:
    """`redis-server --name value ...` as {name: value}."""
    assert command[0] == "redis-server"
    names, values = command[1::2], command[2::2]
    assert all(name.startswith("--") for name in names) and len(names) == len(values)
    return {name[2:]: value for name, value in zip(names, values, strict=True)}


def test_the_critical_redis_and_the_job_store_are_two_bounded_servers(tmp_path: Path) -> None:
    stack = resolved(tmp_path, REDIS_MAXMEMORY="300mb", JOB_STORE_MAXMEMORY="12gb")
    services = stack["services"]
    critical, job_store = (redis_options(services[name]["command"]) for name in ("redis", "redis-jobs"))
    # Full, each refuses writes (noeviction): no quota window or unfolded usage silently evicted.
    # The critical one's append-only file keeps unfolded usage across a restart (lost: 1 s at most).
    durable = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    assert critical == {**durable, "maxmemory": "300mb"}
    assert job_store == {**durable, "maxmemory": "12gb"}
    for app in APP_SERVICES:
        environment = services[app]["environment"]
        assert environment["REDIS_URL"] == "redis://redis:6379/0"
        assert environment["JOB_STORE_URL"] == "redis://redis-jobs:6379/0"
    defaults = resolved(tmp_path)["services"]
    assert (
        redis_options(defaults["redis"]["command"])["maxmemory"]
        == read_env_file(ENV_EXAMPLE)["REDIS_MAXMEMORY"]
    )


def test_the_embedding_cache_has_a_bounded_evicting_redis_of_its_own(tmp_path: Path) -> None:
    services = resolved(tmp_path, EMBEDDING_CACHE_MAXMEMORY="300mb")["services"]
    cache = services["redis-cache"]
    # Full, it evicts the least frequently used entries (a vector can be computed again), as runstack's
    # does; it keeps nothing across a restart (no snapshot, no append-only file, no volume).
    assert redis_options(cache["command"]) == {
        "save": "",
        "appendonly": "no",
        "maxmemory": "300mb",
        "maxmemory-policy": EMBEDDING_CACHE_EVICTION,
    }
    assert "volumes" not in cache
    for app in ("web", "worker"):
        environment = services[app]["environment"]
        assert environment["EMBEDDING_CACHE_REDIS_URL"] == "redis://redis-cache:6379/0"
        # Never the critical Redis or the job store, which must not evict (their test above).
        assert urlsplit(environment["EMBEDDING_CACHE_REDIS_URL"]).hostname not in {
            urlsplit(environment["REDIS_URL"]).hostname,
            urlsplit(environment["JOB_STORE_URL"]).hostname,
        }
    # Off as shipped, and one line of .env turns it on.
    assert {services[app]["environment"]["EMBEDDING_CACHE"] for app in APP_SERVICES} == {"0"}
    assert read_env_file(ENV_EXAMPLE)["EMBEDDING_CACHE"] == "0"
    on = resolved(tmp_path, EMBEDDING_CACHE="1")["services"]
    assert {on[app]["environment"]["EMBEDDING_CACHE"] for app in ("web", "worker")} == {"1"}
    assert (
        redis_options(on["redis-cache"]["command"])["maxmemory"]
        == read_env_file(ENV_EXAMPLE)["EMBEDDING_CACHE_MAXMEMORY"]
    )


def test_web_serves_on_8080_with_a_readiness_healthcheck_and_a_grace_period_above_its_drain(
    gpu_stack: dict,
) -> None:
    web = gpu_stack["services"]["web"]
    assert web["command"] == ["python", "manage.py", "serve", "--host", "0.0.0.0", "--port", "8080"]
    assert "http://localhost:8080/ready" in " ".join(web["healthcheck"]["test"])
    environment = web["environment"]
    drain_and_finish = float(environment["SHUTDOWN_DRAIN_S"]) + float(environment["SHUTDOWN_TIMEOUT_S"])
    assert seconds(web["stop_grace_period"]) > drain_and_finish
    # The healthcheck asks for localhost, so it must be an allowed host.
    assert "localhost" in environment["DJANGO_ALLOWED_HOSTS"].split(",")


def test_replicas_processes_and_concurrency_come_from_the_environment(tmp_path: Path) -> None:
    stack = resolved(
        tmp_path,
        WEB_REPLICAS="3",
        WEB_PORTS="8080-8082",
        WEB_CONCURRENCY="5",
        WORKER_REPLICAS="4",
        CELERY_CONCURRENCY="7",
    )
    web, worker = stack["services"]["web"], stack["services"]["worker"]
    assert web["deploy"]["replicas"] == 3
    assert web["ports"][0]["published"] == "8080-8082"
    assert web["environment"]["WEB_CONCURRENCY"] == "5"
    assert worker["deploy"]["replicas"] == 4
    assert "--concurrency=7" in worker["command"]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_every_long_running_service_is_restarted_and_checked(tmp_path: Path, profile: str) -> None:
    """Docker restarts a container whose process exits (`unless-stopped`); the one-off steps run once.
    It does not restart an unhealthy one, but every long-running service has a healthcheck for
    `docker compose ps` and for what waits on it."""
    services = resolved(tmp_path, COMPOSE_PROFILES=profile)["services"]
    one_offs = {"export", "migrate"}
    for name, service in services.items():
        assert service.get("restart") == ("no" if name in one_offs else "unless-stopped"), name
        if name not in one_offs:
            assert service["healthcheck"]["test"], name
    beat = services["beat"]
    [schedule] = [arg.split("=", 1)[1] for arg in beat["command"] if arg.startswith("--schedule=")]
    directory, name = schedule.rsplit("/", 1)
    assert f"find {directory} -maxdepth 1 -name '{name}*'" in beat["healthcheck"]["test"][-1]


def test_exactly_one_beat(tmp_path: Path) -> None:
    stack = resolved(tmp_path, WORKER_REPLICAS="4", WEB_REPLICAS="3", WEB_PORTS="8080-8082")
    running_beat = [
        name for name, service in stack["services"].items() if "beat" in (service.get("command") or [])
    ]
    assert running_beat == ["beat"]
    assert stack["services"]["beat"]["deploy"]["replicas"] == 1


@pytest.mark.integration  # runs manage.py in a fresh interpreter
@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_settings_accept_the_compose_environment(tmp_path: Path, profile: str) -> None:
    stack = resolved(tmp_path, COMPOSE_PROFILES=profile)
    # In the container /run/prometheus is a tmpfs, there from the start: here a directory stands in.
    (tmp_path / "prometheus").mkdir()
    for name in ("web", "worker"):
        environment = stack["services"][name]["environment"]
        if "PROMETHEUS_MULTIPROC_DIR" in environment:
            environment["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prometheus")
        settings_check_deploy(environment)


def test_the_readme_deploy_section_documents_every_deployment_variable() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    deploy_section = readme.split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    kubernetes = REPO_ROOT / "deploy" / "kubernetes" / "base"
    variables = set(read_env_file(ENV_EXAMPLE))
    variables |= set(read_env_file(kubernetes / "config.env")) | set(
        read_env_file(kubernetes / "secret.env.example")
    )
    undocumented = sorted(name for name in variables if f"`{name}`" not in deploy_section)
    assert undocumented == []
