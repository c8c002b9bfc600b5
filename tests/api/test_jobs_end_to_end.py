"""A job's whole life on a real stack: uvicorn serving the API and a real Celery worker embedding the
chunks (real Triton, real Redis, one database shared by both), then downloads in every format,
equal to the synchronous /v1/embeddings of the same inputs; results stored as float16, within
their documented precision of float32 on real sentences."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator

import httpx2
import numpy as np
import orjson
import pytest
import redis

from tests.database_backend import database_execute
from tests.job_stack import JobStack, job_stack_running
from tests.processes import manage, process_group_paused

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"document number {i}: {'a longer text ' * (i % 4)}about embeddings" for i in range(10)]
# Chunks of 4: three chunks, the last one short.
CHUNK_SIZE = 4


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("job_stack"),
        chunk_size=CHUNK_SIZE,
    ) as stack:
        yield stack


@pytest.fixture
def http(job_stack) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=job_stack.base_url, headers=job_stack.headers, timeout=60) as client:
        yield client


def finished(http: httpx2.Client, stack: JobStack, job_id: str, timeout_s: float = 120) -> dict:
    """Poll until the job finishes (a deadline against hanging, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in {"completed", "failed", "cancelled", "expired"}:
            return job
        time.sleep(0.2)
    pytest.fail(f"job {job_id} did not finish: {job}\n{stack.logs_tail()}")


# Whether a completed job's storage hold is settled: the engine marks the job completed first, then
# frees its inputs and lowers its hold (services/jobs/engine.py job_finalize).
HOLD_SETTLED = """
from embeddings.models import JobStorageHold
hold = JobStorageHold.objects.get(public_id={job_id!r})
print(hold.stored_bytes == hold.kept_bytes + hold.result_bytes)
"""


def finished_and_settled(http: httpx2.Client, stack: JobStack, job_id: str, timeout_s: float = 120) -> dict:
    """finished(), then until the completed job's hold no longer counts its inputs (a deadline
    against hanging, not a timing): what a tenant's usage then says is what the job keeps."""
    job = finished(http, stack, job_id, timeout_s)
    assert job["status"] == "completed", job
    deadline = time.monotonic() + timeout_s
    while stack.django.run(HOLD_SETTLED.format(job_id=job_id)) != "True":
        assert time.monotonic() < deadline, f"job {job_id}'s storage hold never settled"
        time.sleep(0.05)
    return job


def synchronous(http: httpx2.Client, texts: list[str], **options) -> tuple[np.ndarray, int]:
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": texts, **options})
    assert response.status_code == 200, response.text
    body = response.json()
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32), body["usage"][
        "prompt_tokens"
    ]


