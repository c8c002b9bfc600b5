"""The model repository served by a real Triton: CPU model, tokenizer ensemble, cross-request batching.

Spoken to over Triton's HTTP/REST API (binary tensor extension) so these tests check the models, not
our gRPC client.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from django.conf import settings

from embeddings.tooling.export_threads import cpu_session
from tests.triton.statistics import settled

SENTENCES = [
    "hello",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé àccents and 日本語 and emoji 🚀 tokenise without trouble.",
    "How do I reset my password?",
    "Triton batches requests of different lengths together when ragged batching is allowed. " * 3,
    "word " * 400,  # truncated at 256 tokens
]


class TritonHttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[dict, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read()
            header_length = reply.headers.get("Inference-Header-Content-Length")
    except urllib.error.HTTPError as error:
        raise TritonHttpError(error.code, json.loads(error.read()).get("error", "")) from error
    if header_length is None:
        return json.loads(raw), b""
    return json.loads(raw[: int(header_length)]), raw[int(header_length) :]


def _infer(http_url: str, model: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """One inference with binary tensors; returns the `embedding` output."""
    parts = []
    described = []
    for name, array in inputs.items():
        if array.dtype == object:
            data = b"".join(len(item).to_bytes(4, "little") + item for item in array.reshape(-1))
            datatype = "BYTES"
        else:
            data = np.ascontiguousarray(array, dtype=np.int64).tobytes()
            datatype = "INT64"
        described.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(data)},
            }
        )
        parts.append(data)
    header = json.dumps(
        {"inputs": described, "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}
    ).encode()
    reply, raw = _post(
        f"{http_url}/v2/models/{model}/infer",
        header + b"".join(parts),
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    (output,) = reply["outputs"]
    assert output["datatype"] == "FP32"
    return np.frombuffer(raw, dtype=np.float32).reshape(output["shape"])


def _stats(http_url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=10) as reply:
        (stats,) = json.load(reply)["model_stats"]
    return stats


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def version_dir() -> Path:
    return Path(settings.TRITON_MODEL_REPOSITORY) / "minilm" / "1"


@pytest.fixture(scope="module")
def tokenizer(version_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(version_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def onnx_session(version_dir):
    return cpu_session(version_dir / "model.onnx")


def _encode(tokenizer, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encodings = tokenizer.encode_batch(sentences)
    input_ids = np.array([e.ids for e in encodings], dtype=np.int64)
    attention_mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    return input_ids, attention_mask


def _token_ids(length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A single-row request of exactly `length` tokens: [CLS] ... [SEP]."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(1000, 29000, size=(1, length), dtype=np.int64)
    input_ids[0, 0], input_ids[0, -1] = 101, 102
    return input_ids, np.ones_like(input_ids)


def test_minilm_matches_onnx_runtime_in_process(triton_server, tokenizer, onnx_session):
    input_ids, attention_mask = _encode(tokenizer, SENTENCES)
    assert input_ids.shape == (len(SENTENCES), 256)

    served = _infer(
        triton_server.http_url, "minilm", {"input_ids": input_ids, "attention_mask": attention_mask}
    )
    (reference,) = onnx_session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})

    assert served.shape == (len(SENTENCES), 384)
    assert _cosines(served, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


def test_text_ensemble_matches_the_token_path(triton_server, tokenizer):
    input_ids, attention_mask = _encode(tokenizer, SENTENCES)
    by_tokens = _infer(
        triton_server.http_url, "minilm", {"input_ids": input_ids, "attention_mask": attention_mask}
    )

    texts = np.array([sentence.encode() for sentence in SENTENCES], dtype=object).reshape(-1, 1)
    by_text = _infer(triton_server.http_url, "minilm_text", {"text": texts})

    assert by_text.shape == (len(SENTENCES), 384)
    assert _cosines(by_text, by_tokens).min() >= 0.9999


def test_text_ensemble_rejects_invalid_utf8(triton_server):
    texts = np.array([b"fine", b"\xff\xfe broken"], dtype=object).reshape(-1, 1)
    with pytest.raises(TritonHttpError) as raised:
        _infer(triton_server.http_url, "minilm_text", {"text": texts})
    assert raised.value.status == 400
    assert "UTF-8" in raised.value.message


def test_concurrent_requests_of_different_lengths_are_batched_together(triton_server, onnx_session):
    requests = [_token_ids(length=4 + 3 * index, seed=index) for index in range(32)]
    before = _stats(triton_server.http_url, "minilm")
    start = threading.Barrier(len(requests))

    def send(request: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        input_ids, attention_mask = request
        start.wait()
        return _infer(
            triton_server.http_url, "minilm", {"input_ids": input_ids, "attention_mask": attention_mask}
        )

    with ThreadPoolExecutor(len(requests)) as pool:
        served = list(pool.map(send, requests))
    after = settled(
        lambda: _stats(triton_server.http_url, "minilm"),
        lambda stats: stats["inference_count"] - before["inference_count"] >= len(requests),
    )

    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == len(requests)
    assert executions <= inferences // 2, f"{inferences} requests ran in {executions} executions"
    # Batched with others, padded and split back: still each request's own vector.
    for (input_ids, attention_mask), embedding in zip(requests, served, strict=True):
        (reference,) = onnx_session.run(
            ["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask}
        )
        assert _cosines(embedding, reference).min() >= 0.9999


def test_a_bad_request_fails_alone_in_its_batch(triton_server, onnx_session):
    good = [_token_ids(length=8 + index, seed=100 + index) for index in range(7)]
    out_of_vocabulary = (np.array([[101, 99_999, 102]], dtype=np.int64), np.ones((1, 3), dtype=np.int64))
    requests = [*good[:3], out_of_vocabulary, *good[3:]]
    start = threading.Barrier(len(requests))

    def send(request: tuple[np.ndarray, np.ndarray]) -> np.ndarray | TritonHttpError:
        input_ids, attention_mask = request
        start.wait()
        try:
            return _infer(
                triton_server.http_url, "minilm", {"input_ids": input_ids, "attention_mask": attention_mask}
            )
        except TritonHttpError as error:
            return error

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(send, requests))

    error = results.pop(3)
    assert isinstance(error, TritonHttpError)
    assert error.status == 400
    assert "token ids" in error.message
    for (input_ids, attention_mask), embedding in zip(good, results, strict=True):
        assert isinstance(embedding, np.ndarray)
        (reference,) = onnx_session.run(
            ["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask}
        )
        assert _cosines(embedding, reference).min() >= 0.9999


@pytest.mark.parametrize(
    ("input_ids", "attention_mask", "message"),
    [
        (np.full((1, 257), 1000), np.ones((1, 257)), "maximum of 256 tokens"),
        (np.full((2, 5), 1000), np.ones((2, 4)), "same [batch, sequence] shape"),
        (np.full((1, 5), 1000), np.zeros((1, 5)), "at least one token"),
        (np.full((2, 5), 1000), np.array([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]), "at least one token"),
        (np.full((1, 5), 1000), np.full((1, 5), 2), "only 0 and 1"),
        (np.full((1, 5), 1000), np.full((1, 5), -1), "only 0 and 1"),
    ],
    ids=["too-long", "shape-mismatch", "empty-mask", "empty-second-row", "mask-values", "negative-mask"],
)
def test_minilm_rejects_malformed_token_inputs(triton_server, input_ids, attention_mask, message):
    with pytest.raises(TritonHttpError) as raised:
        _infer(
            triton_server.http_url,
            "minilm",
            {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)},
        )
    assert raised.value.status == 400
    assert message in raised.value.message
