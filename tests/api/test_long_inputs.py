"""Long inputs embedded in chunks (`long_inputs: "chunk"`), through the real ASGI app and Triton and
through the real server: each long input's vector is its chunks embedded alone (as token ids, on
the same API) and averaged by hand, by their tokens, then normalised; every chunk's tokens are
billed; the limits refuse with 413 naming the input and its tokens."""

from __future__ import annotations

import httpx2
import numpy as np
import pytest
from asgiref.sync import sync_to_async

from embeddings.models import EmbeddingModel
from tests import onnx_reference
from tests.api.conftest import LiveServer
from tests.api.test_embeddings import assert_error
from tests.api.test_quotas import limit, one_window, status, usage_by_outcome

MODEL = "all-MiniLM-L6-v2"
# About 700 tokens: three or four chunks of the model's 256.
LONG_TEXT = " ".join(
    f"Sentence {i} of a long report on rivers, bridges and the towns that grew along them." for i in range(40)
)
SHORT_TEXTS = ["What is the capital of France?", "Bananas are yellow."]

__all__ = ["one_window"]  # the quota tests' pinned clock, used by the quota test below


def chunks_by_hand(text: str, *, max_tokens: int, overlap: int) -> list[list[int]]:
    return onnx_reference.chunks_of(onnx_reference.token_ids(text), max_tokens=max_tokens, overlap=overlap)


def tokens_of(text: str) -> int:
    return len(onnx_reference.token_ids(text))


def vectors(body: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float64)


async def embed(client, who, **fields):
    return await client.post("/v1/embeddings", json={"model": MODEL} | fields, headers=who.headers)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("overlap", [0, 32, 100])
async def test_a_long_input_is_its_chunks_embedded_alone_and_averaged_by_their_tokens(
    client, alpha, model: EmbeddingModel, settings, overlap
):
    settings.CHUNK_OVERLAP_TOKENS = overlap
    chunks = chunks_by_hand(LONG_TEXT, max_tokens=model.max_tokens, overlap=overlap)
    assert len(chunks) >= 3
    assert all(len(chunk) <= model.max_tokens for chunk in chunks)

    texts = [SHORT_TEXTS[0], LONG_TEXT, SHORT_TEXTS[1]]
    response = await embed(client, alpha, input=texts, long_inputs="chunk")
    assert response.status_code == 200, response.text
    body = response.json()
    chunked = vectors(body)
    assert chunked.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(chunked, axis=1), 1, atol=1e-5)

    alone = await embed(client, alpha, input=chunks)
    assert alone.status_code == 200, alone.text
    expected = onnx_reference.chunks_aggregated(vectors(alone.json()), chunks)
    assert cosine(chunked[1], expected) >= 0.99999
    np.testing.assert_allclose(chunked[1], expected, atol=1e-5)

    # The short texts in the same request are what they are alone.
    shorts = await embed(client, alpha, input=SHORT_TEXTS)
    np.testing.assert_allclose(chunked[[0, 2]], vectors(shorts.json()), atol=1e-5)
    # Every chunk's tokens are billed, overlap and special tokens included.
    short_tokens = shorts.json()["usage"]["prompt_tokens"]
    chunk_tokens = sum(map(len, chunks))
    assert body["usage"] == {
        "prompt_tokens": short_tokens + chunk_tokens,
        "total_tokens": short_tokens + chunk_tokens,
    }
    assert chunk_tokens > tokens_of(LONG_TEXT) + (len(chunks) - 1) * overlap


async def test_chunking_differs_from_truncating_and_leaves_fitting_texts_alone(client, alpha, model):
    truncated = vectors((await embed(client, alpha, input=[LONG_TEXT, *SHORT_TEXTS])).json())
    chunked = vectors(
        (await embed(client, alpha, input=[LONG_TEXT, *SHORT_TEXTS], long_inputs="chunk")).json()
    )
    assert cosine(truncated[0], chunked[0]) < 0.9999
    np.testing.assert_allclose(truncated[1:], chunked[1:], atol=1e-5)
    explicit = vectors(
        (await embed(client, alpha, input=[LONG_TEXT], long_inputs="truncate", truncation=True)).json()
    )
    np.testing.assert_allclose(explicit[0], truncated[0], atol=1e-6)


async def test_chunks_take_the_requests_dimensions_and_output_types_after_aggregating(client, alpha):
    full = vectors((await embed(client, alpha, input=[LONG_TEXT], long_inputs="chunk")).json())[0]
    cut = vectors((await embed(client, alpha, input=[LONG_TEXT], long_inputs="chunk", dimensions=64)).json())[
        0
    ]
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-5)
    ubinary = vectors(
        (await embed(client, alpha, input=[LONG_TEXT], long_inputs="chunk", output_dtype="ubinary")).json()
    )[0]
    np.testing.assert_array_equal(ubinary, np.packbits(full > 0))


async def test_tei_embed_chunks_alike(client, alpha):
    openai = vectors(
        (await embed(client, alpha, input=[LONG_TEXT, SHORT_TEXTS[0]], long_inputs="chunk")).json()
    )
    response = await client.post(
        "/embed", json={"inputs": [LONG_TEXT, SHORT_TEXTS[0]], "long_inputs": "chunk"}, headers=alpha.headers
    )
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(vectors(response.json()), openai, atol=1e-6)
    refused = await client.post(
        "/embed", json={"inputs": [LONG_TEXT], "long_inputs": "refuse"}, headers=alpha.headers
    )
    assert "Input 0 has" in assert_error(refused, 413, "context_length_exceeded")["message"]