def jsonl_vectors(body: bytes, *, encoding: str) -> tuple[list[dict], np.ndarray]:
    records = [orjson.loads(line) for line in body.splitlines()]
    if encoding == "base64":
        vectors = [np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4") for r in records]
    else:
        vectors = [np.array(r["embedding"], dtype=np.float32) for r in records]
    return records, np.stack(vectors)


def test_submit_poll_download_in_every_format(http, job_stack):
    # The worker held back (SIGSTOP) until the job has been seen unfinished.
    with process_group_paused(job_stack.worker):
        submitted = http.post("/v1/jobs", json={"model": MODEL, "input": TEXTS, "metadata": {"run": "e2e"}})
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        # Not downloadable before it finishes, in any format.
        for fmt in ("npy", "jsonl", "json"):
            early = http.get(f"/v1/jobs/{job_id}/results?format={fmt}")
            assert early.status_code == 409, early.text
            assert early.json()["error"]["code"] == "job_not_finished"
    job = finished(http, job_stack, job_id)
    expected, tokens = synchronous(http, TEXTS)
    assert job["status"] == "completed", job
    assert job["counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert job["usage"] == {"prompt_tokens": tokens, "prompt_tokens_details": {"cached_tokens": 0}}
    assert job["error"] is None and job["metadata"] == {"run": "e2e"}
    assert job["started_at"] is not None and job["finished_at"] >= job["started_at"]

    npy = http.get(f"/v1/jobs/{job_id}/results?format=npy")
    assert npy.status_code == 200, npy.text
    assert npy.headers["content-disposition"] == f'attachment; filename="{job_id}.npy"'
    assert int(npy.headers["content-length"]) == len(npy.content)
    array = np.load(io.BytesIO(npy.content))
    assert array.dtype == np.float32 and array.shape == (10, 384)
    np.testing.assert_allclose(array, expected, atol=2e-5)

    for encoding in ("float", "base64"):
        jsonl = http.get(f"/v1/jobs/{job_id}/results?format=jsonl&encoding_format={encoding}")
        assert jsonl.status_code == 200, jsonl.text
        assert jsonl.headers["content-disposition"] == f'attachment; filename="{job_id}.jsonl"'
        records, vectors = jsonl_vectors(jsonl.content, encoding=encoding)
        assert [r["index"] for r in records] == list(range(10))
        assert all("id" not in r and "error" not in r for r in records)
        np.testing.assert_allclose(vectors, expected, atol=2e-5)

    pages, offset = [], 0
    while True:
        page = http.get(f"/v1/jobs/{job_id}/results?format=json&offset={offset}&limit=3").json()
        assert page["object"] == "list" and page["total"] == 10 and page["model"] == MODEL
        pages += page["data"]
        offset += 3
        if not page["has_more"]:
            break
    assert offset == 12 and [r["index"] for r in pages] == list(range(10))
    np.testing.assert_allclose(np.array([r["embedding"] for r in pages]), expected, atol=2e-5)
    assert http.get(f"/v1/jobs/{job_id}/results?format=json&offset=20").json()["data"] == []


def test_an_uploaded_jsonl_keeps_its_ids_and_options(http, job_stack):
    lines = b"".join(orjson.dumps({"id": f"doc-{i}", "text": text}) + b"\n" for i, text in enumerate(TEXTS))
    submitted = http.post(
        "/v1/jobs",
        files={"file": ("corpus.jsonl", lines, "application/octet-stream")},
        data={"model": MODEL, "dimensions": "64", "encoding_format": "base64"},
    )
    assert submitted.status_code == 202, submitted.text
    job = finished(http, job_stack, submitted.json()["id"])
    assert job["status"] == "completed" and job["dimensions"] == 64, job
    expected, _ = synchronous(http, TEXTS, dimensions=64)
    # The job's encoding_format (base64) is the download's default.
    jsonl = http.get(f"/v1/jobs/{job['id']}/results?format=jsonl")
    records, vectors = jsonl_vectors(jsonl.content, encoding="base64")
    assert [r["id"] for r in records] == [f"doc-{i}" for i in range(10)]
    np.testing.assert_allclose(vectors, expected, atol=2e-5)
    page = http.get(f"/v1/jobs/{job['id']}/results?format=json&offset=8&limit=5&encoding_format=float").json()
    assert [r["id"] for r in page["data"]] == ["doc-8", "doc-9"] and page["has_more"] is False
    np.testing.assert_allclose(np.array([r["embedding"] for r in page["data"]]), expected[8:], atol=2e-5)


# Real sentences of every kind a corpus holds: short, long, numbers, code, other scripts, emoji.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors so that similar meanings lie close together.",
    "Paris is the capital and most populous city of France.",
    "The mitochondria is the powerhouse of the cell.",
    "Please reset my password; I can no longer log in to my account.",
    "Revenue grew 12.5% year over year, to $4.2 billion in Q3 2026.",
    "def add(a, b): return a + b",
    "SELECT name, email FROM users WHERE created_at > '2026-01-01';",
    "She sells sea shells by the sea shore.",
    "A transformer encoder attends to every token of its input at once.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "I love this product 😍 — five stars, would buy again!",
    "The patient presented with a persistent cough and mild fever for three days.",
    "Ok.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The court ruled that the contract was void because it lacked consideration.",
    "How do I convert a PDF to a Word document without losing the formatting?",
    "In 1969, Apollo 11 landed the first humans on the Moon.",
    "Machine learning models can inherit the biases present in their training data. " * 6,
    "Shipping is free on orders over fifty euros within the European Union.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Error 503: the service is temporarily unavailable, please retry later.",
]
# float16 rounds each value to 11 significant bits: within 2^-11 of it, relative (README, "Result
# precision"); below 2^-14 its subnormal spacing's half, 2^-25, absolute.
FLOAT16_RELATIVE_ERROR = 2.0**-11
# How far two inference runs of the same inputs may differ (batched differently by Triton).
INFERENCE_NOISE = 2e-5


def cosines(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    dot = np.sum(first.astype(np.float64) * second, axis=1)
    return dot / (np.linalg.norm(first.astype(np.float64), axis=1) * np.linalg.norm(second, axis=1))


def downloads(http: httpx2.Client, job_id: str) -> dict[str, np.ndarray]:
    """The job's vectors as each download format returns them (all float32)."""
    npy = http.get(f"/v1/jobs/{job_id}/results?format=npy")
    assert npy.status_code == 200 and int(npy.headers["content-length"]) == len(npy.content), npy.text
    vectors = {"npy": np.load(io.BytesIO(npy.content))}
    assert vectors["npy"].dtype == np.dtype("<f4")
    for encoding in ("float", "base64"):
        body = http.get(f"/v1/jobs/{job_id}/results?format=jsonl&encoding_format={encoding}").content
        vectors[f"jsonl-{encoding}"] = jsonl_vectors(body, encoding=encoding)[1]
    page = http.get(f"/v1/jobs/{job_id}/results?format=json&limit=1000").json()
    vectors["json"] = np.array([record["embedding"] for record in page["data"]], dtype=np.float32)
    return vectors


def stored_result_bytes(stack: JobStack, job_id: str) -> int:
    client = redis.Redis.from_url(stack.env.get("JOB_STORE_URL") or stack.env["REDIS_URL"])
    try:
        return sum(client.strlen(key) for key in client.scan_iter(f"job:{{{job_id}}}:out:*"))
    finally:
        client.close()


def test_float16_results_are_float32_downloads_within_the_documented_precision(http, job_stack):
    """The same real sentences stored as float32 and as float16 (asked by the job, or set on the
    model), through uvicorn and a Celery worker: float16 keeps half the bytes in the job store and
    comes back as float32 in every format, each value within 2^-11 relative, cosine >= 0.9999."""
    # A second catalog name for the same Triton model, whose jobs store float16 by default.
    manage(
        job_stack.env, "shell", "-c",
        "from embeddings.models import EmbeddingModel as M; m = M.objects.get(name='all-MiniLM-L6-v2'); "
        "m.pk = None; m.name = 'minilm-half'; m.aliases = []; m.result_dtype = 'float16'; m.save()",
    )  # fmt: skip
    # The server reads its catalog every MODEL_CACHE_SECONDS: the new model answers within that.
    deadline = time.monotonic() + 60
    while (
        by_model := http.post("/v1/jobs", json={"model": "minilm-half", "input": SENTENCES})
    ).status_code == 404:
        assert time.monotonic() < deadline, by_model.text
        time.sleep(0.5)
    assert by_model.status_code == 202 and by_model.json()["result_dtype"] == "float16", by_model.text
    jobs = {"float16 by model": by_model.json()["id"]}
    submissions = {
        "float32": {"model": MODEL, "result_dtype": "float32"},
        # The model's own setting, overridden by the job.
        "float32 asked of the float16 model": {"model": "minilm-half", "result_dtype": "float32"},
    }
    for name, options in submissions.items():
        submitted = http.post("/v1/jobs", json={"input": SENTENCES, **options})
        assert submitted.status_code == 202, submitted.text
        jobs[name] = submitted.json()["id"]
    # Asked as a form field of an upload.
    lines = b"".join(orjson.dumps({"id": str(i), "text": text}) + b"\n" for i, text in enumerate(SENTENCES))
    uploaded = http.post(
        "/v1/jobs",
        files={"file": ("corpus.jsonl", lines, "application/jsonl")},
        data={"model": MODEL, "result_dtype": "float16"},
    )
    assert uploaded.status_code == 202, uploaded.text
    jobs["float16"] = uploaded.json()["id"]

    results = {}
    for name, job_id in jobs.items():
        job = finished(http, job_stack, job_id)
        assert job["status"] == "completed", job
        results[name] = downloads(http, job_id)
        bytes_per_value = 4 if name.startswith("float32") else 2
        assert job["result_dtype"] == ("float32" if bytes_per_value == 4 else "float16")
        assert stored_result_bytes(job_stack, job_id) == len(SENTENCES) * 384 * bytes_per_value, name

    figures = {}
    reference = results["float32"]["npy"]
    for half in ("float16", "float16 by model"):
        stored = results[half]["npy"]
        # What was stored is float16 (every value one), and every format returns it as float32.
        np.testing.assert_array_equal(stored.astype(np.float16).astype(np.float32), stored)
        for fmt, vectors in results[half].items():
            np.testing.assert_array_equal(vectors, stored, err_msg=fmt)
        # Against the float32 job: float16's rounding, plus what two inference runs of the same
        # inputs may differ by (INFERENCE_NOISE, as the other tests here allow).
        error = np.abs(stored - reference)
        bound = np.abs(reference) * FLOAT16_RELATIVE_ERROR + INFERENCE_NOISE
        assert np.all(error <= bound), (half, float((error - bound).max()))
        cosine = cosines(stored, reference)
        assert cosine.min() >= 0.9999, (half, cosine.min())
        normal = np.abs(reference) >= 2.0**-14
        figures[half] = {
            "min cosine": float(cosine.min()),
            "max abs error": float(error.max()),
            "max relative error": float((error[normal] / np.abs(reference[normal])).max()),
            "max |value|": float(np.abs(reference).max()),
        }
    print("float16 against float32 on", len(SENTENCES), "sentences:", figures)


def test_job_storage_budget_on_the_real_stack(http, job_stack):
    """Through uvicorn and a worker: a job holds its bytes from submission, gives its inputs' back
    when it ends, a job that does not fit is refused with nothing stored, and delete frees all."""

    def held() -> int:
        return http.get("/v1/usage").json()["job_storage"]["used_bytes"]

    # The earlier tests' jobs in this stack hold bytes too: room for 60 kB more.
    before = held()
    tenant = "UPDATE embeddings_tenant SET job_storage_budget_bytes = %s WHERE slug = 'jobs'"
    database_execute(job_stack.env["DATABASE_URL"], tenant, before + 60_000)
    try:
        with process_group_paused(job_stack.worker):
            submitted = http.post("/v1/jobs", json={"model": MODEL, "input": TEXTS})
            assert submitted.status_code == 202, submitted.text
            at_submission = held() - before
        job = finished_and_settled(http, job_stack, submitted.json()["id"])
        store = redis.Redis.from_url(job_stack.env.get("JOB_STORE_URL") or job_stack.env["REDIS_URL"])
        job_keys = [key.decode() for key in store.keys(f"job:{{{job['id']}}}:*")]
        assert [key for key in job_keys if ":in:" in key] == [] and any(":out:" in key for key in job_keys)
        storage = http.get("/v1/usage").json()["job_storage"]
        # 10 inputs x 384 dimensions x 4 bytes of results stay; the inputs' bytes came back.
        assert 10 * 384 * 4 < storage["used_bytes"] - before < at_submission
        assert storage["budget_bytes"] == before + 60_000

        # More inputs than the whole budget holds in results alone (384 x 4 bytes each): never fits.
        too_many = (before + 60_000) // (384 * 4) + 1
        too_big = http.post("/v1/jobs", json={"model": MODEL, "input": (TEXTS * too_many)[:too_many]})
        assert too_big.status_code == 413, too_big.text
        assert too_big.json()["error"]["code"] == "job_storage_budget_exceeded"
        assert http.get("/v1/jobs").json()["data"][0]["id"] == job["id"]

        assert http.delete(f"/v1/jobs/{job['id']}").status_code == 200
        assert held() == before
    finally:
        database_execute(job_stack.env["DATABASE_URL"], tenant, None)


def synchronous_rows(http: httpx2.Client, texts: list[str], **options) -> np.ndarray:
    """POST /v1/embeddings' rows as it answers them (integers for the quantised types)."""
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": texts, **options})
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]])


