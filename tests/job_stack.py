"""A whole jobs stack for end-to-end tests: uvicorn serving the API and a real Celery worker
(real Triton, real Redis, one database shared by both, on the run's backend), with a tenant and its
API key."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from embeddings.tooling.triton_server import free_port
from tests.database_backend import migrated_database_url
from tests.processes import DjangoShell, start_celery, start_python, stop_process_groups, wait_until_healthy


@dataclass
class JobStack:
    base_url: str
    api_key: str
    env: dict[str, str]  # the servers' environment (settings, database file), for manage.py commands
    logs: list[Path]
    django: DjangoShell  # runs scripts and commands as manage.py does, in `env` (one Django start)
    # The Celery worker's process (its own group): tests may pause it (SIGSTOP) or kill it.
    worker: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def logs_tail(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in self.logs)


@contextlib.contextmanager
def job_stack_running(
    *, triton_server, redis_server, workdir: Path, chunk_size: int, extra_env: dict[str, str] | None = None
) -> Iterator[JobStack]:
    """A migrated database of its own (tests/database_backend.py), the local model registered,
    tenant `jobs` with a key, uvicorn and a worker (both with `extra_env` on top of the stack's
    settings), and a DjangoShell in the same settings that ran the setup commands; all stopped on exit."""
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": migrated_database_url(workdir),
        "TRITON_SERVER_URL": triton_server.grpc_target,
        "REDIS_URL": redis_server.url,
        "CELERY_BROKER_URL": redis_server.url,
        "EMBEDSITE_RUN_DIR": str(workdir),
        "JOB_CHUNK_SIZE": str(chunk_size),
        **(extra_env or {}),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    server_log = workdir / "uvicorn.log"
    worker_log = workdir / "worker.log"
    # Both start while the setup commands run: each reads the database only once a request or a
    # task needs it, and the test sends none before the stack is up.
    with server_log.open("wb") as log:
        server = start_python(
            ["manage.py", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    worker = start_celery("worker", worker_log, env=env)
    django = DjangoShell(env, workdir / "shell.log")
    try:
        *_, api_key = django.commands(
            ("register_local_model",),
            ("create_tenant", "--name", "Jobs", "--slug", "jobs"),
            ("create_api_key", "--tenant", "jobs"),
        )
        stack = JobStack(f"http://127.0.0.1:{port}", api_key, env, [server_log, worker_log], django, worker)
        wait_until_healthy(server, stack.base_url, server_log)
        yield stack
    finally:
        django.close()
        stop_process_groups(worker, server)
