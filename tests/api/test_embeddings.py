"""The embedding endpoints through the real ASGI app and the real Triton: shapes, agreement, errors."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx2
import numpy as np
import pytest

from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.inference.clients import model_tokenizer, reset_clients
from embeddings.services.inference.scheduling import sub_batches
from embeddings.tooling.triton_server import free_port
from tests import onnx_reference

# " ": the shortest input there is (an empty string is refused), its special tokens alone.
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", " ", "日本語のテキスト"]


def unit(vectors) -> np.ndarray:
    array = np.asarray(vectors, dtype=np.float32)
    return array / np.linalg.norm(array, axis=-1, keepdims=True)


def assert_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"} and error["message"]
    assert error["request_id"] == response.headers["x-request-id"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def test_openai_shape_for_a_list_of_strings(client, alpha, model):
    response = await client.post(
        "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": TEXTS}, headers=alpha.headers
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [item["index"] for item in body["data"]] == [0, 1, 2, 3]
    assert all(item["object"] == "embedding" and len(item["embedding"]) == 384 for item in body["data"])
    tokens = int(model_tokenizer("minilm").encode(TEXTS).token_counts.sum())
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    norms = np.linalg.norm(np.array([item["embedding"] for item in body["data"]]), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


async def test_openai_single_string_alias_and_base64(client, alpha):
    floats = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hello world"}, headers=alpha.headers
    )
    encoded = await client.post(
        "/v1/embeddings",
        json={"model": "minilm", "input": "hello world", "encoding_format": "base64"},
        headers=alpha.headers,
    )
    assert floats.status_code == encoded.status_code == 200
    vector = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, floats.json()["data"][0]["embedding"], atol=1e-7)
    assert encoded.json()["model"] == "all-MiniLM-L6-v2"


async def test_openai_token_id_inputs_match_text(client, alpha):
    ids = model_tokenizer("minilm").encode(["hello world"]).input_ids[0].tolist()
    by_text = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hello world"}, headers=alpha.headers
    )
    one = await client.post("/v1/embeddings", json={"model": "minilm", "input": ids}, headers=alpha.headers)
    many = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": [ids, ids[:2]]}, headers=alpha.headers
    )
    assert one.status_code == many.status_code == 200, (one.text, many.text)
    reference = np.array(by_text.json()["data"][0]["embedding"])
    assert np.dot(reference, one.json()["data"][0]["embedding"]) > 0.9999
    assert len(many.json()["data"]) == 2 and many.json()["usage"]["prompt_tokens"] == len(ids) + 2


async def test_dimensions_truncate_and_renormalise(client, alpha):
    full = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hello"}, headers=alpha.headers
    )
    short = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hello", "dimensions": 32}, headers=alpha.headers
    )
    vector = np.array(short.json()["data"][0]["embedding"])
    assert vector.shape == (32,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert np.allclose(vector, unit(full.json()["data"][0]["embedding"][:32]), atol=1e-6)
    too_many = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hello", "dimensions": 385}, headers=alpha.headers
    )
    assert_error(too_many, 422, param="dimensions")


async def test_the_three_shapes_agree(client, alpha):
    texts = ["first text", "a second, longer text to embed"]
    openai = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": texts}, headers=alpha.headers
    )
    seed = await client.post("/v1/embedding", json=[{"query": t} for t in texts], headers=alpha.headers)
    tei = await client.post("/api/v1/embed", json={"inputs": texts}, headers=alpha.headers)
    tei_short = await client.post("/embed", json={"inputs": texts[0]}, headers=alpha.headers)
    assert openai.status_code == seed.status_code == tei.status_code == tei_short.status_code == 200
    a = np.array([item["embedding"] for item in openai.json()["data"]])
    b = np.array([item["embedding"] for item in seed.json()])
    c = np.array([item["embedding"] for item in tei.json()["data"]])
    assert np.allclose(a, b, atol=1e-6) and np.allclose(a, c, atol=1e-6)
    assert np.allclose(a[0], tei_short.json()["data"][0]["embedding"], atol=1e-6)
    assert set(seed.json()[0]) == {"embedding"}
    body = tei.json()
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == openai.json()["usage"]["prompt_tokens"]
    assert set(body["timings"]) == {"tokenization", "queue", "inference"}
    assert all(value >= 0 for value in body["timings"].values()) and body["timings"]["inference"] > 0


async def test_tei_options(client, alpha):
    long_text = " ".join(f"w{i}" for i in range(600)) + " ending"
    left = await client.post(
        "/api/v1/embed", json={"inputs": long_text, "truncation_direction": "Left"}, headers=alpha.headers
    )
    right = await client.post("/api/v1/embed", json={"inputs": long_text}, headers=alpha.headers)
    assert left.status_code == right.status_code == 200
    assert left.json()["usage"]["prompt_tokens"] == 256
    assert np.dot(left.json()["data"][0]["embedding"], right.json()["data"][0]["embedding"]) < 0.999
    refused = await client.post(
        "/api/v1/embed", json={"inputs": long_text, "truncate": False}, headers=alpha.headers
    )
    assert_error(refused, 413, code="context_length_exceeded", param="input")
    raw = await client.post(
        "/api/v1/embed", json={"inputs": "hello", "dimensions": 16, "normalize": False}, headers=alpha.headers
    )
    assert 0 < np.linalg.norm(raw.json()["data"][0]["embedding"]) < 1.0
    unknown_prompt = await client.post(
        "/api/v1/embed", json={"inputs": "hello", "prompt_name": "nope"}, headers=alpha.headers
    )
    assert_error(unknown_prompt, 422, code="unsupported_by_model", param="prompt_name")


async def test_prompts_are_prepended(client, alpha, model):
    model.prompts = {"query": "query: "}
    await model.asave(update_fields=["prompts"])
    with_prompt = await client.post(
        "/api/v1/embed", json={"inputs": "what is triton", "prompt_name": "query"}, headers=alpha.headers
    )
    by_hand = await client.post(
        "/api/v1/embed", json={"inputs": "query: what is triton"}, headers=alpha.headers
    )
    assert with_prompt.status_code == 200, with_prompt.text
    assert np.allclose(
        with_prompt.json()["data"][0]["embedding"], by_hand.json()["data"][0]["embedding"], atol=1e-6
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "minilm", "input": [101, 30522, 102]}, "input"),  # the vocabulary has 30522 ids
        ({"model": "minilm", "input": "x", "dimensions": 385}, "dimensions"),
        ({"inputs": "x", "prompt_name": "query"}, "prompt_name"),
    ],
)
async def test_what_only_the_model_refuses_says_so(client, alpha, body, param):
    """The schema is one for every model: a model's own bounds are refused with their own code."""
    path = "/v1/embeddings" if "model" in body else "/api/v1/embed"
    assert_error(
        await client.post(path, json=body, headers=alpha.headers), 422, "unsupported_by_model", param
    )


