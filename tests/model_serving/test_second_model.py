"""A second, different model goes from a directory on disk to being served next to MiniLM without
restarting anything, with the commands README's "Serving your own model" gives: `export_model`,
then `register_model` (which loads it into the running Triton), then requests. All on a real stack:
Triton in explicit model-control mode, uvicorn on a socket, a real Celery worker, Redis, the
database. The model is a small random BERT (128 dimensions, CLS pooling, MiniLM's tokenizer) made
offline; its vectors are compared with the same model run in PyTorch.

The tests run in file order and build on each other: register → serve → job → unload → reload →
new version → switch → disable."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import numpy as np
import pytest

from embeddings.triton.client import TritonClient
from tests.conftest import require_exported_model, start_triton
from tests.job_stack import JobStack, job_stack_running
from tests.processes import REPO_ROOT, manage
from tests.tiny_models import build_tiny_bert, embed_with_torch

MINILM = "all-MiniLM-L6-v2"
TINY = "tiny-bert"
TINY_TRITON = "tiny_bert"
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
    server.stop()


@pytest.fixture(scope="module")
def stack(explicit_triton, redis_server, repository, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=explicit_triton,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("stack"),
        chunk_size=3,
        # Every process reads the catalog fresh: what a command changed is seen by the next request.
        extra_env={"TRITON_MODEL_REPOSITORY": str(repository), "MODEL_CACHE_SECONDS": "0"},
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


def loaded_versions(triton: TritonClient, name: str) -> set[str]:
    return {
        entry.version for entry in triton.repository_index() if entry.name == name and entry.state == "READY"
    }


def test_exported_and_registered_it_is_served_next_to_minilm(http, stack, sources, repository, triton):
    manage(stack.env, "export_model", "--source", str(sources[1]), "--name", TINY_TRITON, "--pooling", "cls")
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

    manage(stack.env, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--alias", "tiny")
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
    refused = http.post("/v1/embeddings", json={"model": TINY, "input": TEXTS})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded" and TINY in error["message"], error
    assert embed(http, MINILM).shape == (len(TEXTS), 384)
    ready = http.get("/ready")
    assert ready.status_code == 200  # the default model is what readiness depends on
    assert ready.json()["models"][TINY]["state"] != "READY"

    # Registered and enabled: the reconcile (periodic, or a register) loads it again.
    manage(stack.env, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--alias", "tiny")
    assert embed(http, TINY).shape == (len(TEXTS), 128)


def test_a_new_export_is_a_new_version_that_serves_only_once_switched(
    http, stack, sources, repository, triton
):
    before = embed(http, TINY)
    manage(stack.env, "export_model", "--source", str(sources[2]), "--name", TINY_TRITON, "--pooling", "cls")
    assert (
        stack.env and Path(stack.env["TRITON_MODEL_REPOSITORY"]) / TINY_TRITON / "2" / "model.onnx"
    ).is_file()
    # The catalog pins version 1: a tenant's vectors do not change because a new export exists,
    # nor when the model is registered again without naming a version.
    assert np.array_equal(embed(http, TINY), before)
    manage(stack.env, "register_model", "--triton-model", TINY_TRITON)
    assert np.array_equal(embed(http, TINY), before)

    manage(stack.env, "register_model", "--triton-model", TINY_TRITON, "--name", TINY, "--version", "2")
    switched = embed(http, TINY)
    assert cosines(switched, embed_with_torch(sources[2], TEXTS, pooling="cls")).min() >= MIN_COSINE
    assert cosines(switched, before).max() < 0.99  # a different model, not the same vectors again
    assert "2" in loaded_versions(triton, TINY_TRITON)


def test_disabled_it_is_unloaded_and_no_longer_listed_until_registered_again(http, stack, triton):
    manage(
        stack.env,
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
    manage(stack.env, "register_model", "--triton-model", TINY_TRITON)
    assert loaded_versions(triton, TINY_TRITON) == {"2"}
    assert embed(http, TINY).shape == (len(TEXTS), 128)
