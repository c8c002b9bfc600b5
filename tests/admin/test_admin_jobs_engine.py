"""The jobs admin's actions and their effect on the real job engine: uvicorn serving the API and the
admin, a real Celery worker, Triton and Redis (tests/job_stack.py), an operator logged in over HTTP
as a browser would be. A cancelled job stops, a failed job's chunks retried run and it completes
with the synchronous vectors, a re-sent callback arrives signed at a loopback receiver."""

from __future__ import annotations

import html
import io
import json
import re
import time
from collections.abc import Iterator

import httpx2
import numpy as np
import pytest

from embeddings.services.jobs.callbacks import SIGNATURE_HEADER, callback_signature_valid
from tests.database_backend import database_rows
from tests.job_stack import JobStack, job_stack_running
from tests.processes import process_group_paused
from tests.services.test_job_callbacks import Receiver, serve

MODEL = "all-MiniLM-L6-v2"
CHUNK_SIZE = 4
PASSWORD = "a-long-password"


# instant_1024 answers 1024-d vectors: registered as 384-d, every chunk fails (TritonModelError).
REGISTER_A_MISCONFIGURED_MODEL = """
from embeddings.models import EmbeddingModel
EmbeddingModel.objects.create(
    name="misconfigured", triton_model="instant_1024", dimensions=384, max_tokens=128
)
"""


@pytest.fixture(scope="module")
def stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    """The stack, its worker allowed loopback callbacks (tried once: JOB_CALLBACK_RETRIES 0), a
    superuser `root`, and a model registered before the server's catalog cache first reads them."""
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("admin_jobs_engine"),
        chunk_size=CHUNK_SIZE,
        extra_env={
            "JOB_CALLBACK_ALLOWED_NETWORKS": "127.0.0.1/32",
            "JOB_CALLBACK_RETRIES": "0",
            "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        },
    ) as stack:
        stack.django.commands(
            ("createsuperuser", "--noinput", "--username", "root", "--email", "r@example.com")
        )
        stack.django.run(REGISTER_A_MISCONFIGURED_MODEL)
        yield stack


@pytest.fixture
def api(stack) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=stack.base_url, headers=stack.headers, timeout=60) as client:
        yield client


class AdminSession:
    """An operator's browser session with the admin, over HTTP: logged in, posting its forms."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx2.Client(base_url=base_url, timeout=60, follow_redirects=True)
        self.http.get("/admin/login/")
        page = self.http.post(
            "/admin/login/",
            data={
                "username": "root",
                "password": PASSWORD,
                "csrfmiddlewaretoken": self.csrf,
                "next": "/admin/",
            },
        )
        assert page.status_code == 200 and "Log out" in page.text, page.text[-2000:]

    @property
    def csrf(self) -> str:
        return self.http.cookies["csrftoken"]

    def act(self, job_pk: int, action: str, **fields: str) -> str:
        """Press one of the job page's action buttons; the messages of the page it leads back to."""
        response = self.http.post(
            f"/admin/embeddings/embeddingjob/{job_pk}/act/{action}/",
            data={"csrfmiddlewaretoken": self.csrf, **fields},
        )
        assert response.status_code == 200, response.text[-2000:]
        said = re.findall(r'<li class="(?:success|warning|error)">(.*?)</li>', response.text)
        return " | ".join(html.unescape(message) for message in said)

    def job_page(self, job_pk: int) -> str:
        return self.http.get(f"/admin/embeddings/embeddingjob/{job_pk}/change/").text


@pytest.fixture(scope="module")
def operator(stack) -> Iterator[AdminSession]:
    session = AdminSession(stack.base_url)
    yield session
    session.http.close()


def job_row(stack: JobStack, public_id: str) -> dict:
    (row,) = database_rows(
        stack.env["DATABASE_URL"], "SELECT * FROM embeddings_embeddingjob WHERE public_id = %s", public_id
    )
    return row


