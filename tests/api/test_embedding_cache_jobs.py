"""The embedding cache on the blocking path through the real stack: uvicorn and a real Celery worker
(the run's Triton and Redis servers, the cache in the job store's), jobs through /v1/jobs and
OpenAI batches through the unmodified `openai` SDK. Texts embedded before (by the API, a job or
a batch) are not sent to Triton again, as Triton's own statistics count, and come back exactly
as they were computed; another tenant reads none of them; usage records what the cache answered.

The texts are of one length and go to Triton two or more a call (tests/conftest.py
texts_of_one_length), so an uncached job's vectors are comparable with a cached one's bit for bit.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx2
import numpy as np
import openai
import pytest

from embeddings.triton import TritonClient
from tests.api.test_jobs_end_to_end import finished as job_finished
from tests.batch_api.test_batches_sdk import file_lines, finished, request_line, sdk_client, upload
from tests.conftest import texts_of_one_length
from tests.job_stack import JobStack, job_stack_running
from tests.processes import tenant_with_key

MODEL = "all-MiniLM-L6-v2"
# A job of 10 texts runs in chunks of 4, 4 and 2; a batch's lines of 2 inputs two lines a chunk.
CHUNK_SIZE = 4


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, job_store_server, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("cache_stack"),
        chunk_size=CHUNK_SIZE,
        extra_env={
            "EMBEDDING_CACHE": "true",
            "EMBEDDING_CACHE_REDIS_URL": job_store_server.url,
            # Wide, so that a lookup on a loaded machine is not counted a miss.
            "EMBEDDING_CACHE_TIMEOUT_S": "2",
        },
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def other_key(job_stack) -> str:
    return tenant_with_key(job_stack.django, "other", name="Other")


def session(stack: JobStack, key: str | None = None) -> httpx2.Client:
    headers = {"Authorization": f"Bearer {key or stack.api_key}"}
    return httpx2.Client(base_url=stack.base_url, headers=headers, timeout=60)


@pytest.fixture
def http(job_stack) -> Iterator[httpx2.Client]:
    with session(job_stack) as client:
        yield client


@pytest.fixture
def other_http(job_stack, other_key) -> Iterator[httpx2.Client]:
    with session(job_stack, other_key) as client:
        yield client


class TritonRows:
    """Rows Triton has computed for minilm (its statistics), counted from the last reading."""

    def __init__(self, grpc_target: str) -> None:
        self.grpc_target = grpc_target
        self.last = self.total()

    def total(self) -> int:
        with TritonClient(self.grpc_target, channels=1, timeout_s=10) as client:
            return client.model_statistics("minilm").inference_count

    def since(self) -> int:
        now = self.total()
        rows, self.last = now - self.last, now
        return rows


@pytest.fixture
def triton_rows(job_stack, triton_server) -> TritonRows:
    return TritonRows(triton_server.grpc_target)


def usage_totals(http: httpx2.Client) -> dict[str, int]:
    response = http.get("/v1/usage")
    assert response.status_code == 200, response.text
    return response.json()["totals"]


def usage_since(http: httpx2.Client, before: dict[str, int]) -> dict[str, int]:
    after = usage_totals(http)
    names = ("inputs", "tokens", "cached_inputs", "cached_tokens")
    return {name: after[name] - before[name] for name in names}


def run_job(http: httpx2.Client, stack: JobStack, texts: list[str], **options) -> tuple[dict, np.ndarray]:
    """A job of `texts` run to its end: the job, and its vectors as the npy download gives them."""
    submitted = http.post("/v1/jobs", json={"model": MODEL, "input": texts, **options})
    assert submitted.status_code == 202, submitted.text
    job = job_finished(http, stack, submitted.json()["id"])
    assert job["status"] == "completed", job
    download = http.get(f"/v1/jobs/{job['id']}/results?format=npy")
    assert download.status_code == 200, download.text
    return job, np.load(io.BytesIO(download.content))


def test_a_job_sends_only_what_its_tenant_did_not_embed_before(http, other_http, job_stack, triton_rows):
    texts = texts_of_one_length(10)
    api = http.post("/v1/embeddings", json={"model": MODEL, "input": texts[:4], "encoding_format": "base64"})
    assert api.status_code == 200, api.text
    assert triton_rows.since() == 4
    # Another tenant's job reads none of those four: every row computed, none from the cache.
    _, uncached = run_job(other_http, job_stack, texts, result_dtype="float32")
    assert triton_rows.since() == 10

    before = usage_totals(http)
    job, vectors = run_job(http, job_stack, texts, result_dtype="float32")
    assert triton_rows.since() == 6  # the four the API embedded came from the cache
    assert vectors.dtype == np.float32 and np.array_equal(vectors, uncached)
    api_vectors = np.stack(
        [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in api.json()["data"]]
    )
    assert np.array_equal(vectors[:4], api_vectors)
    tokens = job["usage"]["prompt_tokens"]
    hit_tokens = api.json()["usage"]["prompt_tokens"]
    assert job["usage"]["prompt_tokens_details"] == {"cached_tokens": hit_tokens}
    assert usage_since(http, before) == {
        "inputs": 10, "tokens": tokens, "cached_inputs": 4, "cached_tokens": hit_tokens,
    }  # fmt: skip

    # Again, in the model's result dtype: every row from the job's entries, nothing sent.
    before = usage_totals(http)
    again, stored = run_job(http, job_stack, texts)
    assert triton_rows.since() == 0
    stored_as = np.dtype(again["result_dtype"])
    assert np.array_equal(stored, uncached.astype(stored_as).astype(np.float32))
    assert again["usage"]["prompt_tokens"] == tokens  # the job's usage counts every token
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": tokens}
    assert usage_since(http, before) == {
        "inputs": 10, "tokens": tokens, "cached_inputs": 10, "cached_tokens": tokens,
    }  # fmt: skip


def run_batch(client: openai.OpenAI, stack: JobStack, lines: list[bytes]) -> dict[str, dict]:
    """A batch of `lines` run to its end: each custom_id's response body."""
    input_file = upload(client, lines)
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = finished(client, stack, batch.id)
    assert done.status == "completed" and done.error_file_id is None, done
    records = file_lines(client, done.output_file_id)
    assert all(record["response"]["status_code"] == 200 for record in records), records
    return {record["custom_id"]: record["response"]["body"] for record in records}


def test_a_batch_whose_lines_repeat_earlier_ones_is_served_from_the_cache(http, job_stack, triton_rows):
    texts = texts_of_one_length(16)
    old, new = texts[:12], texts[12:]

    def line(custom_id: str, pair: list[str]) -> bytes:
        return request_line(custom_id, {"model": MODEL, "input": pair, "encoding_format": "base64"})

    old_lines = [line(f"old-{index}", old[2 * index : 2 * index + 2]) for index in range(6)]
    with sdk_client(job_stack) as client:
        first = run_batch(client, job_stack, old_lines)
        assert triton_rows.since() == 12
        # The same lines between two new ones: only the new ones' rows are sent.
        before = usage_totals(http)
        repeated = [line("new-0", new[:2]), *old_lines, line("new-1", new[2:])]
        second = run_batch(client, job_stack, repeated)
    assert triton_rows.since() == 4
    assert {custom_id: second[custom_id] for custom_id in first} == first  # the vectors bit for bit
    old_tokens = sum(body["usage"]["prompt_tokens"] for body in first.values())
    tokens = sum(body["usage"]["prompt_tokens"] for body in second.values())
    assert usage_since(http, before) == {
        "inputs": 16, "tokens": tokens, "cached_inputs": 12, "cached_tokens": old_tokens,
    }  # fmt: skip
