"""API fixtures: the real ASGI application (in process) backed by the real Triton, two tenants, a
real multi-worker uvicorn (`uvicorn_server`), one with the embedding cache on in a Redis of its own
(`cache_server`) and one with small body limits and timeouts (`edge_server`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import embedding_model_register_local
from embeddings.tooling.local_redis import EMBEDDING_CACHE_EVICTION, RedisServer
from embeddings.tooling.triton_server import free_port
from tests.api.raw_http import RawHttp
from tests.conftest import TenantWithKey
from tests.database_backend import migrated_database_url
from tests.forkserver import ForkedProcess
from tests.processes import manage_commands, start_python, stop_process_group, wait_until_healthy


@pytest.fixture
def api_setup(transactional_db, two_tenants, service_triton, service_redis, settings):
    """The local model registered, and the two tenants with one key each (data committed: the ASGI
    app reads it from other threads); the test Triton and an emptied test Redis."""
    settings.API_KEY_CACHE_SECONDS = 0.2
    model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
    return {"model": model, "alpha": two_tenants.alpha, "beta": two_tenants.beta}


@pytest.fixture
def model(api_setup) -> EmbeddingModel:
    return api_setup["model"]


@pytest.fixture
def alpha(api_setup) -> TenantWithKey:
    return api_setup["alpha"]


@pytest.fixture
def beta(api_setup) -> TenantWithKey:
    return api_setup["beta"]


@pytest.fixture
async def client(api_setup) -> AsyncIterator[httpx2.AsyncClient]:
    """An HTTP client speaking to the real ASGI application (channels router included)."""
    from embedsite.asgi import application

    transport = httpx2.ASGITransport(app=application)
    async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


# --- A real server over a real socket ------------------------------------------------------------


@dataclass
class LiveServer:
    """uvicorn with several worker processes, its own database and a tenant's key."""

    base_url: str
    api_key: str
    prometheus_dir: Path
    process: subprocess.Popen | ForkedProcess
    # The server's environment (its database): for `manage(server.env, ...)` in tests.
    env: dict[str, str] | None = None
    log_path: Path | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@contextlib.contextmanager
