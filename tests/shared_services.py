"""The services a test run shares, kept up between runs for the inner loop: `make test-services`
starts the run's Triton (model_repository/ and tests/triton_models/), its two Redis servers (the
critical one and the job store) and its PostgreSQL cluster, writes where they listen to
SERVICES_FILE and stays in the foreground until Ctrl-C. A pytest run with EMBEDSITE_TEST_SERVICES
naming that file uses them instead of starting its own (tests/conftest.py's session fixtures,
tests/database_backend.py), so one area's tests start in seconds:

    EMBEDSITE_TEST_SERVICES=.run/test-services.json .venv/bin/python -m pytest tests/api/test_embeddings.py

One pytest process at a time (no `-n`): tests empty the Redis databases they use.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES_FILE = REPO_ROOT / ".run" / "test-services.json"
ENVIRONMENT_VARIABLE = "EMBEDSITE_TEST_SERVICES"


@dataclass(frozen=True)
class SharedServices:
    """Where `make test-services` runs each service (SERVICES_FILE's content)."""

    triton: dict
    redis: dict
    job_store: dict
    postgresql: dict

    @classmethod
    def from_environment(cls) -> SharedServices | None:
        """The services EMBEDSITE_TEST_SERVICES names; None when it is unset (each run starts its own)."""
        path = os.environ.get(ENVIRONMENT_VARIABLE)
        if not path:
            return None
        if os.environ.get("PYTEST_XDIST_WORKER"):
            raise RuntimeError(
                f"{ENVIRONMENT_VARIABLE} serves one pytest process: run without -n (tests empty its Redis)"
            )
        try:
            return cls(**json.loads(Path(path).read_text()))
        except OSError as error:
            raise RuntimeError(
                f"{ENVIRONMENT_VARIABLE}={path}: {error.strerror}; start them with `make test-services`"
            ) from error


def _redis_description(server) -> dict:
    return {"port": server.port, "data_dir": str(server.data_dir), "log_path": str(server.log_path)}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    import django

    django.setup()
    from embeddings.tooling.local_redis import RedisServer
    from embeddings.tooling.triton_server import free_port
    from tests.conftest import session_triton_repositories, start_triton
    from tests.database_backend import MAIN_DATABASE
    from tests.postgres_server import PostgresServer

    run_dir = Path(tempfile.mkdtemp(prefix="embedsite-test-services-"))
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    started = []
    try:
        redis_servers = []
        for name in ("redis", "redis-jobs"):
            server = RedisServer(
                port=free_port(),
                data_dir=run_dir / name,
                persistent=False,
                log_path=run_dir / name / "redis.log",
            )
            server.start()
            started.append(server)
            server.wait_until_ready()
            redis_servers.append(server)
        postgres = PostgresServer(port=free_port())
        started.append(postgres)
        postgres.start()
        postgres.wait_until_ready()
        postgres.create_database(MAIN_DATABASE)
        triton = start_triton(run_dir / "triton", session_triton_repositories())
        started.append(triton)
        description = {
            "triton": {
                "repositories": [str(path) for path in triton.model_repositories],
                "run_dir": str(triton.run_dir),
                "log_path": str(triton.log_path),
                "grpc_port": triton.grpc_port,
                "http_port": triton.http_port,
                "metrics_port": triton.metrics_port,
            },
            "redis": _redis_description(redis_servers[0]),
            "job_store": _redis_description(redis_servers[1]),
            "postgresql": {"port": postgres.port, "password": postgres.password},
        }
        SERVICES_FILE.parent.mkdir(exist_ok=True)
        SERVICES_FILE.write_text(json.dumps(description, indent=2))
        print(
            f"Triton {triton.grpc_target}, Redis {redis_servers[0].url} and {redis_servers[1].url}, "
            f"PostgreSQL 127.0.0.1:{postgres.port} are up; in another shell:\n"
            f"  {ENVIRONMENT_VARIABLE}={SERVICES_FILE.relative_to(REPO_ROOT)} "
            ".venv/bin/python -m pytest tests/...\nCtrl-C stops them.",
            flush=True,
        )
        stopped.wait()
    finally:
        SERVICES_FILE.unlink(missing_ok=True)
        for server in reversed(started):
            server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
