"""Jobs run by real `celery -A embedsite worker` processes (started as runstack starts them) against
the test Redis servers (the critical one and the job store, two servers as deployed), the test
Triton and a database shared with the test (on the run's backend); jobs are
submitted by scripts run as `manage.py shell` runs them (one Django process for the module,
tests/processes.py DjangoShell), as the web process would. Shared by tests/test_job_tasks.py
and tests/reliability/."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from embeddings.redis.connections import redis_sync
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, parse_usage_field
from tests.database_backend import DatabaseReader, migrated_database_url
from tests.processes import DjangoShell, start_celery, stop_process_groups

SUBMIT = """
import json
from django.conf import settings
from django.test import override_settings
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs.submission import JobSpec, job_create
model = EmbeddingModel.objects.get(name=settings.DEFAULT_EMBEDDING_MODEL)
ids = []
with override_settings(JOB_CHUNK_SIZE={chunk_size!r} or settings.JOB_CHUNK_SIZE):
    for slug, texts in {jobs!r}:
        tenant = Tenant.objects.get(slug=slug)
        job, _ = job_create(tenant_id=tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=texts))
        ids.append(job.pk)
print(json.dumps(ids))
"""

COMPARE = """
import json
import numpy as np
from embeddings.models import EmbeddingJob
from embeddings.services.inference.embedding import embeddings_create_sync
from embeddings.services.jobs.kinds import job_embedding_target
from embeddings.services.jobs.reads import job_results_source
job = EmbeddingJob.objects.select_related("model").get(pk={job_id})
store, rows, dims = job_results_source(job)
stored = np.concatenate([store.chunk_result(chunk, dims) for chunk in range(len(rows))])
# The job's own inputs are deleted once it ends: the test gives the texts it submitted.
expected = embeddings_create_sync(target=job_embedding_target(job.model), texts={texts!r})
print(json.dumps([stored.shape[0], float(np.abs(stored - expected.vectors).max()), expected.total_tokens]))
"""


@dataclass
class JobStack:
    workdir: Path
    env: dict[str, str]
    database: DatabaseReader  # the stack's database, for the test's reads (one connection)
    django: DjangoShell  # runs scripts as `manage.py shell -c` does, in the stack's environment

    def shell(self, script: str) -> str:
        """The last line `script` prints, run as `manage.py shell -c` runs it."""
        return self.django.run(script).splitlines()[-1]

    def submit(self, jobs: list[tuple[str, list[str]]], chunk_size: int | None = None) -> list[int]:
        """Submit (tenant slug, texts) jobs, in chunks of `chunk_size` (None: JOB_CHUNK_SIZE)."""
        return json.loads(self.shell(SUBMIT.format(jobs=jobs, chunk_size=chunk_size)))

    def compare(self, job_id: int, texts: list[str]) -> list:
        """[rows stored, largest difference from the synchronous vectors of `texts`, their tokens]."""
        return json.loads(self.shell(COMPARE.format(job_id=job_id, texts=texts)))

    def job(self, job_id: int) -> dict:
        (row,) = self.database.rows("SELECT * FROM embeddings_embeddingjob WHERE id = %s", job_id)
        return row

    def wait(self, job_id: int, statuses: set[str], logs: list[Path], timeout_s: float = 120) -> dict:
        """Until the job reaches one of `statuses` (a deadline against hanging, not a timing)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            time.sleep(0.1)
        text = "\n".join(f"--- {log}\n{log.read_text()[-4000:]}" for log in logs)
        pytest.fail(f"job {job_id} is {self.job(job_id)}, not {statuses}:\n{text}")


@pytest.fixture(scope="module")
def job_stack(redis_server, job_store_server, triton_server, tmp_path_factory) -> Iterator[JobStack]:
    workdir = tmp_path_factory.mktemp("jobs")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": migrated_database_url(workdir),
        "REDIS_URL": redis_server.url,
        "CELERY_BROKER_URL": redis_server.url,
        "JOB_STORE_URL": job_store_server.url,
        "TRITON_SERVER_URL": triton_server.grpc_target,
        "EMBEDSITE_RUN_DIR": str(workdir),
        "JOB_CHUNK_SIZE": "4",
        "USAGE_FOLD_INTERVAL_S": "3600",  # job usage stays in Redis, to be counted here
    }
    stack = JobStack(
        workdir, env, DatabaseReader(env["DATABASE_URL"]), DjangoShell(env, workdir / "shell.log")
    )
    stack.django.commands(
        ("register_local_model",),
        *(("create_tenant", "--name", slug.title(), "--slug", slug) for slug in ("alpha", "beta")),
    )
    yield stack
    stack.django.close()
    stack.database.close()


@pytest.fixture
def start_worker(job_stack, service_redis, tmp_path) -> Iterator:
    """Starts `celery worker` (solo pool: one process, one chunk at a time) or beat; stops them after."""
    processes = []

    def start(role: str = "worker", **env: str):
        log_path = tmp_path / f"{role}-{len(processes)}.log"
        process = start_celery(role, log_path, env={**job_stack.env, **env})
        processes.append(process)
        return process, log_path

    yield start
    stop_process_groups(*processes)


def texts(prefix: str, count: int) -> list[str]:
    return [f"{prefix} text number {index}, about something" for index in range(count)]


def job_usage(tenant_id: int | None = None) -> dict[str, int]:
    """The jobs endpoint's usage counters in Redis, by metric."""
    totals: dict[str, int] = {}
    for field, value in redis_sync().hgetall(LIVE_USAGE_KEY).items():
        bucket, metric = parse_usage_field(field.decode())
        if bucket.endpoint == "jobs" and (tenant_id is None or bucket.tenant_id == tenant_id):
            totals[metric] = totals.get(metric, 0) + int(value)
    return totals