def live_uvicorn(
    *,
    workdir: Path,
    triton_target: str,
    redis_url: str,
    workers: int = 2,
    env: dict[str, str] | None = None,
    setup: Sequence[Sequence[str]] = (),
    setup_env: dict[str, str] | None = None,
    as_shipped: bool = False,
) -> Iterator[LiveServer]:
    """`manage.py serve` as runstack runs it, with its own database on the run's backend
    (tests/database_backend.py: migrated, the local model registered, tenant `live` with a key) and
    the given settings in `env`; stopped on exit. `setup`: more manage.py commands (name, arguments)
    run after those, in the same process, with `setup_env` added to the server's settings.

    PROMETHEUS_MULTIPROC_DIR is set as runstack sets it, so /metrics sums the workers.
    `as_shipped`: a fresh interpreter runs `manage.py serve`, as runstack starts it, instead of a
    child of the fork server (tests/forkserver.py): for the tests of what `make run` serves.
    """
    prometheus_dir = workdir / "prometheus"
    prometheus_dir.mkdir()
    port = free_port()
    server_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": migrated_database_url(workdir),
        "TRITON_SERVER_URL": triton_target,
        "SERVER_PORT": str(port),
        "REDIS_URL": redis_url,
        # Its uploaded files in its own directory, not the checkout's .run/files.
        "EMBEDSITE_RUN_DIR": str(workdir),
        **(env or {}),
    }
    server_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # Only the server's workers write there (as with runstack), so their files can be counted.
    # (`server.env` stays without it: manage.py commands a test runs must not add files there.)
    process_env = {**server_env, "PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir)}
    log_path = workdir / "uvicorn.log"
    log = log_path.open("wb")
    # Started before the setup commands run: a worker reads the database only when a request needs it.
    serve = ["manage.py", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    process = start_python(
        serve, env=process_env, stdout=log, stderr=subprocess.STDOUT, fresh_interpreter=as_shipped
    )
    try:
        _, _, api_key, *_ = manage_commands(
            {**server_env, **(setup_env or {})},
            ("register_local_model",),
            ("create_tenant", "--name", "Live", "--slug", "live"),
            ("create_api_key", "--tenant", "live"),
            *setup,
        )
        server = LiveServer(
            f"http://127.0.0.1:{port}", api_key, prometheus_dir, process, server_env, log_path
        )
        # Every worker has started once each has created its live-gauge file (it imports our metrics).
        wait_until_healthy(
            process,
            server.base_url,
            log_path,
            ready=lambda: len(list(prometheus_dir.glob("gauge_livesum_*.db"))) == workers,
        )
        yield server
    finally:
        stop_process_group(process)
        log.close()


@pytest.fixture(scope="session")
def uvicorn_server(
    triton_server, redis_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """`manage.py serve --workers 2` as in production (runstack), backed by the test Triton and Redis."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("uvicorn_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        as_shipped=True,
    ) as server:
        yield server


def cache_redis(data_dir: Path, *, maxmemory_mb: int) -> RedisServer:
    """A redis-server for the embedding cache, as deployments run it, on a free port (not started):
    full, it evicts by EMBEDDING_CACHE_EVICTION (what runstack runs, and tests/deploy checks that
    Compose and Kubernetes run), and it keeps nothing across a restart."""
    return RedisServer(
        port=free_port(),
        data_dir=data_dir,
        persistent=False,
        log_path=data_dir / "redis.log",
        maxmemory_mb=maxmemory_mb,
        eviction=EMBEDDING_CACHE_EVICTION,
    )


@pytest.fixture(scope="session")
def cache_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The embedding cache's own redis-server (64 MiB): a test may kill it, as long as it starts
    it again on the same port before it ends."""
    with cache_redis(tmp_path_factory.mktemp("redis-cache"), maxmemory_mb=64) as server:
        yield server


@pytest.fixture(scope="session")
def cache_server(
    triton_server, redis_server, cache_redis_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """`manage.py serve --workers 2` with the embedding cache on, in `cache_redis_server`: no
    in-process entries (every lookup reaches Redis, so its hits show in /metrics), and 0.25 s for
    each cache operation (the shipped 0.05 s is for a Redis beside the web pods, not for a 2-core
    machine running Triton, two workers and the test's clients)."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("cache_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        env={
            "EMBEDDING_CACHE": "true",
            "EMBEDDING_CACHE_REDIS_URL": cache_redis_server.url,
            "EMBEDDING_CACHE_LOCAL_ENTRIES": "0",
            "EMBEDDING_CACHE_TIMEOUT_S": "0.25",
        },
    ) as server:
        yield server


# Small limits and timeouts, so that the HTTP edge's refusals are quick to reach. The head's size
# and field limits stay as shipped (tests/api/test_edge.py reads them from settings).
EDGE_LIMITS = {
    "MAX_REQUEST_BODY_BYTES": str(64 * 1024),
    "JOB_MAX_UPLOAD_BYTES": str(256 * 1024),
    "REQUEST_BODY_IDLE_TIMEOUT_S": "1",
    "REQUEST_BODY_TIMEOUT_S": "3",
    "REQUEST_BODY_MIN_BYTES_PER_S": str(1024 * 1024),
    "HTTP_HEAD_TIMEOUT_S": "2",
    "HTTP_KEEPALIVE_TIMEOUT_S": "1",
    "HTTP_WRITE_TIMEOUT_S": "2",
    "HTTP_MAX_CONNECTIONS": "64",
    "ADMISSION_MAX_IN_FLIGHT": "4",
    "ADMISSION_QUEUE_TIMEOUT_S": "2",
    "ADMISSION_MAX_QUEUED": "8",
}


@pytest.fixture(scope="session")
def edge_server(
    triton_server, redis_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """One uvicorn worker with EDGE_LIMITS: body limits of 64 KiB (256 KiB for an upload), a 1 s idle
    timeout and a 3 s total one; heads within 2 s, idle connections closed after 1 s, 64 connections;
    4 API requests running at once, 8 waiting at most 2 s."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("edge_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        # Its uploads' chunks go to a Redis database no test's worker reads (they are never run).
        env={**EDGE_LIMITS, "CELERY_BROKER_URL": redis_server.url.rsplit("/", 1)[0] + "/15"},
    ) as server:
        yield server


@pytest.fixture
def raw(edge_server) -> Iterator[RawHttp]:
    """One raw HTTP/1.1 connection to `edge_server`."""
    with RawHttp(edge_server) as connection:
        yield connection
