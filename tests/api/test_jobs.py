"""/v1/jobs over the real ASGI app (real Triton and Redis): submission as JSON and as uploads,
validation, isolation between tenants, idempotency, results before the end and after expiry.

The whole life of a job (a real Celery worker embedding it, downloads in every format) is in
test_jobs_end_to_end.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from embeddings.models import EmbeddingJob
from embeddings.redis.connections import redis_job_store
from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.jobs.engine import job_chunk_run, job_expire_due
from embeddings.services.quotas.limits import quota_status_sync

MODEL = "all-MiniLM-L6-v2"


def job_body(**fields) -> dict:
    return {"model": MODEL, "input": ["alpha", "beta", "gamma"], **fields}


async def submit(client, tenant, body=None, *, key: str | None = None, **kwargs):
    headers = dict(tenant.headers)
    if key is not None:
        headers["Idempotency-Key"] = key
    if body is None and "files" not in kwargs:
        body = job_body()
    if body is not None:
        kwargs["json"] = body
    return await client.post("/v1/jobs", headers=headers, **kwargs)


async def upload(client, tenant, content: bytes, content_type="text/plain", filename="texts.txt", **fields):
    return await client.post(
        "/v1/jobs",
        headers=tenant.headers,
        files={"file": (filename, content, content_type)},
        data={"model": MODEL, **fields},
    )


@sync_to_async
def stored_nothing() -> bool:
    """No job row and no job key in the job store."""
    return EmbeddingJob.objects.count() == 0 and not list(redis_job_store().scan_iter("job:*"))


def assert_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == response.headers["x-request-id"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# --- Submission -----------------------------------------------------------------------------------


async def test_submit_json_answers_202_with_the_queued_job_and_its_location(client, alpha):
    response = await submit(client, alpha, job_body(metadata={"corpus": "news"}, dimensions=64))
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["object"] == "embedding.job"
    assert job["id"] and response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] in {"queued", "running"}
    assert job["model"] == MODEL
    assert job["counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert job["metadata"] == {"corpus": "news"}
    assert job["dimensions"] == 64 and job["encoding_format"] == "float"
    assert job["error"] is None and job["finished_at"] is None
    assert job["expires_at"] > job["created_at"]
    # The Location answers the same job.
    read = await client.get(response.headers["location"], headers=alpha.headers)
    assert read.status_code == 200
    assert read.json()["id"] == job["id"]
    assert read.json()["counts"]["total"] == 3


async def test_submit_a_text_file_one_input_a_line(client, alpha):
    response = await upload(client, alpha, b"first line\n\nsecond line\r\nthird\n", metadata='{"k": "v"}')
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["counts"]["total"] == 3
    assert job["metadata"] == {"k": "v"}


async def test_result_dtype_is_the_requests_else_the_models(client, alpha, model):
    default = await submit(client, alpha)
    assert default.status_code == 202, default.text
    assert default.json()["result_dtype"] == "float32"
    asked = await submit(client, alpha, job_body(result_dtype="float16"))
    assert asked.status_code == 202, asked.text
    assert asked.json()["result_dtype"] == "float16"
    as_form_field = await upload(client, alpha, b"one\ntwo\n", result_dtype="float16")
    assert as_form_field.status_code == 202, as_form_field.text
    assert as_form_field.json()["result_dtype"] == "float16"
    model.result_dtype = "float16"
    await sync_to_async(model.save)(update_fields=["result_dtype"])
    embedding_model_cache_clear()  # a change applies within MODEL_CACHE_SECONDS; here at once
    by_model = await submit(client, alpha)
    assert by_model.json()["result_dtype"] == "float16"
    # null is "not asked": the model's setting.
    assert (await submit(client, alpha, job_body(result_dtype=None))).json()["result_dtype"] == "float16"
    overridden = await submit(client, alpha, job_body(result_dtype="float32"))
    assert overridden.json()["result_dtype"] == "float32"
    read = await client.get(f"/v1/jobs/{by_model.json()['id']}", headers=alpha.headers)
    assert read.json()["result_dtype"] == "float16"


async def test_submit_a_jsonl_file_with_ids(client, alpha):
    lines = b'{"id": "a", "text": "one"}\n{"id": 7, "text": "two"}\n'
    for content_type in ("application/jsonl", "application/octet-stream"):
        response = await upload(client, alpha, lines, content_type=content_type, filename="t.jsonl")
        assert response.status_code == 202, response.text
        assert response.json()["counts"]["total"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ["x"]}, "model"),
        ({"model": MODEL}, "input"),
        (job_body(input="just a string"), "input"),
        (job_body(input=[]), "input"),
        (job_body(input=["ok", 3]), "input"),
        (job_body(encoding_format="binary"), "encoding_format"),
        (job_body(dimensions=0), "dimensions"),
        (job_body(normalize="maybe"), "normalize"),
        (job_body(result_dtype="float64"), "result_dtype"),
        (job_body(result_dtype="FLOAT16"), "result_dtype"),
        (job_body(result_dtype=16), "result_dtype"),
        (job_body(result_dtype=["float16"]), "result_dtype"),
        (job_body(result_dtype={"dtype": "float16"}), "result_dtype"),
        (job_body(result_dtype=True), "result_dtype"),
        (job_body(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (job_body(metadata={"k": 1}), "metadata"),
        (job_body(metadata={"k" * 65: "v"}), "metadata"),
        (job_body(metadata={"k": "v" * 513}), "metadata"),
        (job_body(metadata={"k": "before\x00after"}), "metadata"),
        (job_body(metadata={"\x00": "v"}), "metadata"),
        (job_body(metadata=["k", "v"]), "metadata"),
        (job_body(callback_url="ftp://example.com/done"), "callback_url"),
        (job_body(callback_url="not a url"), "callback_url"),
        ([{"model": MODEL}], None),
    ],
)
async def test_invalid_submissions_are_422_and_create_nothing(client, alpha, body, param):
    assert_error(await submit(client, alpha, body), 422, param=param)
    assert await stored_nothing()


async def test_submission_errors_by_status(client, alpha):
    assert_error(
        await submit(client, alpha, job_body(model="no-such-model")), 404, "model_not_found", "model"
    )
    malformed = await client.post(
        "/v1/jobs", headers={**alpha.headers, "Content-Type": "application/json"}, content=b"{not json"
    )
    assert_error(malformed, 400)
    text = await client.post(
        "/v1/jobs", headers={**alpha.headers, "Content-Type": "text/plain"}, content=b"hello\nworld\n"
    )
    assert_error(text, 415, "unsupported_media_type")
    assert_error(await submit(client, alpha, key="k" * 256), 422, param="Idempotency-Key")
    assert_error(await client.post("/v1/jobs", json=job_body()), 401, "missing_api_key")
    assert await stored_nothing()


async def test_more_inputs_than_the_tenants_limit_is_413(client, alpha, settings):
    settings.JOB_MAX_INPUTS = 3
    assert_error(await submit(client, alpha, job_body(input=["a"] * 4)), 413, param="input")
    assert_error(await upload(client, alpha, b"a\nb\nc\nd\n"), 413, param="file")
    assert await stored_nothing()
    assert (await submit(client, alpha, job_body(input=["a"] * 3))).status_code == 202


async def test_the_tenants_max_inputs_per_job_applies(client, alpha, settings):
    alpha.tenant.max_inputs_per_job = 2
    await sync_to_async(alpha.tenant.save)(update_fields=["max_inputs_per_job"])
    assert_error(await submit(client, alpha, job_body(input=["a"] * 3)), 413, param="input")
    assert await stored_nothing()


@pytest.mark.parametrize(
    ("content", "content_type", "status", "code", "words"),
    [
        (b"fine\nnot \xff utf-8\n", "text/plain", 422, "invalid_value", "line 2: not UTF-8"),
        (b"", "text/plain", 422, "invalid_value", "no inputs"),
        (b"\n \n\n", "text/plain", 422, "invalid_value", "no inputs"),
        (b"short\n" + b"x" * 40 + b"\n", "text/plain", 413, "payload_too_large", "line 2: longer than 32"),
        (b'{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', "application/jsonl", 422, None, "twice"),
        (b'{"id": 1, "text": "a"}\nplain\n', "application/jsonl", 422, None, "line 2: not a JSON object"),
        (b"\x89PNG\r\n", "image/png", 415, "unsupported_media_type", "image/png"),
        (b"a,b\n", "application/pdf", 415, "unsupported_media_type", "application/pdf"),
    ],
)
async def test_bad_uploads_are_refused_and_create_nothing(
    client, alpha, settings, content, content_type, status, code, words
):
    settings.JOB_MAX_LINE_BYTES = 32
    error = assert_error(
        await upload(client, alpha, content, content_type=content_type), status, code, "file"
    )
    assert words in error["message"]
    assert await stored_nothing()


async def test_an_upload_over_the_size_limit_is_413(client, alpha, settings):
    settings.JOB_MAX_UPLOAD_BYTES = 1024
    error = assert_error(await upload(client, alpha, b"a line\n" * 200), 413, "payload_too_large", "file")
    assert "1024 bytes" in error["message"]
    assert await stored_nothing()


async def test_an_upload_without_a_file_part_or_with_bad_fields_is_422(client, alpha):
    no_file = await client.post(
        "/v1/jobs", headers=alpha.headers, files={"other": ("x.txt", b"a\n")}, data={}
    )
    assert_error(no_file, 422, param="file")
    assert_error(await upload(client, alpha, b"a\n", metadata="{not json"), 422, param="metadata")
    assert_error(await upload(client, alpha, b"a\n", encoding_format="hex"), 422, param="encoding_format")
    assert_error(await upload(client, alpha, b"a\n", result_dtype="half"), 422, param="result_dtype")
    assert await stored_nothing()


# --- Idempotency ----------------------------------------------------------------------------------


async def test_the_same_idempotency_key_and_request_answer_the_same_job(client, alpha):
    first = await submit(client, alpha, key="batch-1")
    assert first.status_code == 202, first.text
    again = await submit(client, alpha, key="batch-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"]
    # The same texts uploaded as a file are the same request.
    as_file = await upload(client, alpha, b"alpha\nbeta\ngamma\n")
    assert as_file.json()["id"] != first.json()["id"]  # no key: a new job
    keyed_file = await client.post(
        "/v1/jobs",
        headers={**alpha.headers, "Idempotency-Key": "batch-1"},
        files={"file": ("t.txt", b"alpha\nbeta\ngamma\n", "text/plain")},
        data={"model": MODEL},
    )
    assert keyed_file.status_code == 200, keyed_file.text
    assert keyed_file.json()["id"] == first.json()["id"]
    assert await sync_to_async(EmbeddingJob.objects.count)() == 2


@pytest.mark.parametrize(
    "changed",
    [
        job_body(input=["alpha", "beta", "delta"]),
        job_body(dimensions=32),
        job_body(encoding_format="base64"),
        job_body(normalize=False),
        job_body(result_dtype="float16"),
        job_body(metadata={"a": "b"}),
        job_body(callback_url="https://93.184.215.14/hook"),  # a public literal: no lookup, never sent
    ],
)
async def test_the_same_idempotency_key_with_another_request_is_409(client, alpha, changed):
    first = await submit(client, alpha, key="batch-2")
    assert first.status_code == 202
    assert_error(await submit(client, alpha, changed, key="batch-2"), 409, "idempotency_key_reused")
    assert await sync_to_async(EmbeddingJob.objects.count)() == 1


async def test_idempotency_keys_belong_to_one_tenant(client, alpha, beta):
    mine = await submit(client, alpha, key="shared-name")
    theirs = await submit(client, beta, key="shared-name")
    assert mine.status_code == theirs.status_code == 202
    assert mine.json()["id"] != theirs.json()["id"]


# --- Reading, listing, isolation --------------------------------------------------------------------


async def test_another_tenants_job_is_404_everywhere(client, alpha, beta):
    job_id = (await submit(client, alpha)).json()["id"]
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
        ("DELETE", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/results"),
        ("GET", f"/v1/jobs/{job_id}/results?format=npy"),
    ]:
        response = await client.request(method, path, headers=beta.headers)
        assert_error(response, 404, "job_not_found")
    listed = (await client.get("/v1/jobs", headers=beta.headers)).json()
    assert listed == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    # Beta's attempts changed nothing.
    read = await client.get(f"/v1/jobs/{job_id}", headers=alpha.headers)
    assert read.status_code == 200 and read.json()["status"] in {"queued", "running"}
    assert_error(await client.get("/v1/jobs/job_nope", headers=alpha.headers), 404, "job_not_found")


async def test_list_is_newest_first_and_paginated(client, alpha, beta):
    ids = [(await submit(client, alpha, job_body(input=[f"text {i}"]))).json()["id"] for i in range(3)]
    await submit(client, beta)
    page = (await client.get("/v1/jobs?limit=2", headers=alpha.headers)).json()
    assert page["object"] == "list"
    assert [job["id"] for job in page["data"]] == ids[::-1][:2]
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1] and page["has_more"] is True
    rest = (await client.get(f"/v1/jobs?limit=2&after={page['last_id']}", headers=alpha.headers)).json()
    assert [job["id"] for job in rest["data"]] == [ids[0]]
    assert rest["has_more"] is False
    assert_error(await client.get("/v1/jobs?limit=0", headers=alpha.headers), 422, param="limit")
    assert_error(await client.get("/v1/jobs?limit=101", headers=alpha.headers), 422, param="limit")


# --- Cancel, delete, results before the end and after it ------------------------------------------


async def test_results_are_409_until_the_job_finishes(client, alpha):
    job_id = (await submit(client, alpha)).json()["id"]
    for fmt in ("jsonl", "json", "npy"):
        response = await client.get(f"/v1/jobs/{job_id}/results?format={fmt}", headers=alpha.headers)
        assert_error(response, 409, "job_not_finished")
    assert_error(
        await client.get(f"/v1/jobs/{job_id}/results?format=csv", headers=alpha.headers), 422, param="format"
    )


async def test_cancel_a_queued_job(client, alpha):
    """A queued job's chunks wait in the broker (no worker runs them here): cancelling until the
    first of them is delivered, which ends the job cancelled, nothing embedded, its tokens refunded."""
    alpha.tenant.tokens_per_day = 10_000
    await sync_to_async(alpha.tenant.save)(update_fields=["tokens_per_day"])
    job_id = (await submit(client, alpha)).json()["id"]
    assert await tokens_used_today(alpha) > 0  # the job's reservation
    cancelled = await client.post(f"/v1/jobs/{job_id}/cancel", headers=alpha.headers)
    assert cancelled.status_code == 200, cancelled.text
    assert (cancelled.json()["id"], cancelled.json()["status"]) == (job_id, "cancelling")
    read = (await client.get(f"/v1/jobs/{job_id}", headers=alpha.headers)).json()
    assert read["status"] == "cancelling" and read["finished_at"] is None

    job = await EmbeddingJob.objects.aget(public_id=job_id)
    await sync_to_async(job_chunk_run)(job_id=job.pk, chunk=0)  # what a worker does on delivery
    read = (await client.get(f"/v1/jobs/{job_id}", headers=alpha.headers)).json()
    assert (read["status"], read["counts"]["completed"]) == ("cancelled", 0)
    assert read["finished_at"] is not None
    assert await tokens_used_today(alpha) == 0
    assert (await client.post(f"/v1/jobs/{job_id}/cancel", headers=alpha.headers)).json()["status"] == (
        "cancelled"
    )


async def tokens_used_today(tenant) -> int:
    status = await sync_to_async(quota_status_sync)(tenant.tenant.pk)
    return status["tenant"]["tokens_per_day"]["used"]


async def test_delete_removes_the_job_and_its_data(client, alpha):
    job_id = (await submit(client, alpha)).json()["id"]
    assert list(redis_job_store().scan_iter(f"job:{{{job_id}}}:*"))
    deleted = await client.delete(f"/v1/jobs/{job_id}", headers=alpha.headers)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": job_id, "object": "embedding.job.deleted", "deleted": True}
    assert not list(redis_job_store().scan_iter(f"job:{{{job_id}}}:*"))
    # The row goes too (services.jobs.job_delete): the job is unknown from then on.
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/results?format=npy"),
        ("DELETE", f"/v1/jobs/{job_id}"),
    ]:
        assert_error(await client.request(method, path, headers=alpha.headers), 404, "job_not_found")
    assert (await client.get("/v1/jobs", headers=alpha.headers)).json()["data"] == []


async def finished_long_ago(job_id: str, *, expired: bool) -> None:
    """Mark the job completed, its expiry passed (expired) or to come."""
    now = timezone.now()
    await sync_to_async(EmbeddingJob.objects.filter(public_id=job_id).update)(
        status=EmbeddingJob.Status.COMPLETED,
        finished_at=now,
        expires_at=now + timedelta(seconds=-1 if expired else 3600),
    )


async def test_results_are_410_once_expired(client, alpha):
    job_id = (await submit(client, alpha)).json()["id"]
    await finished_long_ago(job_id, expired=False)
    ok = await client.get(f"/v1/jobs/{job_id}/results?format=json", headers=alpha.headers)
    assert ok.status_code == 200, ok.text
    await finished_long_ago(job_id, expired=True)
    # Past expires_at, before the sweep has run, and after it.
    for sweep in (False, True):
        if sweep:
            assert await sync_to_async(job_expire_due)() == 1
            assert (await client.get(f"/v1/jobs/{job_id}", headers=alpha.headers)).json()[
                "status"
            ] == "expired"
        for fmt in ("jsonl", "json", "npy"):
            response = await client.get(f"/v1/jobs/{job_id}/results?format={fmt}", headers=alpha.headers)
            assert_error(response, 410, "job_expired")


async def test_a_job_over_the_token_budget_is_429_and_creates_nothing(client, alpha):
    alpha.tenant.tokens_per_month = 10
    await sync_to_async(alpha.tenant.save)(update_fields=["tokens_per_month"])
    response = await submit(client, alpha, job_body(input=["a text long enough to need many tokens"] * 3))
    assert_error(response, 429, "insufficient_quota")
    assert "retry-after" in response.headers
    assert await sync_to_async(EmbeddingJob.objects.count)() == 0
    assert not list(redis_job_store().scan_iter("job:*"))


# --- Job storage budget (embeddings/services/jobs/budget.py) --------------------------------------


@sync_to_async
def set_job_storage_budget(tenant, budget_bytes: int | None) -> None:
    tenant.job_storage_budget_bytes = budget_bytes
    tenant.save(update_fields=["job_storage_budget_bytes"])


async def job_storage_of(client, tenant) -> dict:
    response = await client.get("/v1/usage", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()["job_storage"]


async def test_a_job_over_the_job_storage_budget_is_refused_and_usage_shows_the_bytes(client, alpha, beta):
    # Larger than the whole budget: it can never fit (413).
    await set_job_storage_budget(alpha.tenant, 1000)
    error = assert_error(await submit(client, alpha), 413, "job_storage_budget_exceeded", "input")
    assert "this tenant's job storage budget is 1000 bytes" in error["message"]
    assert await stored_nothing()
    assert await job_storage_of(client, alpha) == {
        "used_bytes": 0,
        "budget_bytes": 1000,
        "available_bytes": 1000,
    }

    # Room for one such job: the second does not fit now (429, retry once bytes come back).
    await set_job_storage_budget(alpha.tenant, 10_000)
    first = await submit(client, alpha)
    assert first.status_code == 202, first.text
    storage = await job_storage_of(client, alpha)
    assert storage["budget_bytes"] == 10_000 and 5_000 < storage["used_bytes"] <= 10_000
    assert storage["available_bytes"] == 10_000 - storage["used_bytes"]
    second = await submit(client, alpha)
    error = assert_error(second, 429, "job_storage_budget_exceeded", "input")
    assert error["type"] == "insufficient_quota" and second.headers["retry-after"] == "60"
    # Another tenant has its own budget.
    assert (await submit(client, beta)).status_code == 202
    # Deleting the job gives its bytes back at once.
    deleted = await client.delete(f"/v1/jobs/{first.json()['id']}", headers=alpha.headers)
    assert deleted.status_code == 200, deleted.text
    assert (await job_storage_of(client, alpha))["used_bytes"] == 0
    assert (await submit(client, alpha)).status_code == 202