async def test_quota_and_usage_count_every_chunks_tokens(client, alpha, beta, model, one_window):
    await limit(alpha, tokens_per_minute=100_000)
    chunks = chunks_by_hand(LONG_TEXT, max_tokens=model.max_tokens, overlap=32)
    response = await embed(client, alpha, input=[LONG_TEXT], long_inputs="chunk")
    assert response.status_code == 200, response.text
    tokens = sum(map(len, chunks))
    assert response.json()["usage"]["total_tokens"] == tokens
    assert response.headers["x-ratelimit-remaining-tokens"] == str(100_000 - tokens)
    assert (await status(alpha))["tenant"]["tokens_per_minute"]["used"] == tokens
    counted = usage_by_outcome(alpha.tenant.pk)
    assert counted["tokens"] == tokens and counted["inputs"] == 1

    # A budget the truncated text fits and its chunks do not.
    await limit(beta, tokens_per_minute=tokens - 1)
    refused = await embed(client, beta, input=[LONG_TEXT], long_inputs="chunk")
    assert refused.status_code == 429, refused.text
    assert (await embed(client, beta, input=[LONG_TEXT])).status_code == 200


async def test_an_input_over_the_chunks_an_input_may_have_is_413_naming_it_and_its_tokens(
    client, alpha, settings
):
    settings.MAX_CHUNKS_PER_INPUT = 2
    tokens = tokens_of(LONG_TEXT)
    response = await embed(client, alpha, input=["fine", LONG_TEXT], long_inputs="chunk")
    error = assert_error(response, 413, "context_length_exceeded", "input")
    assert f"Input 1 has {tokens} tokens" in error["message"] and "MAX_CHUNKS_PER_INPUT" in error["message"]


async def test_chunks_count_against_the_requests_inputs_and_tokens(client, alpha, model, settings):
    chunks = chunks_by_hand(LONG_TEXT, max_tokens=model.max_tokens, overlap=32)
    model.max_inputs_per_request = len(chunks)
    await sync_to_async(model.save)(update_fields=["max_inputs_per_request"])
    settings.MODEL_CACHE_SECONDS = 0
    response = await embed(client, alpha, input=["one more", LONG_TEXT], long_inputs="chunk")
    error = assert_error(response, 413, param="input")
    assert f"make {len(chunks) + 1} chunks" in error["message"]
    assert f"input 1 has {sum(map(len, chunks))} tokens" in error["message"]
    # The same inputs truncated are within the limit.
    assert (await embed(client, alpha, input=["one more", LONG_TEXT])).status_code == 200

    settings.MAX_TOKENS_PER_REQUEST = 300
    model.max_inputs_per_request = None
    await sync_to_async(model.save)(update_fields=["max_inputs_per_request"])
    response = await embed(client, alpha, input=[LONG_TEXT], long_inputs="chunk")
    assert f"{sum(map(len, chunks))} tokens in all" in assert_error(response, 413, param="input")["message"]


async def test_token_ids_and_contradicting_switches_are_refused(client, alpha):
    response = await embed(client, alpha, input=[[101, 7592, 102]], long_inputs="chunk")
    assert "not embedded in chunks" in assert_error(response, 422, param="long_inputs")["message"]
    response = await embed(client, alpha, input="hello", long_inputs="truncate", truncation=False)
    assert_error(response, 422, param="long_inputs")
    response = await embed(client, alpha, input="hello", long_inputs="refuse", truncation=True)
    assert_error(response, 422, param="long_inputs")
    response = await embed(client, alpha, input="hello", long_inputs="split")
    assert_error(response, 422, param="long_inputs")
    refused = await embed(client, alpha, input=[LONG_TEXT], long_inputs="refuse")
    assert_error(refused, 413, "context_length_exceeded", "input")


def test_the_real_server_chunks_as_its_chunks_embedded_alone(uvicorn_server: LiveServer):
    def post(**fields) -> dict:
        answer = httpx2.post(
            f"{uvicorn_server.base_url}/v1/embeddings",
            json={"model": MODEL, **fields},
            headers=uvicorn_server.headers,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()

    max_tokens = httpx2.get(
        f"{uvicorn_server.base_url}/v1/models/{MODEL}", headers=uvicorn_server.headers, timeout=60
    ).json()["max_tokens"]
    chunks = chunks_by_hand(LONG_TEXT, max_tokens=max_tokens, overlap=32)
    body = post(input=[LONG_TEXT, SHORT_TEXTS[0]], long_inputs="chunk")
    chunked = vectors(body)
    expected = onnx_reference.chunks_aggregated(vectors(post(input=chunks)), chunks)
    assert cosine(chunked[0], expected) >= 0.99999
    np.testing.assert_allclose(chunked[1], vectors(post(input=[SHORT_TEXTS[0]]))[0], atol=1e-5)
    short_tokens = tokens_of(SHORT_TEXTS[0])
    assert body["usage"]["total_tokens"] == sum(map(len, chunks)) + short_tokens