def wait_for(stack: JobStack, public_id: str, statuses: set[str], timeout_s: float = 120) -> dict:
    """Until the job reaches one of `statuses` (a deadline against hanging, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = job_row(stack, public_id)
        if row["status"] in statuses:
            return row
        time.sleep(0.1)
    pytest.fail(
        f"job {public_id} is {job_row(stack, public_id)['status']}, not {statuses}\n{stack.logs_tail()}"
    )


def texts(prefix: str, count: int) -> list[str]:
    return [f"{prefix} sentence number {index}, about operators" for index in range(count)]


def test_cancel_from_the_admin_stops_a_running_job(stack, api, operator):
    """Cancelled while the worker is paused (SIGSTOP) mid-job, outside a database transaction (on
    SQLite a worker paused inside one locks the file): however fast the machine, the job cannot
    finish first; resumed, it ends cancelled and no chunk starts after the cancel."""
    submitted = api.post("/v1/jobs", json={"model": MODEL, "input": texts("cancel", 200)})
    assert submitted.status_code == 202, submitted.text
    public_id = submitted.json()["id"]
    deadline = time.monotonic() + 60  # against hanging only
    while job_row(stack, public_id)["completed"] < 2 * CHUNK_SIZE:
        assert time.monotonic() < deadline, job_row(stack, public_id)
        time.sleep(0.05)
    with process_group_paused(stack.worker, stack.env["DATABASE_URL"]):
        paused = job_row(stack, public_id)
        assert paused["status"] == "running" and paused["completed"] < 200
        said = operator.act(paused["id"], "cancel")
        assert said == f"Job {public_id} is cancelling: it stops once its running chunks have."
        assert api.get(f"/v1/jobs/{public_id}").json()["status"] == "cancelling"
    job = wait_for(stack, public_id, {"cancelled"}, timeout_s=30)
    assert paused["completed"] <= job["completed"] <= paused["completed"] + CHUNK_SIZE, (paused, job)
    page = operator.job_page(job["id"])
    assert "asked by root" in page and "not run" in page


FIX_THE_MODEL = """
from embeddings.models import EmbeddingModel
EmbeddingModel.objects.filter(name="misconfigured").update(triton_model="minilm")
"""


def test_retried_chunks_run_on_the_worker_and_the_job_completes(stack, api, operator):
    """A model registered with the wrong Triton model fails every chunk (the job ends failed, each
    chunk run once); fixed, the operator's retry runs them again on the worker, and the job's
    results are those of /v1/embeddings."""
    inputs = texts("retry", 10)  # chunks of 4, 4, 2
    submitted = api.post("/v1/jobs", json={"model": "misconfigured", "input": inputs})
    assert submitted.status_code == 202, submitted.text
    public_id = submitted.json()["id"]
    failed = wait_for(stack, public_id, {"failed", "completed"})
    assert (failed["status"], failed["completed"], failed["failed"]) == ("failed", 0, 10)
    page = operator.job_page(failed["id"])
    assert page.count('class="chunk-state">failed<') == 3 and "1024-d vectors, 384 expected" in page
    stack.django.run(FIX_THE_MODEL)

    said = operator.act(failed["id"], "retry")
    assert said.startswith(f"Job {public_id} is running again: 3 failed chunk(s), 10 inputs;"), said
    job = wait_for(stack, public_id, {"completed", "failed"})
    assert (job["status"], job["completed"], job["failed"], job["error_code"]) == ("completed", 10, 0, "")
    synchronous = api.post("/v1/embeddings", json={"model": MODEL, "input": inputs}).json()
    expected = np.array([item["embedding"] for item in synchronous["data"]], dtype=np.float32)
    download = api.get(f"/v1/jobs/{public_id}/results?format=npy")
    assert download.status_code == 200, download.text
    np.testing.assert_allclose(np.load(io.BytesIO(download.content)), expected, atol=2e-5)
    assert job["prompt_tokens"] == synchronous["usage"]["prompt_tokens"]
    # Each chunk ran twice: once failing, once retried.
    page = operator.job_page(job["id"])
    assert page.count('class="chunk-state">done<') == 3
    assert re.findall(r'class="chunk-attempts">(\d+)<', page) == ["2", "2", "2"]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A loopback HTTP receiver: the first callback refused (503), the next ones taken (200)."""
    yield from serve(Receiver(statuses=[503]))


def wait_for_callbacks(received: list, count: int, stack: JobStack, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"{len(received)} callbacks, not {count}\n{stack.logs_tail()}"
        time.sleep(0.05)


def test_a_callback_resent_from_the_admin_arrives_signed(stack, api, operator, receiver):
    """The first delivery is refused, and not retried (JOB_CALLBACK_RETRIES 0): the operator
    re-sends it."""
    url, received = receiver.url(path="/hooks/embedsite"), receiver.received
    (secret,) = stack.django.commands(("rotate_webhook_secret", "--tenant", "jobs"))
    submitted = api.post(
        "/v1/jobs", json={"model": MODEL, "input": texts("callback", 6), "callback_url": url}
    )
    assert submitted.status_code == 202, submitted.text
    public_id = submitted.json()["id"]
    wait_for(stack, public_id, {"completed"})
    wait_for_callbacks(received, 1, stack)
    deadline = time.monotonic() + 30
    while not job_row(stack, public_id)["callback_error"]:
        assert time.monotonic() < deadline, job_row(stack, public_id)
        time.sleep(0.05)
    job = job_row(stack, public_id)
    assert job["callback_error"] == "the receiver answered 503" and job["callback_delivered_at"] is None
    assert "not delivered (1 attempt): the receiver answered 503" in operator.job_page(job["id"])

    said = operator.act(job["id"], "resend_callback")
    assert said == f"Job {public_id}'s callback is sent again to {url}."
    wait_for_callbacks(received, 2, stack)
    _, headers, body = received[1]
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=secret)
    assert json.loads(body)["id"] == public_id and json.loads(body)["status"] == "completed"
    deadline = time.monotonic() + 30
    while job_row(stack, public_id)["callback_delivered_at"] is None:
        assert time.monotonic() < deadline, job_row(stack, public_id)
        time.sleep(0.05)
    assert re.search(r"delivered \d{4}-\d\d-\d\d [\d:]+ UTC \(2 attempts\)", operator.job_page(job["id"]))