def quantised_downloads(http: httpx2.Client, job_id: str, dtype: str, width: int) -> dict[str, np.ndarray]:
    """The job's vectors as each download format returns them, in the job's quantised type."""
    npy = http.get(f"/v1/jobs/{job_id}/results?format=npy")
    assert npy.status_code == 200 and int(npy.headers["content-length"]) == len(npy.content), npy.text
    vectors = {"npy": np.load(io.BytesIO(npy.content))}
    assert vectors["npy"].dtype == np.dtype(dtype) and vectors["npy"].shape == (len(SENTENCES), width)
    jsonl = http.get(f"/v1/jobs/{job_id}/results?format=jsonl").content
    records = [orjson.loads(line) for line in jsonl.splitlines()]
    assert all(isinstance(value, int) for record in records for value in record["embedding"])
    vectors["jsonl"] = np.array([record["embedding"] for record in records])
    encoded = http.get(f"/v1/jobs/{job_id}/results?format=jsonl&encoding_format=base64").content
    vectors["jsonl-base64"] = np.stack(
        [
            np.frombuffer(base64.b64decode(orjson.loads(line)["embedding"]), dtype=dtype)
            for line in encoded.splitlines()
        ]
    )
    page = http.get(f"/v1/jobs/{job_id}/results?format=json&limit=1000").json()
    vectors["json"] = np.array([record["embedding"] for record in page["data"]])
    return vectors


