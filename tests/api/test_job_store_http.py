"""A full job store as a client meets it, through uvicorn on a socket: a job is refused with 503
`job_store_unavailable` in OpenAI's error shape, nothing is kept, and the rest of the API answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import redis

from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port
from tests.api.conftest import live_uvicorn
from tests.services.test_stores import BIG_JOB_TEXTS, fill_job_store, job_keys_besides_the_filler

JOB_STORE_MAXMEMORY_MB = 8


@pytest.fixture
def full_job_store(tmp_path: Path) -> Iterator[RedisServer]:
    """A job store of its own, filled to its maxmemory (noeviction) before the server starts."""
    with RedisServer(
        port=free_port(), data_dir=tmp_path / "jobs", persistent=False, maxmemory_mb=JOB_STORE_MAXMEMORY_MB
    ) as server:
        fill_job_store(redis.Redis.from_url(server.url), JOB_STORE_MAXMEMORY_MB)
        yield server


def test_a_full_job_store_refuses_jobs_with_503_and_the_rest_answers(redis_server, full_job_store, tmp_path):
    # No Triton behind it (nothing listens on that loopback port): submitting a job needs none.
    with (
        live_uvicorn(
            workdir=tmp_path,
            triton_target=f"127.0.0.1:{free_port()}",
            redis_url=redis_server.url,
            workers=1,
            env={"JOB_STORE_URL": full_job_store.url},
        ) as server,
        httpx2.Client(base_url=server.base_url, headers=server.headers, timeout=30) as http,
    ):
        refused = http.post("/v1/jobs", json={"model": "all-MiniLM-L6-v2", "input": BIG_JOB_TEXTS})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "30"
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "server_error",
            "job_store_unavailable",
            None,
        )
        assert "job store is full" in error["message"]
        assert job_keys_besides_the_filler(redis.Redis.from_url(full_job_store.url)) == []
        assert http.get("/v1/jobs").json()["data"] == []
        # The critical Redis still counts and answers: usage, and /ready's two Redis checks.
        assert http.get("/v1/usage").status_code == 200
        checks = http.get("/ready").json()["checks"]
        assert checks["redis"] == checks["job_store"] == "ok"