def test_what_only_the_model_refuses_says_so_through_uvicorn(edge_server):
    with httpx2.Client(base_url=edge_server.base_url, headers=edge_server.headers, timeout=30) as http:
        response = http.post("/v1/embeddings", json={"model": "minilm", "input": "x", "dimensions": 385})
        assert_error(response, 422, "unsupported_by_model", "dimensions")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x"}, 422, "model"),
        ({"model": "minilm"}, 422, "input"),
        ({"model": "minilm", "input": []}, 422, "input"),
        ({"model": "minilm", "input": [1, "a"]}, 422, "input"),
        ({"model": "minilm", "input": [[1, 2], []]}, 422, "input"),
        ({"model": "minilm", "input": [{"text": "x"}]}, 422, "input"),
        ({"model": "minilm", "input": [101, 99999999, 102]}, 422, "input"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, 422, "encoding_format"),
        ({"model": "minilm", "input": "x", "dimensions": 0}, 422, "dimensions"),
        ({"model": "minilm", "input": "x", "dimensions": "ten"}, 422, "dimensions"),
    ],
)
async def test_validation_errors(client, alpha, body, status, param):
    response = await client.post("/v1/embeddings", json=body, headers=alpha.headers)
    assert_error(response, status, param=param)


# Every route that takes texts, and an empty text in each of its shapes.
EMPTY_TEXTS = [
    ("/v1/embeddings", {"model": "minilm", "input": ""}, "input", "must not be an empty string"),
    ("/v1/embeddings", {"model": "minilm", "input": ["a", ""]}, "input", "item 1 is an empty string"),
    ("/api/v1/embed", {"inputs": ""}, "inputs", "must not be an empty string"),
    ("/embed", {"inputs": ["", "b"]}, "inputs", "item 0 is an empty string"),
    ("/v1/embedding", [{"query": "a"}, {"query": ""}], None, "item 1's query is an empty string"),
    ("/v1/jobs", {"model": "minilm", "input": ["a", "b", ""]}, "input", "item 2 is an empty string"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), EMPTY_TEXTS)
