"""A second, different model goes from a directory on disk to being served next to MiniLM without
restarting anything, with the commands README's "Serving your own model" gives: `export_model`,
then `register_model` (which loads it into the running Triton), then requests. All on a real stack:
Triton in explicit model-control mode, uvicorn on a socket, a real Celery worker, Redis, the
database. The model is a small random BERT (128 dimensions, CLS pooling, MiniLM's tokenizer) made
offline; its vectors are compared with the same model run in PyTorch.

The tests run in file order and build on each other: register → serve → job → unload → reload →
new version → switch → disable → an int8 version served beside it under a second name, and a
float16 one under a third. The stack
runs with the embedding cache on (its own Redis database): every comparison below holds with it,
and a new version is a miss. Then two
cross-encoders (a BERT with token types, an XLM-R without) are exported as rerank models,
registered, and rank through the three rerank shapes, their scores compared with PyTorch's."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import numpy as np
import pytest
import redis

from embeddings.triton.client import TritonClient
from tests.api.test_metrics import parse, value
from tests.conftest import require_exported_model, start_triton
from tests.job_stack import JobStack, job_stack_running
from tests.processes import REPO_ROOT, tenant_with_key
from tests.tiny_models import build_tiny_bert, embed_with_torch, score_with_torch

MINILM = "all-MiniLM-L6-v2"
TINY = "tiny-bert"
TINY_TRITON = "tiny_bert"
TINY_INT8 = "tiny-bert-int8"
TINY_FLOAT16 = "tiny-bert-float16"
TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語のテキスト, and emoji 🚀 all tokenise.",
    "a much longer text about embeddings " * 8,
]
MIN_COSINE = 0.9999


def cosines(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    first, second = first.astype(np.float64), second.astype(np.float64)
    return (first * second).sum(axis=1) / (np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1))


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """A model repository of its own, MiniLM in it as the stack serves it: exports go here, not
    into the checkout."""
    require_exported_model(REPO_ROOT / "model_repository")
    repository = tmp_path_factory.mktemp("repository")
    (repository / "minilm").symlink_to(REPO_ROOT / "model_repository" / "minilm")
    return repository


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[int, Path]:
    """Two different random BERTs: version 1 and version 2 of the same served name."""
    root = tmp_path_factory.mktemp("sources")
    return {seed: build_tiny_bert(root / f"seed{seed}", seed=seed) for seed in (1, 2)}


@pytest.fixture(scope="module")
def explicit_triton(repository, tmp_path_factory):
    """Triton as `make run` runs it: explicit model control, MiniLM loaded at start."""
    server = start_triton(
        tmp_path_factory.mktemp("triton"),
        [repository],
        model_control_mode="explicit",
        startup_models=["minilm"],
    )
    yield server
    server.stop(timeout_s=0)


@pytest.fixture(scope="module")
def stack(
    explicit_triton, redis_server, job_store_server, repository, tmp_path_factory
) -> Iterator[JobStack]:
    cache_url = job_store_server.url.rsplit("/", 1)[0] + "/8"  # a database no other test uses
    # The critical Redis in a database of its own too: stacks before this one on the same server
    # leave usage counters unfolded, whose tenant ids name this stack's tenants once folded here.
    critical_url = redis_server.url.rsplit("/", 1)[0] + "/9"
    for url in (cache_url, critical_url):
        redis.Redis.from_url(url).flushdb()
    with job_stack_running(
        triton_server=explicit_triton,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("stack"),
        chunk_size=3,
        # Every process reads the catalog fresh: what a command changed is seen by the next request.
        extra_env={
            "TRITON_MODEL_REPOSITORY": str(repository),
            "MODEL_CACHE_SECONDS": "0",
            "EMBEDDING_CACHE": "true",
            "EMBEDDING_CACHE_REDIS_URL": cache_url,
            "REDIS_URL": critical_url,
        },
    ) as stack:
        yield stack


@pytest.fixture
def http(stack) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=stack.base_url, headers=stack.headers, timeout=60) as client:
        yield client


@pytest.fixture
def triton(explicit_triton) -> Iterator[TritonClient]:
    with TritonClient(explicit_triton.grpc_target) as client:
        yield client


def embed(http: httpx2.Client, model: str, texts: list[str] = TEXTS) -> np.ndarray:
    response = http.post("/v1/embeddings", json={"model": model, "input": texts})
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


def cache_rows(http: httpx2.Client) -> dict[str, float]:
    """The server's embedding cache rows by where they were found (local, redis, miss)."""
    samples = parse(http.get("/metrics").text)
    return {
        result: value(samples, "embedsite_embedding_cache_rows_total", result=result) for result in RESULTS
    }


