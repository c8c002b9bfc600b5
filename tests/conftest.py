"""Shared fixtures: one real Triton and Redis per test run, started on free loopback ports, and the
two tenants (`two_tenants`) that isolation tests build on."""

from __future__ import annotations

import gc
import itertools
import json
import os
import shutil
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from embeddings.tooling.export_threads import EXPORT_THREADS_VARIABLE, limit_torch_threads
from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import TritonServer, free_port
from tests.database_backend import flush_restoring_content_types, is_postgresql, run_databases
from tests.shared_services import SharedServices

if TYPE_CHECKING:
    from embeddings.models import ApiKey, Tenant

TESTS_DIR = Path(__file__).resolve().parent
TEST_MODEL_REPOSITORY = TESTS_DIR / "triton_models"


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """The shipped algorithm at 1,000 iterations instead of 1,000,000 (0.3 CPU-s a password), in the
    test processes only: the hashes made here (the admin users tests create, their logins) are still
    pbkdf2_sha256, which the servers the tests start verify with the shipped hashers. What the tests
    check is lockout and permissions, not the cost of a hash (Django's advice for test settings)."""

    iterations = 1_000


def share_verifying_ssl_contexts() -> None:
    """One verifying SSL context per test process for httpx2's and httpx's (the SDKs') clients,
    instead of one per client: each loaded the system's CA bundle afresh, and tests make a client per
    call (`httpx2.get` in every poll of a server's /health, an SDK client per test), which was 13 % of
    the pytest processes' CPU. A context asked for with a client certificate or another `verify` is
    still made afresh; nothing here mutates the shared one."""
    import httpx._transports.default
    import httpx2._transports.default

    for transport in (httpx._transports.default, httpx2._transports.default):
        transport.create_ssl_context = _sharing_the_default(transport.create_ssl_context)