def test_int8_and_binary_jobs_store_their_real_size_and_download_in_their_type(http, job_stack):
    """Jobs asking int8 and binary output through uvicorn and a worker: the job store keeps one byte
    a dimension (int8) and one bit (binary), the tenant's storage hold is smaller than a float32
    job's by exactly those bytes, and every download format gives the synchronous answer's type."""

    def held() -> int:
        return http.get("/v1/usage").json()["job_storage"]["used_bytes"]

    rows = len(SENTENCES)
    holds, jobs = {}, {}
    for output_dtype in ("float", "int8", "binary", "ubinary"):
        before = held()
        # float16 asked too: a quantised type is stored as itself, float16 is for float results.
        submitted = http.post(
            "/v1/jobs",
            json={
                "model": MODEL,
                "input": SENTENCES,
                "output_dtype": output_dtype,
                "result_dtype": "float16",
            },
        )
        assert submitted.status_code == 202, submitted.text
        assert submitted.json()["output_dtype"] == output_dtype and submitted.json()["input_type"] is None
        job = finished_and_settled(http, job_stack, submitted.json()["id"])
        assert job["output_dtype"] == output_dtype, job
        jobs[output_dtype] = job["id"]
        holds[output_dtype] = held() - before  # the results' and ids' bytes, the inputs' given back

    stored = {name: stored_result_bytes(job_stack, job_id) for name, job_id in jobs.items()}
    assert stored == {"float": rows * 384 * 2, "int8": rows * 384, "binary": rows * 48, "ubinary": rows * 48}
    # Same inputs, same chunks: the holds differ by the results' bytes alone.
    assert holds["float"] - holds["int8"] == rows * 384 * (2 - 1)
    assert holds["int8"] - holds["binary"] == rows * (384 - 48)
    assert holds["binary"] == holds["ubinary"]
    print("stored result bytes of", rows, "384-d vectors:", stored, "held:", holds)

    floats = synchronous_rows(http, SENTENCES).astype(np.float32)
    int8 = quantised_downloads(http, jobs["int8"], "i1", 384)
    reference = synchronous_rows(http, SENTENCES, output_dtype="int8")
    for fmt, vectors in int8.items():
        np.testing.assert_array_equal(vectors, int8["npy"], err_msg=fmt)
    # Against the synchronous answer: two inference runs (other batches) may put a value that sits on
    # a rounding boundary one step apart, nothing more.
    assert np.abs(int8["npy"].astype(int) - reference).max() <= 1
    assert (int8["npy"] == reference).mean() > 0.99
    for name, dtype in (("binary", "i1"), ("ubinary", "u1")):
        packed = quantised_downloads(http, jobs[name], dtype, 48)
        for fmt, vectors in packed.items():
            np.testing.assert_array_equal(vectors, packed["npy"], err_msg=(name, fmt))
        expected = np.packbits(floats > 0, axis=1)
        if name == "binary":
            expected = (expected.astype(np.int16) - 128).astype(np.int8)
        # Signs of values that are not within inference noise of zero are exact.
        sure = np.packbits(np.abs(floats) > INFERENCE_NOISE, axis=1) == 255
        np.testing.assert_array_equal(packed["npy"][sure], expected[sure], err_msg=name)
        synchronous_packed = synchronous_rows(http, SENTENCES, output_dtype=name)
        np.testing.assert_array_equal(packed["npy"][sure], synchronous_packed[sure], err_msg=name)