async def test_an_empty_text_is_refused_on_every_route(client, alpha, path, body, param, message):
    """As OpenAI refuses `input: ""`; 422 invalid_request_error, as every invalid field here."""
    error = assert_error(await client.post(path, json=body, headers=alpha.headers), 422, param=param)
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    # Whitespace is a text (its own tokens, or the special ones alone).
    spaced = json.loads(json.dumps(body).replace('""', '" "'))
    assert (await client.post(path, json=spaced, headers=alpha.headers)).status_code in (200, 202)


def test_an_empty_text_is_refused_through_uvicorn(edge_server):
    with httpx2.Client(base_url=edge_server.base_url, headers=edge_server.headers, timeout=30) as http:
        for path, body, param, message in EMPTY_TEXTS:
            error = assert_error(http.post(path, json=body), 422, param=param)
            assert message in error["message"], error


async def test_malformed_and_wrongly_shaped_bodies(client, alpha):
    malformed = await client.post(
        "/v1/embeddings",
        content=b'{"model": "minilm", "input": ',
        headers={**alpha.headers, "content-type": "application/json"},
    )
    assert_error(malformed, 400)
    not_object = await client.post("/v1/embeddings", json=["hello"], headers=alpha.headers)
    assert_error(not_object, 422)
    seed_bad = await client.post("/v1/embedding", json={"query": "x"}, headers=alpha.headers)
    assert_error(seed_bad, 422)
    tei_bad = await client.post("/api/v1/embed", json={"inputs": 42}, headers=alpha.headers)
    assert_error(tei_bad, 422, param="inputs")


async def test_unknown_model_and_routes(client, alpha):
    assert_error(
        await client.post("/v1/embeddings", json={"model": "gpt-9", "input": "x"}, headers=alpha.headers),
        404,
        code="model_not_found",
        param="model",
    )
    assert_error(await client.get("/v1/nothing-here", headers=alpha.headers), 404)
    assert_error(await client.get("/v1/embeddings", headers=alpha.headers), 405)


async def test_size_limits(client, alpha, model, settings):
    settings.MAX_REQUEST_BODY_BYTES = 2048
    big = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "x" * 4096}, headers=alpha.headers
    )
    assert_error(big, 413)
    settings.MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
    model.max_inputs_per_request = 3
    model.max_tokens_per_request = 50
    await model.asave(update_fields=["max_inputs_per_request", "max_tokens_per_request"])
    embedding_model_cache_clear()
    too_many = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": ["a"] * 4}, headers=alpha.headers
    )
    assert_error(too_many, 413, param="input")
    too_long = await client.post(
        "/v1/embeddings",
        json={"model": "minilm", "input": ["word " * 30, "word " * 30]},
        headers=alpha.headers,
    )
    assert_error(too_long, 413, param="input")
    fine = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": ["a", "b", "c"]}, headers=alpha.headers
    )
    assert fine.status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "bound"),
    [
        ({"model": "minilm", "input": [101, 2**31, 102]}, "input", None),
        ({"model": "minilm", "input": [[101, 102], [101, -1, 102]]}, "input", None),
        ({"model": "minilm", "input": [[101, 2**64, 102]]}, "input", None),
        ({"model": "minilm", "input": "x", "dimensions": 2**31}, "dimensions", 2**31 - 1),
        ({"model": "minilm", "input": "x", "dimensions": 10**40}, "dimensions", 2**31 - 1),
    ],
)
async def test_integers_past_the_schemas_maximum_are_422(client, alpha, body, param, bound):
    error = assert_error(
        await client.post("/v1/embeddings", json=body, headers=alpha.headers), 422, param=param
    )
    assert error["code"] == "invalid_value", error
    if bound is not None:
        assert f"less than or equal to {bound}" in error["message"], error


async def test_overload_is_refused_at_once_with_retry_after(client, alpha, settings):
    settings.MAX_INFLIGHT_TRITON_CALLS = 1
    body = {"model": "minilm", "input": ["a sentence that takes a while to embed " * 20] * 48}
    responses = await asyncio.gather(
        *(client.post("/v1/embeddings", json=body, headers=alpha.headers) for _ in range(4))
    )
    statuses = sorted(r.status_code for r in responses)
    assert statuses[0] == 200 and 429 in statuses, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert_error(refused, 429, code="rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1


async def test_triton_down_is_503(client, alpha, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.TRITON_TIMEOUT_S = 2.0
    reset_clients()
    response = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "x"}, headers=alpha.headers
    )
    assert_error(response, 503, code="model_unavailable")


