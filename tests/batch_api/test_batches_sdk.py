"""OpenAI's Files and Batches API through the official `openai` SDK, unmodified, against a real stack:
uvicorn on a socket and a real Celery worker (real Triton, Redis, one database shared by both).

Each output line's `response.body` is compared with what POST /v1/embeddings answers for the same
body; every custom_id comes back exactly once, also when cancelled and when the worker is SIGKILLed
mid-batch."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import time
from collections.abc import Iterator

import httpx2
import numpy as np
import openai
import orjson
import pytest

from tests.api.raw_http import RawHttp
from tests.job_stack import JobStack, job_stack_running
from tests.processes import REPO_ROOT, process_group_paused, start_celery, stop_process_group, tenant_with_key

MODEL = "all-MiniLM-L6-v2"
CHUNK_SIZE = 64
# The crash test's worker and beat: a lost chunk is re-sent within a few seconds.
LEASE_S, WATCHDOG_S, STALL_S = "3", "1", "5"
# Small, so that refusing an upload over it costs the shared machine little.
FILES_MAX_UPLOAD_BYTES = 8_000_000
BATCH_MAX_REQUESTS, BATCH_MAX_INPUTS = 10_000, 20_000


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("batch_stack"),
        chunk_size=CHUNK_SIZE,
        extra_env={
            "JOB_CHUNK_LEASE_S": LEASE_S,
            "BATCH_STALL_S": "2",
            "FILES_MAX_UPLOAD_BYTES": str(FILES_MAX_UPLOAD_BYTES),
            # Exactly the 10,000-line batch; the bad-lines batch's 3,000-input line fits.
            "BATCH_MAX_REQUESTS": str(BATCH_MAX_REQUESTS),
            "BATCH_MAX_INPUTS": str(BATCH_MAX_INPUTS),
        },
    ) as stack:
        original = stack.worker
        yield stack
        if stack.worker is not original:  # the worker the kill test started in its place
            stop_process_group(stack.worker)


@pytest.fixture(scope="module")
def other_key(job_stack) -> str:
    return tenant_with_key(job_stack.django, "other", name="Other")


def sdk_client(stack: JobStack, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key or stack.api_key, max_retries=0)


@pytest.fixture
def client(job_stack) -> Iterator[openai.OpenAI]:
    with sdk_client(job_stack) as sdk:
        yield sdk


@pytest.fixture
def http(job_stack) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=job_stack.base_url, headers=job_stack.headers, timeout=120) as session:
        yield session


def request_line(custom_id: str, body: dict, **changes) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body, **changes}
    return orjson.dumps(line) + b"\n"


def upload(client: openai.OpenAI, lines: list[bytes], name: str = "requests.jsonl"):
    return client.files.create(file=(name, io.BytesIO(b"".join(lines))), purpose="batch")


def finished(client: openai.OpenAI, stack: JobStack, batch_id: str, timeout_s: float = 600):
    """Poll until the batch is final (a deadline against hanging, not a timing). Every 0.1 s at
    first, backing off to every 1 s: each poll costs the server a database connection (~20 ms of
    CPU), and a long batch's end is as well seen a second late."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.1
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in {"completed", "failed", "cancelled", "expired"}:
            return batch
        time.sleep(pause_s)
        pause_s = min(1.0, pause_s * 1.5)
    pytest.fail(f"batch {batch_id} did not finish: {batch}\n{stack.logs_tail()}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines()]


def vectors(body: dict) -> np.ndarray:
    rows = []
    for item in body["data"]:
        embedding = item["embedding"]
        if isinstance(embedding, str):
            rows.append(np.frombuffer(base64.b64decode(embedding), dtype="<f4"))
        else:
            rows.append(np.array(embedding, dtype=np.float32))
    return np.stack(rows)


def assert_same_answer(batch_body: dict, sync_body: dict) -> float:
    """The batch line's body is the synchronous answer: same shape, model, usage and encoding; the
    vectors equal up to float noise (the sync path may share a Triton call with other requests)."""
    assert batch_body.keys() == sync_body.keys()
    assert (batch_body["object"], batch_body["model"], batch_body["usage"]) == (
        sync_body["object"],
        sync_body["model"],
        sync_body["usage"],
    )
    assert [(d["object"], d["index"], type(d["embedding"])) for d in batch_body["data"]] == [
        (d["object"], d["index"], type(d["embedding"])) for d in sync_body["data"]
    ]
    difference = float(np.abs(vectors(batch_body) - vectors(sync_body)).max())
    assert difference < 1e-5
    return difference


EXPIRE_FILES = """
from datetime import timedelta
from django.utils import timezone
from embeddings.services.openai_api.files import files_expire_due
print(files_expire_due(now=timezone.now() + timedelta(hours=2)))
"""


def test_files_create_list_retrieve_content_delete(client, job_stack, other_key):
    content = request_line("a", {"model": MODEL, "input": "hello"}) * 3
    created = client.files.create(file=("mine.jsonl", io.BytesIO(content)), purpose="batch")
    assert (created.object, created.purpose, created.bytes, created.filename) == (
        "file",
        "batch",
        len(content),
        "mine.jsonl",
    )
    assert created.id.startswith("file-") and created.expires_at is None
    expiring = client.files.create(
        file=("later.jsonl", io.BytesIO(content)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert expiring.expires_at == expiring.created_at + 3600

    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).content == content
    listed = client.files.list(purpose="batch")
    assert {created.id, expiring.id} <= {item.id for item in listed.data}
    page = client.files.list(limit=1, order="asc")
    assert len(page.data) == 1 and page.has_more
    # The SDK's auto-pagination follows `after` through every page, oldest first.
    every = [item.id for item in client.files.list(limit=1, order="asc")]
    assert every == [item.id for item in client.files.list(order="asc").data]
    assert every[-2:] == [created.id, expiring.id] and len(set(every)) == len(every)

    # Another tenant's file is not found, for every route.
    with sdk_client(job_stack, other_key) as other:
        for call in (
            lambda: other.files.retrieve(created.id),
            lambda: other.files.content(created.id),
            lambda: other.files.delete(created.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert created.id not in {item.id for item in other.files.list().data}

    # Past its expires_at a file is gone: expired by beat's sweep, its bytes deleted.
    stored = job_stack.django.run(EXPIRE_FILES)
    assert stored.splitlines()[-1] == "1"
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(expiring.id)
    assert not any(path.name == expiring.id for path in (job_stack.logs[0].parent / "files").rglob("*"))
    assert any(path.name == created.id for path in (job_stack.logs[0].parent / "files").rglob("*"))

    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    assert not any(path.name == created.id for path in (job_stack.logs[0].parent / "files").rglob("*"))


def test_hostile_uploads_get_openai_errors_never_a_500(http, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose" and refused.value.body["code"] == "invalid_purpose"
    cases = [
        ({"purpose": "batch"}, None),  # no file part
        ({"purpose": "batch", "expires_after[anchor]": "nope", "expires_after[seconds]": "3600"}, b"x"),
        ({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "5"}, b"x"),
        ({"purpose": "batch", "purpose2": "x"}, b"x"),
        # expires_after as the schema writes it, and nothing else.
        ({"purpose": "batch", "expires_after": '{"anchor": "created_at", "seconds": 3600, "x": 1}'}, b"x"),
        (
            {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "+3600"},
            b"x",
        ),
        (
            {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600.0"},
            b"x",
        ),
    ]
    for fields, data in cases:
        files = {"file": ("x.jsonl", data)} if data is not None else None
        response = http.post("/v1/files", data=fields, files=files or {"other": ("y", b"1")})
        assert response.status_code == 400, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code", "request_id"}
        assert response.json()["error"]["request_id"] == response.headers["x-request-id"]
    response = http.post("/v1/files", json={"purpose": "batch"})
    assert response.status_code == 400
    # Sent twice: refused, not one silently dropped.
    response = http.post(
        "/v1/files", files=[("file", ("a", b"1")), ("file", ("b", b"2"))], data={"purpose": "batch"}
    )
    assert response.status_code in (400, 422), response.text


def test_an_upload_over_the_limit_is_refused_while_it_arrives(job_stack):
    """FILES_MAX_UPLOAD_BYTES is enforced on the stream: a declared length over it is 413 before a
    byte is read, and a chunked body is refused as it crosses it (the rest is never read)."""
    form = {"Content-Type": "multipart/form-data; boundary=x"}
    with RawHttp(job_stack) as connection:
        connection.head("POST", "/v1/files", {**form, "Content-Length": str(FILES_MAX_UPLOAD_BYTES * 2)})
        status, _, body = connection.answer()
        assert status == 413 and orjson.loads(body)["error"]["param"] == "file"
    with RawHttp(job_stack) as connection:
        connection.head("POST", "/v1/files", {**form, "Transfer-Encoding": "chunked"})
        connection.chunk(b'--x\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n')
        sent = 0
        with contextlib.suppress(OSError):  # the server may close while we still send
            while sent < FILES_MAX_UPLOAD_BYTES * 2:
                connection.chunk(b"0" * 10**6)
                sent += 10**6
        status, _, body = connection.answer()
        assert status == 413 and orjson.loads(body)["error"]["code"] == "payload_too_large"
        assert sent < FILES_MAX_UPLOAD_BYTES * 2 or connection.closed_by_server()


def test_a_10000_line_batch_equals_the_synchronous_answers(client, http, job_stack):
    bodies = []
    for index in range(10_000):
        # 3 to 7 tokens, the lengths mixed in every chunk (rows padded together); short, since the
        # batch's time is MiniLM's, in proportion to the tokens it computes, padding included:
        # about 66,000, against 107,000 when each was 3-11 tokens.
        body: dict = {"model": MODEL, "input": f"{index}{' w' * (index % 3)}"}
        if index % 2:
            body["encoding_format"] = "base64"
        if index % 5 == 0:
            body["dimensions"] = 64
        if index % 97 == 0:
            body["input"] = [f"first of {index}", f"second of {index}", "third"]
        bodies.append(body)
    lines = [request_line(f"req-{index}", body) for index, body in enumerate(bodies)]
    input_file = upload(client, lines)
    batch = client.batches.create(
        input_file_id=input_file.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"corpus": "ten-thousand"},
    )
    assert batch.status == "validating" and batch.input_file_id == input_file.id
    assert batch.metadata == {"corpus": "ten-thousand"}
    done = finished(client, job_stack, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 10_000, "completed": 10_000, "failed": 0}
    assert done.error_file_id is None and done.errors is None
    for moment in ("created_at", "in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, moment) is not None, moment
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at is not None
    print(
        f"\n10,000-line batch: validated in {done.in_progress_at - done.created_at} s, ran in "
        f"{done.finalizing_at - done.in_progress_at} s, "
        f"files written in {done.completed_at - done.finalizing_at} s "
        f"(output {output.bytes} bytes, {done.usage.input_tokens} tokens)"
    )

    records = file_lines(client, done.output_file_id)
    custom_ids = [record["custom_id"] for record in records]
    assert sorted(custom_ids) == sorted(f"req-{index}" for index in range(10_000))  # each exactly once
    assert len({record["id"] for record in records}) == 10_000
    by_id = {record["custom_id"]: record for record in records}
    assert all(
        record["error"] is None
        and record["response"]["status_code"] == 200
        and record["response"]["request_id"]
        for record in records
    )
    assert done.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in records)

    # The synchronous answers for a sample of bodies (every kind: float, base64, dimensions, arrays).
    sample = sorted({*range(0, 10_000, 97), *range(1, 10_000, 131), *range(5, 10_000, 173), 9_999})
    differences = []
    for index in sample:
        response = http.post("/v1/embeddings", json=bodies[index])
        assert response.status_code == 200, response.text
        differences.append(assert_same_answer(by_id[f"req-{index}"]["response"]["body"], response.json()))
    identical = sum(difference == 0 for difference in differences)
    print(
        f"compared with POST /v1/embeddings: {len(sample)} bodies, {identical} bit for bit, "
        f"largest difference {max(differences):.2e}"
    )
    assert client.batches.list(limit=5).data[0].id == batch.id


def test_bad_lines_are_reported_per_line_and_the_rest_completes(client, http, job_stack):
    good = {"model": MODEL, "input": "a good line"}
    lines = [
        request_line("good-1", good),
        b"this is not json\n",
        request_line("wrong-url", good, url="/v1/chat/completions"),
        request_line("wrong-method", good, method="GET"),
        request_line("bad-input", {"model": MODEL, "input": 12}),
        request_line("no-model", {"model": "no-such-model", "input": "x"}),
        request_line("good-1", good),  # a duplicate custom_id
        b"[1, 2]\n",
        request_line("too-wide", {"model": MODEL, "input": "x", "dimensions": 4096}),
        b"\n",
        request_line("too-many-inputs", {"model": MODEL, "input": ["x"] * 3000}),
        request_line("good-2", {**good, "encoding_format": "base64"}),
        request_line("empty-text", {"model": MODEL, "input": ["x", ""]}),
        request_line("chunked", {"model": MODEL, "input": "x", "long_inputs": "chunk"}),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = finished(client, job_stack, batch.id)
    assert done.status == "completed", done
    problems = {(error.line, error.code) for error in done.errors.data}
    assert problems == {
        (2, "invalid_json_line"),
        (3, "invalid_url"),
        (4, "invalid_method"),
        (5, "invalid_value"),
        (6, "model_not_found"),
        (7, "duplicate_custom_id"),
        (8, "invalid_json_line"),
        (9, "unsupported_by_model"),
        (13, "invalid_value"),
        (14, "invalid_value"),  # long_inputs "chunk": not in batches
    }, done.errors
    assert done.request_counts.model_dump() == {"total": 13, "completed": 2, "failed": 11}
    output = {record["custom_id"]: record for record in file_lines(client, done.output_file_id)}
    assert set(output) == {"good-1", "good-2"}
    for custom_id, body in (("good-1", good), ("good-2", {**good, "encoding_format": "base64"})):
        assert_same_answer(
            output[custom_id]["response"]["body"], http.post("/v1/embeddings", json=body).json()
        )
    errors = file_lines(client, done.error_file_id)
    assert len(errors) == 11
    # The request the synchronous API refuses is answered as it answers it: 413, same error body.
    (refused,) = [record for record in errors if record["custom_id"] == "too-many-inputs"]
    sync = http.post("/v1/embeddings", json={"model": MODEL, "input": ["x"] * 3000})
    assert refused["response"]["status_code"] == sync.status_code == 413
    # Each error body carries its own request's id, as the API's do: the line's, and the sync call's.
    line_error, sync_error = refused["response"]["body"]["error"], sync.json()["error"]
    assert line_error.pop("request_id") == refused["response"]["request_id"]
    assert sync_error.pop("request_id") == sync.headers["x-request-id"]
    assert line_error == sync_error and refused["error"] is None
    # Refused while validating: no response, an error naming the line.
    assert all(record["response"] is None for record in errors if record is not refused)
    assert {record["custom_id"] for record in errors} >= {"wrong-url", "wrong-method", "bad-input", None}


def test_lines_of_other_output_and_input_types_each_get_their_own_answer(client, http, job_stack):
    """int8, binary and float lines in one chunk: each line's body is what POST /v1/embeddings
    answers for it, integers for the quantised ones (none embedded with another line's options);
    a type the model cannot give fails its line while validating."""
    texts = ["an int8 line", "a float line", "a third text"]
    bodies = {
        "int8": {"model": MODEL, "input": texts, "output_dtype": "int8"},
        "int8-base64": {"model": MODEL, "input": texts, "output_dtype": "int8", "encoding_format": "base64"},
        "float": {"model": MODEL, "input": texts},
        "binary-query": {"model": MODEL, "input": texts, "output_dtype": "binary", "input_type": "query"},
        "binary-100": {"model": MODEL, "input": texts, "output_dtype": "binary", "dimensions": 100},
    }
    lines = [request_line(custom_id, body) for custom_id, body in bodies.items()]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = finished(client, job_stack, batch.id)
    assert done.status == "completed", done
    assert {(error.line, error.code) for error in done.errors.data} == {(5, "unsupported_by_model")}
    output = {
        record["custom_id"]: record["response"]["body"] for record in file_lines(client, done.output_file_id)
    }
    assert set(output) == {"int8", "int8-base64", "float", "binary-query"}
    for custom_id in output:
        sync = http.post("/v1/embeddings", json=bodies[custom_id]).json()
        if custom_id == "float":
            assert_same_answer(output[custom_id], sync)
            continue
        assert output[custom_id]["usage"] == sync["usage"]
        if custom_id == "int8-base64":
            rows = [
                np.frombuffer(base64.b64decode(item["embedding"]), dtype="i1")
                for item in output[custom_id]["data"]
            ]
            listed = np.array([item["embedding"] for item in output["int8"]["data"]])
            np.testing.assert_array_equal(np.stack(rows), listed)
            continue
        got = np.array([item["embedding"] for item in output[custom_id]["data"]])
        want = np.array([item["embedding"] for item in sync["data"]])
        assert got.dtype.kind == "i" and got.shape == want.shape == (3, 384 if custom_id == "int8" else 48)
        # Two inference runs may put a value on a rounding boundary (int8) or a sign at zero
        # (binary) apart; beyond that the answers are the same.
        if custom_id == "int8":
            assert np.abs(got - want).max() <= 1 and (got == want).mean() > 0.99
        else:
            assert (got == want).mean() > 0.9


LEGACY_EMPTY_FILE = """
from django.core.files.base import ContentFile
from embeddings.models import StoredFile, Tenant
from embeddings.services.openai_api.files import files_storage
name = files_storage().save("legacy/empty.jsonl", ContentFile(b" \\n\\n"))
stored = StoredFile.objects.create(
    public_id="file-" + "E" * 24, tenant=Tenant.objects.get(slug="jobs"), purpose="batch",
    filename="empty.jsonl", bytes=3, storage_name=name,
)
print(stored.public_id)
"""


@pytest.mark.parametrize("content", [b"", b"\n", b" \r\n\t\n"])
def test_a_batch_file_without_a_line_is_refused_at_upload(client, content):
    """It was stored, and a batch of it failed later, in validation."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("empty.jsonl", io.BytesIO(content)), purpose="batch")
    assert refused.value.body["code"] == "empty_file" and refused.value.body["param"] == "file"


def test_a_batch_of_a_file_without_a_line_is_refused_at_creation(client, job_stack):
    """Files stored before uploads were checked: refused when the batch is created, not validated."""
    file_id = job_stack.django.run(LEGACY_EMPTY_FILE).splitlines()[-1]
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert refused.value.body["code"] == "empty_file" and refused.value.body["param"] == "input_file_id"
    assert file_id in refused.value.body["message"]


def test_a_file_of_nothing_valid_fails_the_batch(client, job_stack):
    batch = client.batches.create(
        input_file_id=upload(client, [b"nope\n", b"{}\n"]).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    done = finished(client, job_stack, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert [error.line for error in done.errors.data] == [1, 2]
    assert done.output_file_id is None


def test_a_batch_over_the_limits_fails_naming_them(client, job_stack):
    over_requests = [request_line(f"r-{index}", {"model": MODEL, "input": "x"}) for index in range(10_001)]
    over_inputs = [request_line(f"i-{index}", {"model": MODEL, "input": ["x"] * 2048}) for index in range(10)]
    for lines, code in ((over_requests, "too_many_requests"), (over_inputs, "too_many_inputs")):
        batch = client.batches.create(
            input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
        )
        done = finished(client, job_stack, batch.id)
        assert done.status == "failed" and [error.code for error in done.errors.data] == [code], done


def test_quota_refusals_fail_the_batch_as_they_refuse_a_job(job_stack):
    """A batch's tokens are reserved as a job's are: a tenant whose daily budget cannot hold them,
    or whose job storage budget cannot hold its output, gets the batch failed with the code a job
    submission gets, and nothing runs."""
    lines = [
        request_line(f"q-{index}", {"model": MODEL, "input": "a text of some length"}) for index in range(20)
    ]
    for slug, limit, code in (
        ("poor", ["--tokens-per-day", "50"], "insufficient_quota"),
        ("cramped", ["--job-storage-budget-bytes", "4096"], "job_storage_budget_exceeded"),
    ):
        with sdk_client(job_stack, tenant_with_key(job_stack.django, slug, *limit)) as tenant:
            batch = tenant.batches.create(
                input_file_id=upload(tenant, lines).id, endpoint="/v1/embeddings", completion_window="24h"
            )
            done = finished(tenant, job_stack, batch.id)
            assert done.status == "failed" and done.output_file_id is None, done
            assert [error.code for error in done.errors.data] == [code], done.errors
            assert done.usage.input_tokens == 0


def test_batch_parameters_are_checked(client, http):
    input_file = upload(client, [request_line("a", {"model": MODEL, "input": "x"})])
    with pytest.raises(openai.UnprocessableEntityError):
        client.batches.create(
            input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.UnprocessableEntityError):
        client.batches.create(input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    response = http.post("/v1/batches", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400


def test_another_tenants_batch_and_file_are_not_found(client, job_stack, other_key):
    input_file = upload(client, [request_line("a", {"model": MODEL, "input": "x"})])
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    with sdk_client(job_stack, other_key) as other:
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.create(
                input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        assert batch.id not in {item.id for item in other.batches.list().data}
    every = [item.id for item in client.batches.list(limit=1)]  # the SDK follows `after`
    assert every == [item.id for item in client.batches.list(limit=100).data] and every[0] == batch.id
    finished(client, job_stack, batch.id)
    # A batch's job is not one of /v1/jobs.
    assert client.get("/jobs", cast_to=object)["data"] == []


def test_cancel_keeps_what_finished_and_names_every_other_request(client, job_stack):
    """Cancelled while the worker is paused (SIGSTOP) mid-batch: however fast its chunks (the lines
    are short), the batch cannot finish before the cancel lands."""
    lines = [request_line(f"c-{index}", {"model": MODEL, "input": f"text {index}"}) for index in range(3000)]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch.id).request_counts.completed == 0:
        assert time.monotonic() < deadline, job_stack.logs_tail()
        time.sleep(0.1)
    with process_group_paused(job_stack.worker):
        cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = finished(client, job_stack, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    output = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert 0 < len(output) < 3000
    assert {record["error"]["code"] for record in errors} == {"batch_cancelled"}
    ids = [record["custom_id"] for record in output + errors]
    assert sorted(ids) == sorted(f"c-{index}" for index in range(3000))
    assert done.request_counts.model_dump() == {
        "total": 3000,
        "completed": len(output),
        "failed": len(errors),
    }


def usage_totals(stack: JobStack) -> dict:
    with httpx2.Client(base_url=stack.base_url, headers=stack.headers, timeout=60) as session:
        response = session.get("/v1/usage")
    assert response.status_code == 200, response.text
    return response.json()["totals"]


EXPIRE_NOW = """
from datetime import timedelta
from django.utils import timezone
from embeddings.services.openai_api.batches import batches_expire_due
print(batches_expire_due(now=timezone.now() + timedelta(days=2)))
"""


def test_a_batch_past_its_completion_window_expires_with_partial_results(client, job_stack):
    """Expired while the worker is paused (SIGSTOP) mid-batch: however fast its chunks (the lines
    are short), the batch cannot finish before it expires."""
    lines = [
        request_line(f"e-{index}", {"model": MODEL, "input": f"expiring {index}"}) for index in range(1500)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.expires_at == batch.created_at + 24 * 3600
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch.id).request_counts.completed == 0:
        assert time.monotonic() < deadline, job_stack.logs_tail()
        time.sleep(0.1)
    with process_group_paused(job_stack.worker):
        assert job_stack.django.run(EXPIRE_NOW).splitlines()[-1] == "1"
    done = finished(client, job_stack, batch.id)
    assert done.status == "expired" and done.expired_at is not None and done.completed_at is None
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert 0 < len(output) < 1500 and {record["error"]["code"] for record in errors} == {"batch_expired"}
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"e-{index}" for index in range(1500))


def test_a_worker_sigkilled_mid_batch_leaves_every_custom_id_exactly_once(client, job_stack):
    """SIGKILL the worker's process group while the batch runs; a new worker and beat finish it (the
    watchdog re-sends the chunk whose lease lapsed or that was taken and never started, or the
    broker redelivers it): every custom_id once, each answer right."""
    count = 1000
    usage_before = usage_totals(job_stack)
    lines = [
        # 5 tokens: the 14 chunks left at the kill still take over a second (0.1 s each here), far
        # beyond the moment between seeing two chunks done and the kill (30 s at 110 tokens).
        request_line(f"k-{index}", {"model": MODEL, "input": f"kill test {index}"})
        for index in range(count)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch.id).request_counts.completed < 2 * CHUNK_SIZE:
        assert time.monotonic() < deadline, job_stack.logs_tail()
        time.sleep(0.05)
    os.killpg(job_stack.worker.pid, signal.SIGKILL)
    job_stack.worker.wait(timeout=10)
    assert client.batches.retrieve(batch.id).status == "in_progress"

    # A chunk the dead worker had taken but not started has no lease to lapse: it is re-sent once
    # it has waited JOB_STALL_S (120 s as shipped, which the test would wait out).
    env = {**job_stack.env, "JOB_WATCHDOG_INTERVAL_S": WATCHDOG_S, "JOB_STALL_S": STALL_S}
    worker_log, beat_log = job_stack.logs[1].with_name("worker2.log"), job_stack.logs[1].with_name("beat.log")
    worker, beat = start_celery("worker", worker_log, env=env), start_celery("beat", beat_log, env=env)
    job_stack.worker = worker  # serves the tests after this one; stopped with the stack
    job_stack.logs.append(worker_log)
    try:
        done = finished(client, job_stack, batch.id)
    finally:
        stop_process_group(beat)
    assert done.status == "completed", done
    records = file_lines(client, done.output_file_id)
    assert sorted(record["custom_id"] for record in records) == sorted(f"k-{index}" for index in range(count))
    assert done.request_counts.model_dump() == {"total": count, "completed": count, "failed": 0}
    # Usage counted once per line, the chunk the dead worker held included.
    usage_after = usage_totals(job_stack)
    assert usage_after["requests"] - usage_before["requests"] == count
    assert usage_after["inputs"] - usage_before["inputs"] == count
    assert (
        usage_after["tokens"] - usage_before["tokens"]
        == done.usage.input_tokens
        == sum(record["response"]["body"]["usage"]["prompt_tokens"] for record in records)
    )
    # Which of the legitimate recoveries brought the dead worker's chunk back (the new worker's
    # watchdog after its lease lapsed or, taken and never started, after JOB_STALL_S; or the
    # broker's redelivery of the unacknowledged task) is not the user's concern, only that every
    # line is there once: said, not asserted.
    taken_over = [line for line in worker_log.read_text().splitlines() if "watchdog: job" in line]
    print("\nrecovered by " + ("the watchdog:\n" + "\n".join(taken_over) if taken_over else "redelivery"))


def test_the_readme_example_runs_as_written(job_stack):
    """The README's SDK example, run as written against the stack: only the URL, the key and the
    poll's sleep differ (shorter, and failing past a deadline rather than polling forever)."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("### Batch API (OpenAI-compatible)") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")].replace("http://localhost:8080/v1", f"{job_stack.base_url}/v1")
    assert code.count("time.sleep(5)") == 1
    code = code.replace("time.sleep(5)", "poll_sleep()")
    deadline = time.monotonic() + 300

    def poll_sleep() -> None:
        assert time.monotonic() < deadline, job_stack.logs_tail()
        time.sleep(0.2)

    namespace: dict = {"KEY": job_stack.api_key, "poll_sleep": poll_sleep}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["batch"].status == "completed"
    assert (
        namespace["record"]["custom_id"] == "doc-1" and namespace["record"]["response"]["status_code"] == 200
    )