RESULTS = ("local", "redis", "miss")


def command(stack: JobStack, *arguments: str) -> str:
    """`manage.py ARGUMENTS`, run as manage.py runs it (the same parser and checks) in the stack's
    Django shell, in the stack's settings: Django and PyTorch start once for the file's exports and
    registrations, not once for each (a new process's torch import was most of an export's CPU)."""
    (output,) = stack.django.commands(arguments)
    return output


def loaded_versions(triton: TritonClient, name: str) -> set[str]:
    return {
        entry.version for entry in triton.repository_index() if entry.name == name and entry.state == "READY"
    }


def test_exported_and_registered_it_is_served_next_to_minilm(http, stack, sources, repository, triton):
    command(stack, "export_model", "--source", str(sources[1]), "--name", TINY_TRITON, "--pooling", "cls")
    folder = repository / TINY_TRITON
    for path in (
        "config.pbtxt",
        "configs/cpu.pbtxt",
        "configs/gpu.pbtxt",
        "1/model.onnx",
        "1/tokenizer.json",
    ):
        assert (folder / path).is_file(), path
    assert loaded_versions(triton, TINY_TRITON) == set()  # exporting loads nothing

    command(stack, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--alias", "tiny")
    assert loaded_versions(triton, TINY_TRITON) == {"1"}

    listed = {model["id"] for model in http.get("/v1/models").json()["data"]}
    assert {TINY, MINILM} <= listed
    served = embed(http, TINY)
    assert served.shape == (len(TEXTS), 128)
    reference = embed_with_torch(sources[1], TEXTS, pooling="cls")
    assert cosines(served, reference).min() >= MIN_COSINE
    assert np.array_equal(embed(http, "tiny"), served)  # the alias
    assert embed(http, MINILM).shape == (len(TEXTS), 384)

    ready = http.get("/ready").json()
    states = {name: entry["state"] for name, entry in ready["models"].items()}
    assert states[TINY] == "READY" and states[MINILM] == "READY", ready


def test_both_models_answer_side_by_side_under_concurrent_requests(http):
    names = [TINY, MINILM] * 6
    with ThreadPoolExecutor(len(names)) as pool:
        shapes = list(pool.map(lambda name: embed(http, name, TEXTS[:2]).shape, names))
    assert shapes == [(2, 128), (2, 384)] * 6


def test_a_job_on_the_second_model_runs_on_the_worker(http, stack, sources):
    texts = [f"{text} #{i}" for i, text in enumerate(TEXTS * 2)]
    submitted = http.post("/v1/jobs", json={"model": TINY, "input": texts})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    deadline = time.monotonic() + 120  # against hanging only
    while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] not in {"completed", "failed"}:
        assert time.monotonic() < deadline, f"{job}\n{stack.logs_tail()}"
        time.sleep(0.2)
    assert job["status"] == "completed", job
    vectors = np.load(io.BytesIO(http.get(f"/v1/jobs/{job_id}/results?format=npy").content))
    assert vectors.shape == (len(texts), 128)
    assert cosines(vectors, embed_with_torch(sources[1], texts, pooling="cls")).min() >= MIN_COSINE


