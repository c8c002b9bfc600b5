"""Embedding jobs run by real `celery -A embedsite worker` processes (started as runstack starts them)
against the test Redis, the test Triton and a sqlite database file shared with the test; jobs are
submitted by `manage.py shell` against that file, as the web process would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from embeddings.management.commands.runstack import start_celery
from embeddings.services.job_callbacks import SIGNATURE_HEADER, callback_signature_valid
from embeddings.services.redis_clients import redis_sync
from embeddings.services.usage import LIVE_USAGE_KEY
from embeddings.triton.server import free_port
from tests.processes import manage, stop_process_group

SUBMIT = """
import json
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs import JobSpec, job_create
model = EmbeddingModel.objects.get()
ids = []
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
from embeddings.services.embedding import EmbeddingTarget, embeddings_create_sync
from embeddings.services.jobs import job_results_source
job = EmbeddingJob.objects.select_related("model").get(pk={job_id})
store, rows, dims = job_results_source(job)
stored = np.concatenate([store.chunk_result(chunk, dims) for chunk in range(len(rows))])
texts = [text for chunk in range(len(rows)) for text in store.chunk_inputs(chunk)]
expected = embeddings_create_sync(target=EmbeddingTarget.for_model(job.model), texts=texts)
print(json.dumps([stored.shape[0], float(np.abs(stored - expected.vectors).max()), expected.total_tokens]))
"""


@dataclass
class JobStack:
    path: Path
    env: dict[str, str]

    def submit(self, jobs: list[tuple[str, list[str]]]) -> list[int]:
        return json.loads(manage(self.env, "shell", "-c", SUBMIT.format(jobs=jobs)).splitlines()[-1])

    def compare(self, job_id: int) -> list:
        return json.loads(manage(self.env, "shell", "-c", COMPARE.format(job_id=job_id)).splitlines()[-1])

    def job(self, job_id: int) -> dict:
        with contextlib.closing(sqlite3.connect(self.path, timeout=10)) as connection:
            connection.row_factory = sqlite3.Row
            row = connection.execute(
                "SELECT * FROM embeddings_embeddingjob WHERE id = ?", (job_id,)
            ).fetchone()
        return dict(row)

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
def job_stack(redis_server, triton_server, tmp_path_factory) -> JobStack:
    workdir = tmp_path_factory.mktemp("jobs")
    path = workdir / "db.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": f"sqlite:///{path}",
        "REDIS_URL": redis_server.url,
        "CELERY_BROKER_URL": redis_server.url,
        "TRITON_SERVER_URL": triton_server.grpc_target,
        "EMBEDSITE_RUN_DIR": str(workdir),
        "JOB_CHUNK_SIZE": "4",
        "USAGE_FOLD_INTERVAL_S": "3600",  # job usage stays in Redis, to be counted here
    }
    manage(env, "migrate", "--noinput")
    manage(env, "register_local_model")
    for slug in ("alpha", "beta"):
        manage(env, "create_tenant", "--name", slug.title(), "--slug", slug)
    return JobStack(path, env)


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
    for process in processes:
        stop_process_group(process)


def texts(prefix: str, count: int) -> list[str]:
    return [f"{prefix} text number {index}, about something" for index in range(count)]


def job_usage(tenant_id: int | None = None) -> dict[str, int]:
    """The jobs endpoint's usage counters in Redis, by metric."""
    totals: dict[str, int] = {}
    for field, value in redis_sync().hgetall(LIVE_USAGE_KEY).items():
        tenant, _, _, endpoint, metric, _ = field.decode().split("|", 5)
        if endpoint == "jobs" and (tenant_id is None or int(tenant) == tenant_id):
            totals[metric] = totals.get(metric, 0) + int(value)
    return totals


def test_worker_completes_a_job_with_the_synchronous_vectors(job_stack, start_worker):
    _, log = start_worker()
    (job_id,) = job_stack.submit([("alpha", texts("alpha", 30))])
    job = job_stack.wait(job_id, {"completed", "failed"}, [log])
    assert (job["status"], job["completed"], job["failed"], job["total"]) == ("completed", 30, 0, 30)
    rows, max_difference, tokens = job_stack.compare(job_id)
    assert rows == 30 and max_difference < 1e-5 and job["prompt_tokens"] == tokens
    assert job_usage() == {"requests": 8, "succeeded": 8, "inputs": 30, "tokens": tokens, **_latency()}


def _latency() -> dict[str, int]:
    latency = job_usage().get("latency_ms_total")
    return {} if latency is None else {"latency_ms_total": latency}


def test_a_small_job_is_not_stuck_behind_a_big_one(job_stack, start_worker):
    """Fair share: one worker process; tenant alpha's 100-chunk job first, then beta's 2-chunk job."""
    _, log = start_worker()
    big, small = job_stack.submit([("alpha", texts("big", 400)), ("beta", texts("small", 8))])
    small_job = job_stack.wait(small, {"completed"}, [log])
    big_job = job_stack.job(big)
    assert big_job["status"] == "running" and big_job["completed"] < 200, big_job
    big_job = job_stack.wait(big, {"completed"}, [log])
    assert big_job["finished_at"] > small_job["finished_at"] and big_job["completed"] == 400


