"""Embedding jobs run by real `celery -A embedsite worker` processes (tests/worker_stack.py): results,
fair share, Triton down, cancel, callbacks. A worker killed mid-job: tests/reliability/."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.conf import settings

from embeddings.redis.connections import redis_job_store
from embeddings.services.jobs.callbacks import SIGNATURE_HEADER, callback_signature_valid
from embeddings.services.jobs.leases import chunk_runs
from embeddings.services.jobs.store import JobStore
from embeddings.tooling.triton_server import free_port
from tests import worker_stack
from tests.processes import process_group_paused
from tests.worker_stack import job_usage, texts

job_stack = worker_stack.job_stack
start_worker = worker_stack.start_worker


def test_worker_completes_a_job_with_the_synchronous_vectors(job_stack, start_worker):
    _, log = start_worker()
    inputs = texts("alpha", 30)
    (job_id,) = job_stack.submit([("alpha", inputs)])
    job = job_stack.wait(job_id, {"completed", "failed"}, [log])
    assert (job["status"], job["completed"], job["failed"], job["total"]) == ("completed", 30, 0, 30)
    rows, max_difference, tokens = job_stack.compare(job_id, inputs)
    assert rows == 30 and max_difference < 1e-5 and job["prompt_tokens"] == tokens
    assert job_usage() == {"requests": 8, "succeeded": 8, "inputs": 30, "tokens": tokens, **_latency()}


def _latency() -> dict[str, int]:
    latency = job_usage().get("latency_ms_total")
    return {} if latency is None else {"latency_ms_total": latency}


def chunk_starts_ms(job: dict) -> dict[int, int]:
    """When each chunk of the job last started embedding (Redis's clock, ms), as its lease recorded."""
    store = JobStore(redis_job_store(), job["public_id"], ttl_s=3600)
    return chunk_runs(store).started_ms


def created_ms(job: dict) -> int:
    """The job row's created_at in ms, on the clock Redis reads too (SQLite holds it as naive UTC
    text, PostgreSQL as a timestamp with time zone)."""
    created = job["created_at"]
    if isinstance(created, str):
        created = datetime.fromisoformat(created).replace(tzinfo=UTC)
    return round(created.timestamp() * 1000)


def test_a_small_job_is_not_stuck_behind_a_big_one(job_stack, start_worker):
    """Fair share: one worker process; tenant alpha's 100-chunk job first, then beta's 2-chunk job.

    The bound is derived from the design, not from timing: when the small job is queued, the big
    one has at most JOB_CHUNKS_IN_FLIGHT chunks in the broker, and the successors they hand out
    queue behind the small job's chunks. So between the small job's submission and the start of
    its last chunk, at most that many big chunks start (one more if one started and ended while
    the small job was being committed); without fair share it would be most of the 100."""
    _, log = start_worker()
    big, small = job_stack.submit([("alpha", texts("big", 400)), ("beta", texts("small", 8))])
    small_job = job_stack.wait(small, {"completed"}, [log])
    big_job = job_stack.wait(big, {"completed"}, [log])
    assert big_job["finished_at"] > small_job["finished_at"] and big_job["completed"] == 400
    small_starts = chunk_starts_ms(small_job)
    assert sorted(small_starts) == [0, 1]
    big_starts = chunk_starts_ms(big_job)
    assert sorted(big_starts) == list(range(100))
    waited_for = [
        chunk
        for chunk, started in big_starts.items()
        if created_ms(small_job) <= started <= max(small_starts.values())
    ]
    assert len(waited_for) <= settings.JOB_CHUNKS_IN_FLIGHT + 1, sorted(waited_for)


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


SUBMIT_TO_A_WRONG_MODEL = """
import json
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs.submission import JobSpec, job_create
# instant_1024 answers 1024-d vectors: a model registered as 384-d gets a TritonModelError each time.
model, _ = EmbeddingModel.objects.get_or_create(
    name="wrong-dimensions", defaults=dict(triton_model="instant_1024", dimensions=384, max_tokens=128)
)
spec = JobSpec(model=model, texts={texts!r})
job, _ = job_create(tenant_id=Tenant.objects.get(slug="alpha").pk, api_key_id=None, spec=spec)
print(json.dumps(job.pk))
"""


def test_a_chunk_that_cannot_be_embedded_fails_without_being_retried(job_stack, start_worker):
    """A model answer that would be as wrong the next time: the chunk's inputs count failed at once
    and the job goes on to the end (failed), instead of a chunk re-sent until the job expires."""
    _, log = start_worker()
    script = SUBMIT_TO_A_WRONG_MODEL.format(texts=texts("wrong", 10))
    job_id = json.loads(job_stack.shell(script))
    job = job_stack.wait(job_id, {"completed", "failed"}, [log])
    assert (job["status"], job["completed"], job["failed"]) == ("failed", 0, 10)
    assert job["error_code"] == "embedding_failed" and "1024-d vectors, 384 expected" in job["error_message"]
    received = re.findall(r"job_chunk_task\[[^\]]+\] received", log.read_text())
    assert len(received) == 3  # 3 chunks, each run once
    assert "Retry in" not in log.read_text()


def test_cancel_stops_a_running_job(job_stack, start_worker):
    """Cancelled while the worker is paused (SIGSTOP) mid-job: however fast the machine, the job
    cannot finish before the cancel lands; resumed, it ends cancelled with no more chunks written."""
    worker, log = start_worker()
    (job_id,) = job_stack.submit([("alpha", texts("cancel", 400))])
    deadline = time.monotonic() + 60  # against hanging only
    while job_stack.job(job_id)["completed"] < 8:
        assert time.monotonic() < deadline, job_stack.job(job_id)
        time.sleep(0.05)
    with process_group_paused(worker):
        paused = job_stack.job(job_id)
        assert paused["status"] == "running" and 8 <= paused["completed"] < 400, paused
        job_stack.django.run(
            "from embeddings.models import EmbeddingJob\n"
            "from embeddings.services.jobs.engine import job_cancel\n"
            f"job_cancel(job=EmbeddingJob.objects.get(pk={job_id}))"
        )
        assert job_stack.job(job_id)["status"] == "cancelling"
    job = job_stack.wait(job_id, {"cancelled"}, [log], timeout_s=30)
    # No chunk started after the cancel: at most the one in progress when paused was written (the
    # row's count mirrors Redis after each chunk, so that one may be missing from `paused`).
    chunk_size = int(job_stack.env["JOB_CHUNK_SIZE"])
    assert paused["completed"] <= job["completed"] <= paused["completed"] + chunk_size, (paused, job)
    assert job["finished_at"] is not None


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
from django.conf import settings
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs.submission import JobSpec, job_create
model = EmbeddingModel.objects.get(name=settings.DEFAULT_EMBEDDING_MODEL)
spec = JobSpec(model=model, texts={texts!r}, callback_url={url!r})
job, _ = job_create(tenant_id=Tenant.objects.get(slug="alpha").pk, api_key_id=None, spec=spec)
print(json.dumps(job.pk))
"""

JOB_OBJECT = """
import json
from embeddings.models import EmbeddingJob
from embeddings.services.jobs.reads import job_object
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
    secret, other_secret = job_stack.django.commands(
        ["rotate_webhook_secret", "--tenant", "alpha"],
        ["rotate_webhook_secret", "--tenant", "beta"],
    )
    assert secret.startswith("whsec_") and other_secret.startswith("whsec_") and secret != other_secret
    _, log = start_worker(JOB_CALLBACK_ALLOWED_NETWORKS="127.0.0.1/32", JOB_CALLBACK_BACKOFF_S="0.1")
    script = SUBMIT_WITH_CALLBACK.format(texts=texts("callback", 6), url=url)
    job_id = json.loads(job_stack.shell(script))
    job_stack.wait(job_id, {"completed"}, [log])
    deadline = time.monotonic() + 60
    while job_stack.job(job_id)["callback_delivered_at"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    job = job_stack.job(job_id)
    assert job["callback_delivered_at"] is not None, log.read_text()[-4000:]
    assert job["callback_attempts"] == 3 and len(received) == 3
    expected = json.loads(job_stack.shell(JOB_OBJECT.format(job_id=job_id)))
    assert expected["status"] == "completed" and expected["counts"]["completed"] == 6
    for headers, body in received:
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body) == expected
        assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=secret)
        assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=other_secret)
    assert log.read_text().count("Retry in") == 2