async def test_triton_deadline_is_504(client, alpha, settings):
    # Metadata is cached by a first call; then a deadline far shorter than inference.
    assert (
        await client.post("/v1/embeddings", json={"model": "minilm", "input": "x"}, headers=alpha.headers)
    ).status_code == 200
    reset_clients()
    from embeddings.services.inference.clients import triton_async_client

    # The new client's metadata read before the deadline shrinks: on a busy machine it may take
    # longer than 20 ms itself. Inference reads TRITON_TIMEOUT_S at each call.
    await triton_async_client().model_metadata("minilm")
    settings.TRITON_TIMEOUT_S = 0.02
    body = {"model": "minilm", "input": ["a long sentence to keep the model busy " * 25] * 64}
    response = await client.post("/v1/embeddings", json=body, headers=alpha.headers)
    assert_error(response, 504, code="model_timeout")


async def test_models_list_and_detail(client, alpha, beta, model):
    listed = await client.get("/v1/models", headers=alpha.headers)
    assert listed.status_code == 200
    body = listed.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["all-MiniLM-L6-v2"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["dimensions"] == 384
    # Version 1 is the float32 export: no variant's agreement with float32 to report.
    assert (body["data"][0]["dtype"], body["data"][0]["agreement"]) == ("float32", None)
    # What Triton runs it with: config.pbtxt, embedsite_onnx on ONNX Runtime's CPU provider.
    assert body["data"][0]["engine"] == {"name": "onnxruntime-cpu", "precision": "float32"}
    detail = await client.get("/v1/models/sentence-transformers/all-MiniLM-L6-v2", headers=alpha.headers)
    assert detail.status_code == 200 and detail.json()["id"] == "all-MiniLM-L6-v2"
    assert detail.json()["engine"] == {"name": "onnxruntime-cpu", "precision": "float32"}
    assert_error(await client.get("/v1/models/nope", headers=alpha.headers), 404)


async def test_models_list_says_engine_null_when_triton_cannot_say(client, alpha, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.READY_CHECK_TIMEOUT_S = 1.0
    reset_clients()
    listed = await client.get("/v1/models", headers=alpha.headers)
    assert listed.status_code == 200
    (model,) = listed.json()["data"]
    assert model["engine"] is None and model["dtype"] == "float32"


async def test_health_needs_no_key(client):
    response = await client.get("/health")
    assert response.status_code == 200 and response.text == "ok"


async def test_server_timing_header(client, alpha):
    response = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "x"}, headers=alpha.headers
    )
    parts = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    assert set(parts) == {"tokenize", "inference"} and float(parts["inference"]) > 0


# --- Token ids and texts, vector by vector ---------------------------------------------------------

# Rows of clearly different lengths (3 to ~150 tokens), so every batch pads its shorter rows.
RAGGED_TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "word " * 60 + "end",
    "日本語のテキスト",
    "Embeddings map text to vectors so that similar meanings land close together. " * 9,
    " ",
]


def response_vectors(response) -> np.ndarray:
    """The embeddings of a 200 response, in order, whichever encoding_format it used."""
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return np.array(
        [
            np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
            if isinstance(item["embedding"], str)
            else item["embedding"]
            for item in data
        ],
        dtype=np.float32,
    )


def mixed_sub_batches(lengths: list[int], settings) -> list:
    """How the service will cut rows of these lengths, checked to pad some rows inside a sub-batch
    (otherwise a mask that attends padding would go unseen)."""
    groups = sub_batches(
        np.array(lengths),
        max_batch_tokens=settings.MAX_BATCH_TOKENS,
        max_rows=64,
        buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
    )
    assert any(len({lengths[row] for row in group.rows}) > 1 for group in groups), groups
    return groups


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("sub_batching", ["one sub-batch", "several sub-batches"])
async def test_token_id_rows_of_different_lengths_equal_their_texts_row_by_row(
    client, alpha, settings, encoding_format, sub_batching
):
    if sub_batching == "several sub-batches":
        settings.MAX_BATCH_TOKENS = 96
    rows = [onnx_reference.token_ids(text) for text in RAGGED_TEXTS]
    groups = mixed_sub_batches([len(ids) for ids in rows], settings)
    assert (len(groups) == 1) == (sub_batching == "one sub-batch"), groups
    body = {"model": "minilm", "encoding_format": encoding_format}

    by_ids = await client.post("/v1/embeddings", json={**body, "input": rows}, headers=alpha.headers)
    by_text = await client.post("/v1/embeddings", json={**body, "input": RAGGED_TEXTS}, headers=alpha.headers)

    ids_vectors, text_vectors = response_vectors(by_ids), response_vectors(by_text)
    reference = onnx_reference.vectors_for_ids(rows)
    assert (onnx_reference.row_cosines(ids_vectors, text_vectors) >= 0.9999).all()
    assert (onnx_reference.row_cosines(ids_vectors, reference) >= 0.9999).all()
    assert (onnx_reference.row_cosines(text_vectors, reference) >= 0.9999).all()
    assert by_ids.json()["usage"]["prompt_tokens"] == sum(map(len, rows))
    assert by_text.json()["usage"] == by_ids.json()["usage"]


