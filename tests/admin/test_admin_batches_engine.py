"""The batches and files admin's actions and their effect on the real job engine: uvicorn serving the
API and the admin, a real Celery worker, Triton and Redis (tests/job_stack.py), an operator logged in
over HTTP as a browser would be (tests/admin/test_admin_jobs_engine.py's AdminSession). A batch
cancelled from the admin ends `cancelled` with the output and error files the API's cancel gives; a
file deleted from the admin is gone from the API and from the files storage, its batch kept."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import orjson
import pytest

from tests.admin.test_admin_jobs_engine import PASSWORD, AdminSession
from tests.database_backend import database_rows
from tests.job_stack import JobStack, job_stack_running
from tests.processes import process_group_paused

MODEL = "all-MiniLM-L6-v2"
CHUNK_SIZE = 4
LINES = 400


@pytest.fixture(scope="module")
def stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("admin_batches_engine"),
        chunk_size=CHUNK_SIZE,
        extra_env={"DJANGO_SUPERUSER_PASSWORD": PASSWORD},
    ) as stack:
        stack.django.commands(
            ("createsuperuser", "--noinput", "--username", "root", "--email", "r@example.com")
        )
        yield stack


@pytest.fixture
def api(stack) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=stack.base_url, headers=stack.headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def operator(stack) -> Iterator[AdminSession]:
    session = AdminSession(stack.base_url)
    yield session
    session.http.close()


def messages_in(page: str) -> str:
    said = re.findall(r'<li class="(?:success|warning|error)">(.*?)</li>', page)
    return " | ".join(html.unescape(message) for message in said)


def batch_pk(stack: JobStack, public_id: str) -> int:
    (row,) = database_rows(
        stack.env["DATABASE_URL"], "SELECT id FROM embeddings_batch WHERE public_id = %s", public_id
    )
    return row["id"]


def file_row(stack: JobStack, public_id: str) -> dict | None:
    rows = database_rows(
        stack.env["DATABASE_URL"], "SELECT * FROM embeddings_storedfile WHERE public_id = %s", public_id
    )
    return rows[0] if rows else None


def lines_of(api: httpx2.Client, file_id: str) -> list[dict]:
    response = api.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines()]


def finished(api: httpx2.Client, stack: JobStack, batch_id: str, timeout_s: float = 120) -> dict:
    """Until the batch is final (a deadline against hanging, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = api.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in {"completed", "failed", "cancelled", "expired"}:
            return batch
        time.sleep(0.2)
    pytest.fail(f"batch {batch_id} did not finish: {batch}\n{stack.logs_tail()}")


def submit(api: httpx2.Client, prefix: str, count: int) -> dict:
    body = {"model": MODEL, "encoding_format": "base64"}
    lines = b"".join(
        orjson.dumps(
            {"custom_id": f"{prefix}-{index}", "method": "POST", "url": "/v1/embeddings",
             "body": {**body, "input": f"{prefix} line {index}"}}
        ) + b"\n"
        for index in range(count)
    )  # fmt: skip
    upload = api.post("/v1/files", files={"file": ("requests.jsonl", lines)}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    batch = api.post(
        "/v1/batches",
        json={"input_file_id": upload.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    return batch.json()


def test_a_batch_cancelled_from_the_admin_ends_as_the_apis_cancel_leaves_it(stack, api, operator):
    """Cancelled while the worker is paused (SIGSTOP) mid-batch: however fast its chunks, the batch
    cannot finish before the cancel lands."""
    batch = submit(api, "cancel", LINES)
    public_id = batch["id"]
    deadline = time.monotonic() + 120  # against hanging only
    while api.get(f"/v1/batches/{public_id}").json()["request_counts"]["completed"] < 2 * CHUNK_SIZE:
        assert time.monotonic() < deadline, stack.logs_tail()
        time.sleep(0.05)
    pk = batch_pk(stack, public_id)
    with process_group_paused(stack.worker, stack.env["DATABASE_URL"]):
        page = operator.http.get(f"/admin/embeddings/batch/{pk}/change/").text
        assert 'value="Cancel the batch"' in page and "Not now" not in page
        response = operator.http.post(
            f"/admin/embeddings/batch/{pk}/act/cancel/", data={"csrfmiddlewaretoken": operator.csrf}
        )
        assert response.status_code == 200, response.text[-2000:]
        assert messages_in(response.text) == (
            f"Batch {public_id} is cancelling: it stops once its running chunks have; what finished "
            "goes to its output file, the rest to its error file (batch_cancelled)."
        )
        assert api.get(f"/v1/batches/{public_id}").json()["status"] == "cancelling"
    done = finished(api, stack, public_id)
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    output, errors = lines_of(api, done["output_file_id"]), lines_of(api, done["error_file_id"])
    assert 0 < len(output) < LINES
    assert {record["error"]["code"] for record in errors} == {"batch_cancelled"}
    ids = sorted(record["custom_id"] for record in output + errors)
    assert ids == sorted(f"cancel-{index}" for index in range(LINES))  # each exactly once
    assert done["request_counts"] == {"total": LINES, "completed": len(output), "failed": len(errors)}

    # The admin shows it as the API does: its two files, its job gone, its history naming the cancel.
    page = operator.http.get(f"/admin/embeddings/batch/{pk}/change/").text
    for role, file_id in (("output", done["output_file_id"]), ("error", done["error_file_id"])):
        assert re.search(
            rf'data-role="{role}">\s*<th scope="row">{role}</th>\s*<td><a href="[^"]+">{file_id}<', page
        )
    assert "Not now: it is cancelled: there is nothing to cancel." in page
    assert '<th scope="row">cancelled</th>' in page
    history = operator.http.get(f"/admin/embeddings/batch/{pk}/history/").text
    assert "is cancelling: it stops once its running chunks have" in history and "root" in history


def test_a_file_deleted_from_the_admin_is_gone_and_its_batch_kept(stack, api, operator):
    batch = submit(api, "delete", 6)
    done = finished(api, stack, batch["id"])
    assert done["status"] == "completed" and done["error_file_id"] is None
    output_id = done["output_file_id"]
    stored = file_row(stack, output_id)
    on_disk = Path(stack.env["EMBEDSITE_RUN_DIR"]) / "files" / stored["storage_name"]
    expected = api.get(f"/v1/files/{output_id}/content").content
    assert on_disk.read_bytes() == expected

    # The operator reads it first: the same bytes as the tenant gets, as an attachment.
    download = operator.http.get(f"/admin/embeddings/storedfile/{stored['id']}/download/")
    assert download.status_code == 200 and download.content == expected
    assert download.headers["content-length"] == str(len(expected))
    assert download.headers["content-disposition"].startswith("attachment; ")

    confirmation = operator.http.get(f"/admin/embeddings/storedfile/{stored['id']}/delete/").text
    assert "its output_file_id becomes null (its 6 answered lines go with the file)" in confirmation
    response = operator.http.post(
        f"/admin/embeddings/storedfile/{stored['id']}/delete/",
        data={"csrfmiddlewaretoken": operator.csrf, "post": "yes"},
    )
    assert response.status_code == 200, response.text[-2000:]
    assert messages_in(response.text).startswith(
        f"Batch {batch['id']} (output file {output_id}): its output_file_id becomes null"
    )
    assert not on_disk.exists() and file_row(stack, output_id) is None
    assert api.get(f"/v1/files/{output_id}").status_code == 404
    assert api.get(f"/v1/files/{output_id}/content").status_code == 404
    kept = api.get(f"/v1/batches/{batch['id']}").json()
    assert (kept["status"], kept["output_file_id"], kept["request_counts"]["completed"]) == (
        "completed",
        None,
        6,
    )
    assert operator.http.get(f"/admin/embeddings/storedfile/{stored['id']}/download/").status_code == 404