def _sharing_the_default(create_ssl_context):
    made = {}

    def create_or_share(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in made:
            made[trust_env] = create_ssl_context(verify=True, cert=None, trust_env=trust_env)
        return made[trust_env]

    return create_or_share


def pytest_runtest_setup(item: pytest.Item) -> None:
    """PyTorch in the test processes (the exports' checks against PyTorch, the tests' references) on
    EXPORT_THREADS threads, one here (pytest_configure), once it is imported: its OpenMP threads spin
    while they wait for each other, and beside the other workers on two cores that cost the export
    tests a fifth of their CPU (208 CPU-s against 169 for tests/model_export with the torch backend's
    tests, three workers). Servers and Triton that tests start keep their own settings."""
    torch = sys.modules.get("torch")
    if torch is not None:
        limit_torch_threads(torch)


def pytest_configure(config: pytest.Config) -> None:
    # Exports (here and in the commands tests start) and the tests' ONNX Runtime references, which
    # open their sessions as exports do, on one thread (embeddings/tooling/export_threads.py).
    os.environ.setdefault(EXPORT_THREADS_VARIABLE, "1")
    settings.PASSWORD_HASHERS = [f"{__name__}.QuickPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]
    share_verifying_ssl_contexts()
    flush_restoring_content_types()


def require_exported_model(repository: Path, name: str = "minilm") -> Path:
    model_file = repository / name / "1" / "model.onnx"
    if not model_file.exists():
        pytest.fail(
            f"{model_file} is missing: the setup exports it (`make setup`, or "
            "`python manage.py export_model --if-missing`)",
            pytrace=False,
        )
    return model_file


def start_triton(run_dir: Path, repositories: list[Path], *, name: str = "triton", **options) -> TritonServer:
    """A Triton on free ports, ready. A teardown with nothing left to check ends it with
    `stop(timeout_s=0)`: killed at once, not the 3-10 s graceful unload that
    tests/triton/test_server_process_group.py and the runstack tests check."""
    server = TritonServer(
        model_repositories=repositories,
        run_dir=run_dir,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=run_dir / f"{name}.log",
        **options,
    )
    server.start()
    server.wait_until_ready(settings.TRITON_STARTUP_TIMEOUT_S)
    return server


def session_triton_repositories() -> list[Path]:
    """What the run's Triton serves: model_repository/ and the test-only models."""
    repository = Path(settings.TRITON_MODEL_REPOSITORY)
    require_exported_model(repository)
    return [repository, TEST_MODEL_REPOSITORY]


@pytest.fixture(scope="session")
def shared_services() -> SharedServices | None:
    """The services `make test-services` keeps up, when EMBEDSITE_TEST_SERVICES names them."""
    try:
        return SharedServices.from_environment()
    except RuntimeError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def triton_server(
    tmp_path_factory: pytest.TempPathFactory, shared_services: SharedServices | None
) -> Iterator[TritonServer]:
    """The real Triton serving model_repository/ and the test-only models."""
    if shared_services is not None:
        described = shared_services.triton
        server = TritonServer(
            model_repositories=[Path(path) for path in described["repositories"]],
            run_dir=Path(described["run_dir"]),
            grpc_port=described["grpc_port"],
            http_port=described["http_port"],
            metrics_port=described["metrics_port"],
            log_path=Path(described["log_path"]),
        )
        if not server.is_ready():
            pytest.exit(f"the shared Triton ({server.grpc_target}) is not ready: `make test-services`", 4)
        yield server
        return
    server = start_triton(tmp_path_factory.mktemp("triton"), session_triton_repositories())
    yield server
    server.stop(timeout_s=0)


@pytest.fixture(scope="session")
def second_triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Another Triton serving model_repository/: a second replica beside `triton_server`."""
    server = start_triton(
        tmp_path_factory.mktemp("replica"), [Path(settings.TRITON_MODEL_REPOSITORY)], name="replica"
    )
    yield server
    server.stop(timeout_s=0)


def write_finished_export(
    repository: Path, *, dims: int = 384, max_tokens: int = 256, version: int = 1, extra: dict | None = None
) -> None:
    """A finished minilm `version` as far as the catalog reads it (no Triton loads it): model.onnx and
    tokenizer.json in place, export.json (written last) describing them, plus `extra`'s fields."""
    version_dir = repository / "minilm" / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.onnx").write_bytes(b"not read by the catalog")
    (version_dir / "tokenizer.json").write_text("{}")
    info = {"name": "minilm", "pooling": "mean", "dims": dims, "max_tokens": max_tokens, **(extra or {})}
    (version_dir / "export.json").write_text(json.dumps(info))


def serving_model_folder(repository: Path, name: str, *, source: str = "minilm", versions=(1,)) -> Path:
    """A real model folder `name` in `repository` serving the exported `source` (its version 1
    files in each of `versions`), with its config renamed (Triton refuses a config
    name other than its folder's) and one instance (enough for tests, half the memory)."""
    source_dir = Path(settings.TRITON_MODEL_REPOSITORY) / source
    require_exported_model(source_dir.parent, source)
    model_dir = repository / name
    model_dir.mkdir(parents=True)
    for version in versions:
        (model_dir / str(version)).mkdir()
        # Files only: a checkout from before the backend moved may hold 1/__pycache__.
        for file in (source_dir / "1").iterdir():
            if not file.is_file():
                continue
            # model.onnx linked (90 MB); the small files copied, so that no test writing into
            # this folder can write through a link into the checkout's export.
            if file.name == "model.onnx":
                (model_dir / str(version) / file.name).symlink_to(file)
            else:
                shutil.copyfile(file, model_dir / str(version) / file.name)
    config = (source_dir / "config.pbtxt").read_text()
    config = config.replace(f'name: "{source}"', f'name: "{name}"').replace("count: 2", "count: 1")
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


@dataclass
class ExplicitTriton:
    """A Triton in explicit model-control mode on its own repository: nothing loaded at start."""

    server: TritonServer
    repository: Path

    def unload_all(self) -> None:
        """Back to nothing loaded (each test starts from there)."""
        for folder in self.repository.iterdir():
            request = urllib.request.Request(
                f"{self.server.http_url}/v2/repository/models/{folder.name}/unload", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(request, timeout=60):
                pass
        # An unload returns before the stubs end: wait until the index says so.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            request = urllib.request.Request(f"{self.server.http_url}/v2/repository/index", data=b"{}")
            with urllib.request.urlopen(request, timeout=10) as reply:
                index = json.loads(reply.read())
            if not any(entry.get("state") in {"READY", "LOADING", "UNLOADING"} for entry in index):
                return
            time.sleep(0.1)
        raise AssertionError(f"Triton did not unload its models: {index}")


@pytest.fixture(scope="session")
def explicit_triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExplicitTriton]:
    """The real Triton with --model-control-mode=explicit on a repository of two models: minilm
    (versions 1 and 2, the same files), minilm_copy (version 1) and `broken` (a backend Triton
    does not have: its loads fail), nothing loaded."""
    repository = tmp_path_factory.mktemp("explicit_repository")
    serving_model_folder(repository, "minilm", versions=(1, 2))
    serving_model_folder(repository, "minilm_copy")
    # A finished export whose configuration names a backend Triton does not have.
    serving_model_folder(repository, "broken")
    (repository / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "no_such_backend"\n')
    server = start_triton(
        tmp_path_factory.mktemp("explicit_triton"), [repository], model_control_mode="explicit"
    )
    yield ExplicitTriton(server, repository)
    server.stop(timeout_s=0)


@pytest.fixture
def explicit_triton(explicit_triton_server: ExplicitTriton, settings) -> Iterator[ExplicitTriton]:
    """The service pointed at `explicit_triton_server` (its Triton and its repository), which
    starts with nothing loaded."""
    from embeddings.services.inference.clients import reset_clients

    explicit_triton_server.unload_all()
    settings.TRITON_GRPC_TARGET = explicit_triton_server.server.grpc_target
    settings.TRITON_MODEL_REPOSITORY = explicit_triton_server.repository
    reset_clients()
    yield explicit_triton_server
    reset_clients()


@pytest.fixture
def service_triton(triton_server: TritonServer, settings) -> Iterator[TritonServer]:
    """Point the service's Triton clients (embeddings.services.inference.clients) at the test Triton."""
    from embeddings.services.inference.clients import reset_clients

    settings.TRITON_GRPC_TARGET = triton_server.grpc_target
    reset_clients()
    yield triton_server
    reset_clients()


# --- Tenants ---------------------------------------------------------------------------------------


@dataclass
class TenantWithKey:
    tenant: Tenant
    api_key: ApiKey
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def tenant_with_key(name: str, *, allow_all_models: bool = True, **key_options) -> TenantWithKey:
    """A new tenant and one key of it (`key_options`: api_key_create's, e.g. expires_at)."""
    from embeddings.services.accounts.api_keys import api_key_create
    from embeddings.services.accounts.tenants import tenant_create

    tenant = tenant_create(name=name, allow_all_models=allow_all_models)
    api_key, secret = api_key_create(tenant=tenant, name=f"{name} key", **key_options)
    return TenantWithKey(tenant, api_key, secret)


@pytest.fixture
def alpha(db) -> Tenant:
    """A tenant (all models allowed, no limits, no key); `beta` is the other one, which must not
    see or touch what is Alpha's. tests/api overrides both with a tenant and its key."""
    from embeddings.services.accounts.tenants import tenant_create

    return tenant_create(name="Alpha")


@pytest.fixture
def beta(db) -> Tenant:
    from embeddings.services.accounts.tenants import tenant_create

    return tenant_create(name="Beta")


@dataclass(frozen=True)
class TwoTenants:
    alpha: TenantWithKey
    beta: TenantWithKey


@pytest.fixture
def two_tenants(db) -> TwoTenants:
    """Alpha and Beta as `alpha` and `beta`, with one key each: isolation tests give Beta's key
    what is Alpha's and expect it refused. With transactional_db requested too, the rows are
    committed (pytest-django then prefers it to `db`)."""
    return TwoTenants(tenant_with_key("Alpha"), tenant_with_key("Beta"))


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings) -> None:
    """pytest-django's hook before it creates the test database: this run's PostgreSQL (if the
    run is on PostgreSQL, tests/database_backend.py) is started first."""
    run_databases().ensure_started()


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup) -> Iterator[None]:
    """pytest-django's test database, and at the end, before it is dropped, the sessions that
    threads left open on it ended (asgiref's executors keep theirs; PostgreSQL will not drop a
    database in use)."""
    yield
    from django.db import connections

    connections.close_all()
    run_databases().end_sessions(connections["default"].settings_dict["NAME"])


@pytest.fixture
def postgresql_only() -> None:
    """For races only PostgreSQL has (row locks under READ COMMITTED): skipped on SQLite, which
    serialises every write."""
    if not is_postgresql():
        pytest.skip("a PostgreSQL race: this run is on SQLite (--database sqlite)")


def _session_redis(
    tmp_path_factory: pytest.TempPathFactory, name: str, shared: dict | None
) -> Iterator[RedisServer]:
    if shared is not None:
        server = RedisServer(
            port=shared["port"],
            data_dir=Path(shared["data_dir"]),
            persistent=False,
            log_path=Path(shared["log_path"]),
        )
        if not server.is_ready():
            pytest.exit(f"the shared {name} ({server.url}) does not answer: `make test-services`", 4)
        yield server
        return
    data_dir = tmp_path_factory.mktemp(name)
    with RedisServer(
        port=free_port(), data_dir=data_dir, persistent=False, log_path=data_dir / "redis.log"
    ) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(
    tmp_path_factory: pytest.TempPathFactory, shared_services: SharedServices | None
) -> Iterator[RedisServer]:
    """A real redis-server of our own on a free port, without persistence."""
    yield from _session_redis(tmp_path_factory, "redis", shared_services and shared_services.redis)


@pytest.fixture(scope="session")
def job_store_server(
    tmp_path_factory: pytest.TempPathFactory, shared_services: SharedServices | None
) -> Iterator[RedisServer]:
    """A second redis-server: the job store, apart from the critical Redis as deployments run it."""
    yield from _session_redis(tmp_path_factory, "redis-jobs", shared_services and shared_services.job_store)


@pytest.fixture
def service_redis(
    redis_server: RedisServer, job_store_server: RedisServer, settings
) -> Iterator[RedisServer]:
    """Point the service's Redis clients (Celery's broker, the channel layer) at the test Redis, and
    the job store at the second one (JOB_STORE_URL), both emptied first."""
    from embeddings.redis.connections import redis_job_store, redis_sync, reset_redis_clients

    settings.REDIS_URL = redis_server.url
    settings.JOB_STORE_URL = job_store_server.url
    settings.CELERY_BROKER_URL = redis_server.url
    # Job progress events (services/jobs/events.py) go to the test Redis too, never a developer's own.
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [redis_server.url], "prefix": "test:channels:"},
        }
    }
    reset_redis_clients()
    redis_sync().flushdb()
    redis_job_store().flushdb()
    yield redis_server
    reset_redis_clients()


