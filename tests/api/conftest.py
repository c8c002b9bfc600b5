"""API fixtures: the real ASGI application (in process) backed by the real Triton, two tenants, and
a real multi-worker uvicorn (`uvicorn_server`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from embeddings.models import ApiKey, EmbeddingModel, Tenant
from embeddings.services.catalog import embedding_model_register_local
from embeddings.services.keys import api_key_create
from embeddings.services.tenants import tenant_create
from embeddings.triton.server import die_with_parent, free_port
from tests.processes import REPO_ROOT, manage, stop_process_group


@dataclass
class TenantWithKey:
    tenant: Tenant
    api_key: ApiKey
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def _make_tenant(name: str) -> TenantWithKey:
    tenant = tenant_create(name=name)
    api_key, secret = api_key_create(tenant=tenant, name=f"{name} key")
    return TenantWithKey(tenant, api_key, secret)


@pytest.fixture
def api_setup(transactional_db, service_triton, service_redis, settings):
    """The local model registered, and two tenants with one key each (data committed: the ASGI
    app reads it from other threads); the test Triton and an emptied test Redis."""
    settings.API_KEY_CACHE_SECONDS = 0.2
    model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
    return {"model": model, "alpha": _make_tenant("Alpha"), "beta": _make_tenant("Beta")}


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
    """uvicorn with several worker processes, its own sqlite database and a tenant's key."""

    base_url: str
    api_key: str
    prometheus_dir: Path
    process: subprocess.Popen
    # The server's environment (its database): for `manage(server.env, ...)` in tests.
    env: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@pytest.fixture(scope="session")
def uvicorn_server(
    triton_server, redis_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """`uvicorn --workers 2` as in production (runstack), backed by the test Triton.

    PROMETHEUS_MULTIPROC_DIR is set as runstack sets it, so /metrics sums both workers.
    """
    workdir = tmp_path_factory.mktemp("uvicorn_server")
    prometheus_dir = workdir / "prometheus"
    prometheus_dir.mkdir()
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
        "TRITON_SERVER_URL": triton_server.grpc_target,
        "SERVER_PORT": str(port),
        "REDIS_URL": redis_server.url,
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    manage(env, "migrate", "--noinput")
    manage(env, "register_local_model")
    manage(env, "create_tenant", "--name", "Live", "--slug", "live")
    api_key = manage(env, "create_api_key", "--tenant", "live")
    # Only the server's workers write there (as with runstack), so their files can be counted.
    env["PROMETHEUS_MULTIPROC_DIR"] = str(prometheus_dir)
    log = (workdir / "uvicorn.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "embedsite.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
            "--loop", "uvloop", "--http", "httptools", "--ws", "websockets-sansio", "--no-access-log",
        ],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        server = LiveServer(f"http://127.0.0.1:{port}", api_key, prometheus_dir, process, env)
        _wait_until_serving(server, workdir / "uvicorn.log")
        yield server
    finally:
        stop_process_group(process)
        log.close()


def _wait_until_serving(server: LiveServer, log_path: Path, timeout_s: float = 120.0) -> None:
    """Until both workers have started (each creates its live-gauge file when it imports our
    metrics) and the server answers /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"uvicorn exited with {server.process.returncode}:\n{log_path.read_text()[-4000:]}")
        workers = len(list(server.prometheus_dir.glob("gauge_livesum_*.db")))
        if workers == 2:
            try:
                if httpx2.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
        time.sleep(0.2)
    pytest.fail(f"uvicorn did not start within {timeout_s} s:\n{log_path.read_text()[-4000:]}")