def test_unloaded_it_answers_503_naming_it_while_minilm_keeps_serving(http, stack, triton):
    triton.model_unload(TINY_TRITON)
    # A text the embedding cache cannot hold yet: it must go to Triton.
    refused = http.post("/v1/embeddings", json={"model": TINY, "input": ["not embedded before", *TEXTS]})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded" and TINY in error["message"], error
    assert embed(http, MINILM).shape == (len(TEXTS), 384)
    ready = http.get("/ready")
    assert ready.status_code == 200  # the default model is what readiness depends on
    assert ready.json()["models"][TINY]["state"] != "READY"

    # Registered and enabled: the reconcile (periodic, or a register) loads it again.
    command(stack, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--alias", "tiny")
    assert embed(http, TINY).shape == (len(TEXTS), 128)


def test_a_new_export_is_a_new_version_that_serves_only_once_switched(
    http, stack, sources, repository, triton
):
    before = embed(http, TINY)
    cached = cache_rows(http)
    assert np.array_equal(embed(http, TINY), before)  # a repeat: every row from the cache
    assert cache_rows(http)["local"] - cached["local"] == len(TEXTS)
    command(stack, "export_model", "--source", str(sources[2]), "--name", TINY_TRITON, "--pooling", "cls")
    assert (
        stack.env and Path(stack.env["TRITON_MODEL_REPOSITORY"]) / TINY_TRITON / "2" / "model.onnx"
    ).is_file()
    # The catalog pins version 1: a tenant's vectors do not change because a new export exists,
    # nor when the model is registered again without naming a version.
    assert np.array_equal(embed(http, TINY), before)
    command(stack, "register_model", "--triton-model", TINY_TRITON)
    assert np.array_equal(embed(http, TINY), before)

    cache_before = cache_rows(http)
    command(stack, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--version", "2")
    switched = embed(http, TINY)
    # Version 1's vectors were cached; the new version's key differs, so every row is computed.
    assert cache_rows(http)["miss"] - cache_before["miss"] == len(TEXTS)
    assert cosines(switched, embed_with_torch(sources[2], TEXTS, pooling="cls")).min() >= MIN_COSINE
    assert cosines(switched, before).max() < 0.99  # a different model, not the same vectors again
    assert "2" in loaded_versions(triton, TINY_TRITON)


def test_disabled_it_is_unloaded_and_no_longer_listed_until_registered_again(http, stack, triton):
    command(
        stack,
        "register_model",
        "--triton-model",
        TINY_TRITON,
        "--name",
        TINY,
        "--version",
        "2",
        "--disable",
    )
    assert loaded_versions(triton, TINY_TRITON) == set()
    assert TINY not in {model["id"] for model in http.get("/v1/models").json()["data"]}
    gone = http.post("/v1/embeddings", json={"model": TINY, "input": TEXTS})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    assert embed(http, MINILM).shape == (len(TEXTS), 384)

    # Registering it again means serving it again.
    command(stack, "register_model", "--triton-model", TINY_TRITON)
    assert loaded_versions(triton, TINY_TRITON) == {"2"}
    assert embed(http, TINY).shape == (len(TEXTS), 128)


def test_an_int8_export_serves_beside_float32_under_a_second_name_that_says_its_dtype(
    http, stack, sources, repository, triton
):
    # A random BERT agrees less with its int8 graph than a trained one: the threshold only needs to pass.
    command(
        stack, "export_model", "--source", str(sources[2]), "--name", TINY_TRITON, "--pooling", "cls",
        "--dtype", "int8", "--min-cosine", "0.5",
    )  # fmt: skip
    info = json.loads((repository / TINY_TRITON / "3" / "export.json").read_text())
    assert info["dtype"] == "int8"
    # The float32 name keeps its pin (version 2); a second name pins the newest int8 export.
    command(stack, "register_model", "--triton-model", TINY_TRITON, "--name", TINY_INT8, "--dtype", "int8")
    assert loaded_versions(triton, TINY_TRITON) == {"2", "3"}

    listed = {model["id"]: model for model in http.get("/v1/models").json()["data"]}
    assert (listed[TINY]["dtype"], listed[TINY]["agreement"]) == ("float32", None)
    assert listed[TINY_INT8]["dtype"] == "int8"
    assert listed[TINY_INT8]["agreement"] == {
        "reference": "float32",
        "min_cosine": info["int8"]["min_cosine"],
        "mean_cosine": info["int8"]["mean_cosine"],
        "recall_at_10": info["int8"]["recall_at_10"],
        "text_count": 500,
    }
    assert 0.5 <= info["int8"]["min_cosine"] < info["int8"]["mean_cosine"] < 1.0
    states = http.get("/ready").json()["models"]
    assert (states[TINY]["version"], states[TINY]["dtype"]) == ("2", "float32")
    assert (states[TINY_INT8]["version"], states[TINY_INT8]["dtype"], states[TINY_INT8]["state"]) == (
        "3",
        "int8",
        "READY",
    )
    assert states[MINILM]["dtype"] == "float32"
    # The same backend and provider; the int8 graph computes in int8.
    assert states[TINY_INT8]["engine"] == {"name": "onnxruntime-cpu", "precision": "int8"}
    assert states[TINY]["engine"] == {"name": "onnxruntime-cpu", "precision": "float32"}

    # Both answer, each from its own version (the embedding cache keys them apart).
    float32, int8 = embed(http, TINY), embed(http, TINY_INT8)
    assert not np.array_equal(float32, int8)
    assert cosines(int8, float32).min() > 0.5


def test_a_float16_export_serves_on_the_cpu_backend_as_close_to_float32_as_it_recorded(
    http, stack, repository, sources, triton
):
    # The same source as the float32 name's version 2, at the default threshold (0.9999).
    _, registered = stack.django.commands(
        [
            "export_model",
            "--source",
            str(sources[2]),
            "--name",
            TINY_TRITON,
            "--pooling",
            "cls",
            "--dtype",
            "float16",
        ],
        ["register_model", "--triton-model", TINY_TRITON, "--name", TINY_FLOAT16, "--dtype", "float16"],
    )
    info = json.loads((repository / TINY_TRITON / "4" / "export.json").read_text())
    assert info["dtype"] == "float16"
    assert "version 4 (128-d, 128 tokens, float16)" in registered
    # Beside the float32 (2) and int8 (3) names' versions, with the CPU config every version shares.
    assert loaded_versions(triton, TINY_TRITON) == {"2", "3", "4"}

    listed = {model["id"]: model for model in http.get("/v1/models").json()["data"]}
    assert listed[TINY_FLOAT16]["dtype"] == "float16"
    assert listed[TINY_FLOAT16]["agreement"] == {
        "reference": "float32",
        **{key: info["float16"][key] for key in ("min_cosine", "mean_cosine", "recall_at_10", "text_count")},
    }
    states = http.get("/ready").json()["models"]
    assert (states[TINY_FLOAT16]["version"], states[TINY_FLOAT16]["dtype"]) == ("4", "float16")
    assert states[TINY_FLOAT16]["state"] == "READY"

    float32, float16 = embed(http, TINY), embed(http, TINY_FLOAT16)
    assert not np.array_equal(float32, float16)  # its own graph answered, not version 2's
    # These texts are not the held-out ones: the bound is the one the export was held to.
    assert cosines(float16, float32).min() >= info["float16"]["min_cosine_required"] == 0.9999
    np.testing.assert_allclose(np.linalg.norm(float16, axis=1), 1.0, atol=2e-6)  # normalised in float32


FOLDED_ROWS = """
import json
from embeddings.models import UsageBucket
from embeddings.services.quotas.usage import usage_fold
usage_fold()
rows = UsageBucket.objects.filter(tenant__slug="variants").order_by("model_version", "endpoint")
print(json.dumps([[r.model, r.endpoint, r.model_version, r.model_dtype, r.requests, r.tokens] for r in rows]))
"""


def served_tokens(http: httpx2.Client, stack: JobStack) -> tuple[int, int]:
    """One request's tokens and one job's (two chunks of three) on tiny-bert, as it is pinned now."""
    answer = http.post("/v1/embeddings", json={"model": TINY, "input": TEXTS[:2]})
    assert answer.status_code == 200, answer.text
    submitted = http.post("/v1/jobs", json={"model": TINY, "input": TEXTS + TEXTS[:2]})
    assert submitted.status_code == 202, submitted.text
    deadline = time.monotonic() + 120  # against hanging only
    while (job := http.get(f"/v1/jobs/{submitted.json()['id']}").json())["status"] != "completed":
        assert job["status"] != "failed" and time.monotonic() < deadline, f"{job}\n{stack.logs_tail()}"
        time.sleep(0.2)
    return answer.json()["usage"]["total_tokens"], job["usage"]["prompt_tokens"]


def test_usage_rows_record_the_variant_that_served_before_and_after_a_switch_to_int8(stack):
    """tiny-bert, pinned to its float32 version 2, serves a request and a job; switched to the int8
    version 3 (`register_model --dtype int8`), the same name serves another of each. The fold files
    them in one row per variant and endpoint, and /v1/usage by variant tells the two apart."""
    headers = {"Authorization": f"Bearer {tenant_with_key(stack.django, 'variants')}"}
    with httpx2.Client(base_url=stack.base_url, headers=headers, timeout=60) as http:
        float32_request, float32_job = served_tokens(http, stack)
        command(stack, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--dtype", "int8")
        int8_request, int8_job = served_tokens(http, stack)
        by_variant = http.get("/v1/usage", params={"group_by": "variant"}).json()["data"]

    assert json.loads(stack.django.run(FOLDED_ROWS)) == [
        [TINY, "jobs", "2", "float32", 2, float32_job],
        [TINY, "openai", "2", "float32", 1, float32_request],
        [TINY, "jobs", "3", "int8", 2, int8_job],
        [TINY, "openai", "3", "int8", 1, int8_request],
    ]
    assert [(row["model"], row["model_version"], row["model_dtype"], row["requests"], row["tokens"])
            for row in by_variant] == [
        (TINY, "2", "float32", 3, float32_request + float32_job),
        (TINY, "3", "int8", 3, int8_request + int8_job),
    ]  # fmt: skip


# --- A cross-encoder: exported, registered and ranking beside the embedding models ----------------

RERANKERS = {"tiny-reranker": "tiny_reranker", "tiny-xlmr-reranker": "tiny_xlmr_reranker"}
QUERY = "what do tenants pay for?"
DOCUMENTS = [
    "Tenants pay for the tokens their requests use.",
    "Bananas are yellow.",
    "Ünïcödé àccents, 日本語のテキスト and emoji 🚀 in one document.",
    "Yes.",
    # Past the tiny models' 128 tokens a pair: only the document is cut.
    " ".join(f"word{i} of a long document" for i in range(60)),
]


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory) -> dict[str, Path]:
    """A random BERT cross-encoder (token types) and an XLM-R one (one token type, its pair template)."""
    root = tmp_path_factory.mktemp("cross-encoders")
    return {
        "tiny-reranker": build_tiny_bert(root / "bert", seed=11, cross_encoder=True),
        "tiny-xlmr-reranker": build_tiny_bert(
            root / "xlmr", model_type="xlm-roberta", seed=12, cross_encoder=True
        ),
    }


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-logits))