# Words of one wordpiece each in MiniLM's vocabulary.
ONE_TOKEN_WORDS = (
    "apple river stone cloud house green music water light table paper horse garden window bridge summer"
).split()


def texts_of_one_length(count: int) -> list[str]:
    """`count` texts no test embedded before (a fresh marker: the embedding cache's Redis lives as
    long as the run), all of one length in tokens. Triton pads a batch to its longest row and runs a
    batch of one row through other kernels, and either can move a row's last bits: rows of one
    length, sent two or more a call, are computed alike whatever else they are batched with, so a
    cache hit can be compared with a computed row bit for bit."""
    marker = uuid.uuid4().hex[:12]
    pairs = itertools.product(ONE_TOKEN_WORDS, repeat=2)
    return [f"{marker} {first} {second} about caches" for first, second in itertools.islice(pairs, count)]


@pytest.fixture
def embedding_cache(settings, job_store_server: RedisServer) -> Iterator[RedisServer]:
    """The embedding cache on, in the job store's Redis (not emptied: tests embed texts of their
    own), with a timeout a loaded machine's lookups meet, and no entries left in this process."""
    from embeddings.redis.connections import reset_redis_clients
    from embeddings.services.inference.vector_cache import vector_cache_clear_local

    settings.EMBEDDING_CACHE = True
    settings.EMBEDDING_CACHE_REDIS_URL = job_store_server.url
    settings.EMBEDDING_CACHE_TIMEOUT_S = 2.0
    reset_redis_clients()
    vector_cache_clear_local()
    yield job_store_server
    vector_cache_clear_local()
    reset_redis_clients()