def test_a_job_survives_a_worker_killed_mid_job(job_stack, start_worker):
    """SIGKILL the worker while it works on the job; a new worker (and the watchdog, for the chunk
    the dead worker held) finish it with every result written and counted once."""
    worker, log = start_worker()
    (job_id,) = job_stack.submit([("alpha", texts("kill", 400))])
    deadline = time.monotonic() + 60
    while job_stack.job(job_id)["completed"] < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    assert job_stack.job(job_id)["status"] == "running"
    # The watchdog runs on the worker, every second; a job is stalled after 2 s without a chunk.
    _, second_log = start_worker(JOB_STALL_S="2")
    _, beat_log = start_worker("beat", JOB_WATCHDOG_INTERVAL_S="1")
    job = job_stack.wait(job_id, {"completed", "failed"}, [log, second_log, beat_log])
    assert (job["status"], job["completed"], job["failed"]) == ("completed", 400, 0)
    rows, max_difference, tokens = job_stack.compare(job_id)
    assert rows == 400 and max_difference < 1e-5 and job["prompt_tokens"] == tokens
    usage = job_usage()
    assert (usage["inputs"], usage["tokens"], usage["succeeded"]) == (400, tokens, 100)


def test_triton_down_fails_the_job_after_retries(job_stack, start_worker):
    _, log = start_worker(
        TRITON_SERVER_URL=f"127.0.0.1:{free_port()}",
        JOB_CHUNK_RETRIES="2",
        JOB_CHUNK_RETRY_BACKOFF_S="0.1",
        TRITON_RETRIES="0",
        TRITON_TIMEOUT_S="2",
    )
    (job_id,) = job_stack.submit([("alpha", texts("down", 20))])
    job = job_stack.wait(job_id, {"completed", "failed"}, [log])
    assert (job["status"], job["completed"], job["failed"]) == ("failed", 0, 20)
    assert job["error_code"] == "model_unavailable" and "3 attempts" in job["error_message"]
    assert job["finished_at"] is not None
    assert log.read_text().count("Retry in") >= 2


def test_cancel_stops_a_running_job(job_stack, start_worker):
    _, log = start_worker()
    (job_id,) = job_stack.submit([("alpha", texts("cancel", 400))])
    deadline = time.monotonic() + 60
    while job_stack.job(job_id)["completed"] < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    manage(
        job_stack.env,
        "shell",
        "-c",
        "from embeddings.models import EmbeddingJob\n"
        "from embeddings.services.jobs import job_cancel\n"
        f"job_cancel(job=EmbeddingJob.objects.get(pk={job_id}))",
    )
    job = job_stack.wait(job_id, {"cancelled"}, [log], timeout_s=30)
    assert 8 <= job["completed"] < 400 and job["finished_at"] is not None


def test_job_tasks_are_registered_and_scheduled():
    from embedsite.celery import app

    app.loader.import_default_modules()
    schedule = app.conf.beat_schedule
    assert schedule["expire-jobs"]["task"] == "embeddings.tasks.job_expire_task"
    assert schedule["job-watchdog"]["task"] == "embeddings.tasks.job_watchdog_task"
    for name in ("job_chunk_task", "job_expire_task", "job_watchdog_task", "job_callback_task"):
        assert f"embeddings.tasks.{name}" in app.tasks
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_transport_options["visibility_timeout"] >= 3600


SUBMIT_WITH_CALLBACK = """
import json
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs import JobSpec, job_create
spec = JobSpec(model=EmbeddingModel.objects.get(), texts={texts!r}, callback_url={url!r})
job, _ = job_create(tenant_id=Tenant.objects.get(slug="alpha").pk, api_key_id=None, spec=spec)
print(json.dumps(job.pk))
"""

JOB_OBJECT = """
import json
from embeddings.models import EmbeddingJob
from embeddings.services.jobs import job_object
print(json.dumps(job_object(EmbeddingJob.objects.select_related("model").get(pk={job_id}))))
"""


@pytest.fixture
def callback_receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """A local HTTP server that answers 503 to the first two POSTs and 200 after; (url, requests)."""
    received: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            received.append((dict(self.headers), body))
            self.send_response(503 if len(received) <= 2 else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/embedsite", received
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_a_callback_is_retried_until_delivered_signed(job_stack, start_worker, callback_receiver):
    """503, 503, 200: the worker's job_callback_task retries (backoff 0.1 s, 0.2 s) and the third
    POST delivers the job object, each one signed with the tenant's webhook secret (as
    rotate_webhook_secret printed it) and not with another tenant's. The worker is allowed loopback
    (JOB_CALLBACK_ALLOWED_NETWORKS), which it refuses by default."""
    url, received = callback_receiver
    secret = manage(job_stack.env, "rotate_webhook_secret", "--tenant", "alpha").strip()
    other_secret = manage(job_stack.env, "rotate_webhook_secret", "--tenant", "beta").strip()
    assert secret.startswith("whsec_") and other_secret.startswith("whsec_") and secret != other_secret
    _, log = start_worker(JOB_CALLBACK_ALLOWED_NETWORKS="127.0.0.1/32", JOB_CALLBACK_BACKOFF_S="0.1")
    script = SUBMIT_WITH_CALLBACK.format(texts=texts("callback", 6), url=url)
    job_id = json.loads(manage(job_stack.env, "shell", "-c", script).splitlines()[-1])
    job_stack.wait(job_id, {"completed"}, [log])
    deadline = time.monotonic() + 60
    while job_stack.job(job_id)["callback_delivered_at"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    job = job_stack.job(job_id)
    assert job["callback_delivered_at"] is not None, log.read_text()[-4000:]
    assert job["callback_attempts"] == 3 and len(received) == 3
    expected = json.loads(
        manage(job_stack.env, "shell", "-c", JOB_OBJECT.format(job_id=job_id)).splitlines()[-1]
    )
    assert expected["status"] == "completed" and expected["counts"]["completed"] == 6
    for headers, body in received:
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body) == expected
        assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=secret)
        assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=other_secret)
    assert log.read_text().count("Retry in") == 2