def pair_tokens(source: Path, query: str, documents: list[str]) -> int:
    """Every token of every pair, as the model's tokenizer pairs them (truncated at its 128)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=128, strategy="only_second")
    return sum(len(tokenizer.encode(query, document).ids) for document in documents)


def rerank_v2(http: httpx2.Client, model: str, **fields) -> dict:
    response = http.post(
        "/v2/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_cross_encoders_exported_and_registered_score_pairs_as_pytorch_does(
    http, stack, cross_encoders, triton
):
    for name, triton_name in RERANKERS.items():
        output = command(
            stack,
            "export_model",
            "--source",
            str(cross_encoders[name]),
            "--name",
            triton_name,
            "--task",
            "rerank",
        )
        assert "cross-encoder, sigmoid scores" in output
        command(stack, "register_model", "--triton-model", triton_name, "--name", name)
        assert loaded_versions(triton, triton_name) == {"1"}

        reference = score_with_torch(cross_encoders[name], QUERY, DOCUMENTS)
        assert np.ptp(reference) > 0.05, reference  # scores far apart: the order below means something
        answer = rerank_v2(http, name)
        ranked = [result["index"] for result in answer["results"]]
        assert ranked == np.argsort(-reference, kind="stable").tolist()
        served = np.array(
            [result["relevance_score"] for result in sorted(answer["results"], key=lambda r: r["index"])]
        )
        # Sigmoid of logits within 1e-4 of PyTorch's (the export's tolerance) is within 2.5e-5.
        np.testing.assert_allclose(served, sigmoid(reference), rtol=0, atol=3e-5)
        # Every pair's tokens are billed, the query once a pair.
        billed = answer["meta"]["billed_units"]
        assert billed == {
            "search_units": 1,
            "input_tokens": pair_tokens(cross_encoders[name], QUERY, DOCUMENTS),
        }

    models = {model["id"]: model for model in http.get("/v1/models").json()["data"]}
    for name in RERANKERS:
        assert models[name]["task"] == "rerank" and models[name]["dimensions"] == 1
        assert models[name]["rerank"] == {
            "method": "cross_encoder",
            "activation": "sigmoid",
            "score_range": [0.0, 1.0],
        }
    states = {model: entry["state"] for model, entry in http.get("/ready").json()["models"].items()}
    assert all(states[name] == "READY" for name in RERANKERS), states


def test_the_three_rerank_shapes_answer_from_the_cross_encoder(http, cross_encoders):
    reference = score_with_torch(cross_encoders["tiny-reranker"], QUERY, DOCUMENTS)
    best = np.argsort(-reference, kind="stable").tolist()

    top = rerank_v2(http, "tiny-reranker", top_n=2)
    assert [result["index"] for result in top["results"]] == best[:2]

    jina = http.post(
        "/v1/rerank",
        json={
            "model": "tiny-reranker",
            "query": QUERY,
            "documents": DOCUMENTS,
            "top_n": 3,
            "return_documents": True,
        },
    )
    assert jina.status_code == 200, jina.text
    assert [(result["index"], result["document"]["text"]) for result in jina.json()["results"]] == [
        (index, DOCUMENTS[index]) for index in best[:3]
    ]

    # TEI's /rerank names no model: the caller's first cross-encoder answers, preferred to MiniLM's
    # similarity; raw_scores gives its logits.
    tei = http.post(
        "/rerank",
        json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True, "return_text": True, "truncate": True},
    )
    assert tei.status_code == 200, tei.text
    ranks = tei.json()
    assert [rank["index"] for rank in ranks] == best
    assert ranks[0]["text"] == DOCUMENTS[best[0]]
    logits = np.array([rank["score"] for rank in sorted(ranks, key=lambda rank: rank["index"])])
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4 * max(1.0, np.abs(reference).max()))
    assert not ((logits >= 0) & (logits <= 1)).all() or np.abs(logits - sigmoid(logits)).max() > 0.1


def test_a_cross_encoders_truncation_limits_and_task_are_kept(http, cross_encoders):
    # TEI's default is not to truncate: the long document does not fit its pair.
    refused = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS})
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["message"].startswith("Document 4 has"), refused.text
    # max_tokens_per_doc cuts every document to 3 tokens of its own: the query's stay.
    query_tokens = pair_tokens(cross_encoders["tiny-reranker"], QUERY, ["Yes"]) - 4  # [CLS] q [SEP] yes [SEP]
    short = rerank_v2(http, "tiny-reranker", max_tokens_per_doc=3)
    assert short["meta"]["billed_units"]["input_tokens"] <= len(DOCUMENTS) * (query_tokens + 3 + 3)
    reference = score_with_torch(cross_encoders["tiny-reranker"], QUERY, DOCUMENTS, max_document_tokens=3)
    served = {result["index"]: result["relevance_score"] for result in short["results"]}
    np.testing.assert_allclose(
        [served[i] for i in range(len(DOCUMENTS))], sigmoid(reference), rtol=0, atol=3e-5
    )
    # A query that leaves no room for a document, and an embedding request to a rerank model.
    too_long = http.post(
        "/v2/rerank", json={"model": "tiny-reranker", "query": "word " * 200, "documents": ["a"]}
    )
    assert too_long.status_code == 413, too_long.text
    error = too_long.json()["error"]
    assert error["param"] == "query" and error["message"].startswith("The query has 203 tokens"), error
    wrong_task = http.post("/v1/embeddings", json={"model": "tiny-reranker", "input": "hello"})
    assert wrong_task.status_code == 422, wrong_task.text
    assert "is a rerank model" in wrong_task.json()["error"]["message"], wrong_task.text


def test_concurrent_rerank_requests_share_calls_and_each_gets_its_own_scores(http, stack):
    queries = [f"question {i} about tenants and tokens" for i in range(8)]
    alone = [rerank_v2(http, "tiny-reranker", query=query)["results"] for query in queries]

    def together(query: str) -> list:
        with httpx2.Client(base_url=stack.base_url, headers=stack.headers, timeout=60) as client:
            return rerank_v2(client, "tiny-reranker", query=query)["results"]

    with ThreadPoolExecutor(len(queries)) as pool:
        answers = list(pool.map(together, queries))
    for expected, got in zip(alone, answers, strict=True):
        assert [result["index"] for result in got] == [result["index"] for result in expected]
        np.testing.assert_allclose(
            [result["relevance_score"] for result in got],
            [result["relevance_score"] for result in expected],
            atol=1e-6,
        )