LONG_TEXT = " ".join(f"w{i}" for i in range(300)) + " the very end"


@pytest.mark.parametrize("sub_batching", ["one sub-batch", "several sub-batches"])
async def test_token_ids_past_the_maximum_are_cut_to_their_first_256(client, alpha, settings, sub_batching):
    # The OpenAI route truncates token ids on the right, as given: the first 256 ids.
    if sub_batching == "several sub-batches":
        settings.MAX_BATCH_TOKENS = 256
    long = onnx_reference.token_ids(LONG_TEXT)
    assert len(long) > 300
    # What truncating LONG_TEXT itself gives ([SEP] kept), sent as ids: exactly 256, so not cut.
    as_text_truncates = onnx_reference.text_truncated(long, 256, "right")
    rows = [onnx_reference.token_ids(text) for text in RAGGED_TEXTS[:3]] + [long, as_text_truncates]
    groups = mixed_sub_batches([min(len(ids), 256) for ids in rows], settings)
    assert (len(groups) == 1) == (sub_batching == "one sub-batch"), groups

    by_ids = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": rows}, headers=alpha.headers
    )
    by_text = await client.post(
        "/v1/embeddings",
        json={"model": "minilm", "input": [*RAGGED_TEXTS[:3], LONG_TEXT]},
        headers=alpha.headers,
    )

    ids_vectors, text_vectors = response_vectors(by_ids), response_vectors(by_text)
    reference = onnx_reference.vectors_for_ids([*rows[:3], long[:256], as_text_truncates])
    assert (onnx_reference.row_cosines(ids_vectors, reference) >= 0.9999).all()
    assert (onnx_reference.row_cosines(ids_vectors[[0, 1, 2, 4]], text_vectors) >= 0.9999).all()
    # Not the text's truncation: the 256th id is a word piece, not [SEP].
    assert onnx_reference.row_cosines(ids_vectors[3:4], ids_vectors[4:5])[0] < 0.9999
    assert by_ids.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids in rows[:3]) + 256 + 256


@pytest.mark.parametrize("direction", ["Right", "Left"])
@pytest.mark.parametrize("sub_batching", ["one sub-batch", "several sub-batches"])
async def test_tei_truncation_equals_the_explicitly_truncated_ids_row_by_row(
    client, alpha, settings, direction, sub_batching
):
    if sub_batching == "several sub-batches":
        settings.MAX_BATCH_TOKENS = 256
    texts = [*RAGGED_TEXTS[:4], LONG_TEXT, RAGGED_TEXTS[4]]
    full = [onnx_reference.token_ids(text) for text in texts]
    truncated = [
        ids if len(ids) <= 256 else onnx_reference.text_truncated(ids, 256, direction.lower()) for ids in full
    ]
    groups = mixed_sub_batches([len(ids) for ids in truncated], settings)
    assert (len(groups) == 1) == (sub_batching == "one sub-batch"), groups

    response = await client.post(
        "/api/v1/embed",
        json={"inputs": texts, "truncate": True, "truncation_direction": direction},
        headers=alpha.headers,
    )

    vectors = response_vectors(response)
    assert (onnx_reference.row_cosines(vectors, onnx_reference.vectors_for_ids(truncated)) >= 0.9999).all()
    assert response.json()["usage"]["prompt_tokens"] == sum(map(len, truncated))
    as_ids = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": truncated}, headers=alpha.headers
    )
    assert (onnx_reference.row_cosines(vectors, response_vectors(as_ids)) >= 0.9999).all()