def test_a_job_output_type_the_model_cannot_give_is_refused_with_nothing_stored(http, job_stack):
    before = http.get("/v1/usage").json()["job_storage"]["used_bytes"]
    refused = http.post(
        "/v1/jobs", json={"model": MODEL, "input": TEXTS, "output_dtype": "binary", "dimensions": 100}
    )
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "output_dtype", refused.text
    unknown = http.post("/v1/jobs", json={"model": MODEL, "input": TEXTS, "input_type": "web"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "input_type", unknown.text
    assert http.get("/v1/usage").json()["job_storage"]["used_bytes"] == before


def test_a_job_input_type_picks_the_prompt_the_model_maps_it_to(http, job_stack):
    manage(
        job_stack.env, "shell", "-c",
        "from embeddings.models import EmbeddingModel as M; m = M.objects.get(name='all-MiniLM-L6-v2'); "
        "m.pk = None; m.name = 'minilm-e5'; m.aliases = []; "
        "m.prompts = {'query': 'query: ', 'passage': 'passage: '}; "
        "m.input_types = {'query': 'query', 'document': 'passage'}; m.save()",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    lines = b"".join(text.encode() + b"\n" for text in TEXTS)
    while (
        uploaded := http.post(
            "/v1/jobs",
            files={"file": ("queries.txt", lines, "text/plain")},
            data={"model": "minilm-e5", "input_type": "search_query", "output_dtype": "int8"},
        )
    ).status_code == 404:
        assert time.monotonic() < deadline, uploaded.text
        time.sleep(0.5)
    assert uploaded.status_code == 202, uploaded.text
    documents = http.post("/v1/jobs", json={"model": "minilm-e5", "input": TEXTS, "input_type": "document"})
    assert documents.status_code == 202, documents.text
    query_job = finished(http, job_stack, uploaded.json()["id"])
    document_job = finished(http, job_stack, documents.json()["id"])
    assert (query_job["input_type"], query_job["output_dtype"]) == ("search_query", "int8")
    assert (document_job["input_type"], document_job["output_dtype"]) == ("document", "float")

    document_npy = np.load(io.BytesIO(http.get(f"/v1/jobs/{document_job['id']}/results?format=npy").content))
    expected, _ = synchronous(http, ["passage: " + text for text in TEXTS])
    np.testing.assert_allclose(document_npy, expected, atol=INFERENCE_NOISE)
    query_npy = np.load(io.BytesIO(http.get(f"/v1/jobs/{query_job['id']}/results?format=npy").content))
    queries = synchronous_rows(http, ["query: " + text for text in TEXTS], output_dtype="int8")
    assert query_npy.dtype == np.int8 and np.abs(query_npy.astype(int) - queries).max() <= 1
    # Not the unprompted vectors: the prompt made a difference the test can see.
    assert np.abs(query_npy.astype(int) - synchronous_rows(http, TEXTS, output_dtype="int8")).max() > 1