class FakeDns:
    """The callback resolver in tests: names answer from `answers` only, so no lookup leaves the
    machine (a fuzzer's `https://0.com` included). Each lookup takes the next answer of a name's
    list, the last one again once the list is used up (a name that answers differently later)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[list[str]]] = {"localhost": [["127.0.0.1", "::1"]]}
        self.lookups: list[str] = []

    def set(self, name: str, *answers: list[str]) -> None:
        self.answers[name] = list(answers)

    def __call__(self, host: str, port: int, timeout_s: float) -> list[str]:
        from embeddings.services.jobs.callback_targets import CallbackHostUnresolved

        self.lookups.append(host)
        answers = self.answers.get(host)
        if not answers:
            raise CallbackHostUnresolved(f"{host} does not resolve (test resolver)")
        return answers.pop(0) if len(answers) > 1 else answers[0]


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> FakeDns:
    """Every in-process test resolves callback hosts with a FakeDns (processes a test starts use
    the real resolver: give them literal addresses or localhost)."""
    from embeddings.services.jobs import callbacks as job_callbacks

    resolver = FakeDns()
    monkeypatch.setattr(job_callbacks, "callback_resolver", resolver)
    return resolver


# --- Markers ---------------------------------------------------------------------------------------

# Fixtures that start or reach a server or a process: the database (and everything built on it),
# Triton, Redis, a copy of the project run in fresh interpreters. Fixtures that start uvicorn,
# Celery or a browser build on one of these.
SERVER_FIXTURES = frozenset(
    {
        "django_db_setup",
        "db",
        "transactional_db",
        "live_server",
        "triton_server",
        "explicit_triton_server",
        "redis_server",
        "job_store_server",
        "project_copy",
    }
)
# Modules whose tests start Triton, Redis, uvicorn or a torch export themselves (no fixture above
# says so): never `unit`, except the tests in them marked `unit` by hand.
PROCESS_MODULES = frozenset(
    {
        "api/test_no_key_in_logs.py",
        "deploy/test_triton_configs.py",
        "management/test_runstack.py",
        "model_export/test_calibration_export.py",
        "model_export/test_export.py",
        "model_export/test_served_model.py",
        "model_export/test_tiny_export.py",
        "model_export/test_cross_encoder_export.py",
        "multihost/test_scale_out.py",
        "reliability/test_faults.py",
        "services/test_embedding.py",
        "services/test_redis.py",
        "test_production_settings.py",
        "triton/test_client.py",
        "triton/test_repository_api.py",
        "triton/test_server_process_group.py",
        "triton/test_torch_backend.py",
    }
)


def _needs_no_server(item: pytest.Item) -> bool:
    if item.get_closest_marker("integration") or item.get_closest_marker("django_db"):
        return False
    if item.path.resolve().relative_to(TESTS_DIR).as_posix() in PROCESS_MODULES:
        return False
    return SERVER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


# The longest test files (setup included), longest first: `make test` hands files to its workers in
# collection order (pytest-xdist --dist loadfile), so these start first and the run does not end
# waiting for one of them started last. Re-measure with `--durations=0` after adding a long one.
LONGEST_FILES = (
    "batch_api/test_batches_sdk.py",
    "multihost/test_scale_out.py",
    "reliability/test_faults.py",
    "reliability/test_worker_recovery.py",
    "reliability/test_schemathesis.py",
    "admin/test_browser.py",
    "model_serving/test_second_model.py",
    "api/test_fair_inference.py",
    "management/test_runstack.py",
    "reliability/test_worker_shutdown.py",
    "test_job_tasks.py",
    "triton/test_server_process_group.py",
    "triton/test_torch_backend.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.path.resolve().relative_to(TESTS_DIR).as_posix()
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `unit` every test that needs no server: no database, Triton, Redis or process of its
    own (its fixtures, however deep, include none of SERVER_FIXTURES; not in PROCESS_MODULES; not
    marked `integration`). `python -m pytest -m unit` runs them alone. Then the LONGEST_FILES first
    (a stable sort: each file's tests keep their order)."""
    for item in items:
        if not item.get_closest_marker("unit") and _needs_no_server(item):
            item.add_marker(pytest.mark.unit)
    items.sort(key=_longest_first)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported and built stays for the whole run: into the collector's permanent
    generation, so that each full collection no longer traverses it (a tenth of the pytest
    processes' CPU went to the collector, perf over a PostgreSQL pass)."""
    gc.freeze()
