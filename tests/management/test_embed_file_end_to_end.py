"""`manage.py embed_file` run as a user runs it, in a subprocess, against a real stack (uvicorn, a
Celery worker, Triton, Redis, one sqlite file): the vectors it writes equal the synchronous
/v1/embeddings of the same texts, JSONL ids come back in order, and a bad key fails cleanly."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import orjson
import pytest

from tests.job_stack import JobStack, job_stack_running
from tests.processes import REPO_ROOT

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"line {i} of the corpus: {'some more words ' * (i % 3)}about vectors" for i in range(10)]


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    # Chunks of 4: three chunks, the last one short.
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("embed_file_stack"),
        chunk_size=4,
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected(job_stack) -> np.ndarray:
    """The synchronous float vectors of TEXTS."""
    response = httpx2.post(
        f"{job_stack.base_url}/v1/embeddings",
        json={"model": MODEL, "input": TEXTS},
        headers=job_stack.headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


def embed_file(
    stack: JobStack, input: Path, out: Path, *, key: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "embed_file", str(input), "--model", MODEL, "--out", str(out),
         "--url", stack.base_url, "--key", key or stack.api_key, "--poll-interval", "0.2"],
        cwd=REPO_ROOT, env=stack.env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_a_text_file_to_npy(job_stack, expected, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS))
    out = tmp_path / "vectors.npy"
    done = embed_file(job_stack, corpus, out)
    assert done.returncode == 0, f"{done.stderr}\n{job_stack.logs_tail()}"
    assert "wrote 10 vectors" in done.stderr, done.stderr
    # Not a terminal: the bar's lines as a log gets them; the finished one with the average rate.
    assert re.search(r"\] 0/10 +0% queued  -- emb/s  --:-- left\n", done.stderr), done.stderr
    assert re.search(r"\] 10/10 100% completed  [\d.,]+ emb/s  took \d+s\n", done.stderr), done.stderr
    assert "\r" not in done.stderr
    vectors = np.load(out)
    assert vectors.dtype == np.float32 and vectors.shape == (10, 384)
    np.testing.assert_allclose(vectors, expected, atol=2e-5)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "vectors.npy"]


def test_a_jsonl_file_keeps_its_ids_in_order(job_stack, expected, tmp_path):
    ids = [f"doc-{index:02d}" for index in reversed(range(10))]  # not sorted: order is the file's
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b"".join(
            orjson.dumps({"id": doc_id, "text": text}) + b"\n"
            for doc_id, text in zip(ids, TEXTS, strict=True)
        )
    )
    out = tmp_path / "vectors.jsonl"
    done = embed_file(job_stack, corpus, out)
    assert done.returncode == 0, f"{done.stderr}\n{job_stack.logs_tail()}"
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [record["id"] for record in records] == ids
    assert [record["index"] for record in records] == list(range(10))
    np.testing.assert_allclose(np.array([r["embedding"] for r in records]), expected, atol=2e-5)


def test_an_invalid_key_fails_with_the_servers_message_and_writes_nothing(job_stack, tmp_path):
    bad_key = "emb_not_a_real_key"
    refused = httpx2.get(f"{job_stack.base_url}/v1/jobs", headers={"Authorization": f"Bearer {bad_key}"})
    assert refused.status_code == 401
    message = refused.json()["error"]["message"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS))
    done = embed_file(job_stack, corpus, tmp_path / "vectors.npy", key=bad_key)
    assert done.returncode != 0
    assert f"401: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt"]
