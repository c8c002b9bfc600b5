"""The official `openai` SDK, unmodified, against our ASGI app and against a real server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
import numpy as np
import openai
import pytest

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture
async def sent_bodies() -> list[dict]:
    return []


@pytest.fixture
async def sdk(api_setup, alpha, sent_bodies) -> AsyncIterator[openai.AsyncOpenAI]:
    from embedsite.asgi import application

    async def record(request: httpx2.Request) -> None:
        if request.method == "POST":
            sent_bodies.append(json.loads(request.content))

    http_client = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=application), event_hooks={"request": [record]}
    )
    async with openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key=alpha.secret, http_client=http_client, max_retries=0
    ) as client:
        yield client


async def float_vectors(client, texts: list[str]) -> np.ndarray:
    response = await client.post(
        "/v1/embeddings",
        json={"model": MODEL, "input": texts, "encoding_format": "float"},
        headers=client.headers,
    )
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


async def test_a_string(sdk):
    response = await sdk.embeddings.create(model=MODEL, input="hello world")
    assert response.object == "list" and response.model == MODEL
    assert len(response.data) == 1 and response.data[0].index == 0
    assert len(response.data[0].embedding) == 384
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0


async def test_a_list(sdk):
    texts = ["first text", "second text", "third"]
    response = await sdk.embeddings.create(model=MODEL, input=texts)
    assert [item.index for item in response.data] == [0, 1, 2]
    vectors = np.array([item.embedding for item in response.data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


async def test_default_asks_for_base64_and_decodes_to_our_floats(sdk, client, alpha, sent_bodies):
    texts = ["hello world", "The quick brown fox"]
    response = await sdk.embeddings.create(model=MODEL, input=texts)
    assert sent_bodies[-1]["encoding_format"] == "base64"
    decoded = np.array([item.embedding for item in response.data], dtype=np.float32)
    client.headers.update(alpha.headers)
    # Base64 carries the float32 bytes exactly; the JSON floats round-trip through shortest repr.
    np.testing.assert_array_equal(decoded, await float_vectors(client, texts))


async def test_float_encoding(sdk, sent_bodies):
    response = await sdk.embeddings.create(model=MODEL, input=["hello"], encoding_format="float")
    assert sent_bodies[-1]["encoding_format"] == "float"
    assert all(isinstance(x, float) for x in response.data[0].embedding)
    assert len(response.data[0].embedding) == 384


async def test_dimensions(sdk):
    full = await sdk.embeddings.create(model=MODEL, input="hello world")
    short = await sdk.embeddings.create(model=MODEL, input="hello world", dimensions=64)
    vector = np.array(short.data[0].embedding)
    assert vector.shape == (64,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    prefix = np.array(full.data[0].embedding[:64])
    np.testing.assert_allclose(vector, prefix / np.linalg.norm(prefix), atol=1e-6)


async def test_a_bad_key_is_an_authentication_error(api_setup, alpha):
    from embedsite.asgi import application

    wrong_secret = alpha.secret[:-1] + ("A" if alpha.secret[-1] != "A" else "B")
    http_client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=application))
    async with openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key=wrong_secret, http_client=http_client, max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError) as raised:
            await client.embeddings.create(model=MODEL, input="x")
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"


async def test_an_unknown_model_is_not_found(sdk):
    with pytest.raises(openai.NotFoundError) as raised:
        await sdk.embeddings.create(model="no-such-model", input="x")
    assert raised.value.code == "model_not_found" and raised.value.param == "model"


async def test_models_list_and_retrieve(sdk):
    listed = await sdk.models.list()
    assert [model.id for model in listed.data] == [MODEL]
    assert (await sdk.models.retrieve(MODEL)).id == MODEL


def test_over_a_real_socket(uvicorn_server):
    """The synchronous client over TCP to `uvicorn --workers 2` (uvloop, httptools)."""
    with openai.OpenAI(base_url=f"{uvicorn_server.base_url}/v1", api_key=uvicorn_server.api_key) as client:
        response = client.embeddings.create(model=MODEL, input=["hello", "world"])
        floats = client.embeddings.create(model=MODEL, input=["hello", "world"], encoding_format="float")
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="emb_nope_nope").embeddings.create(model=MODEL, input="x")
    decoded = np.array([item.embedding for item in response.data], dtype=np.float32)
    np.testing.assert_array_equal(
        decoded, np.array([item.embedding for item in floats.data], dtype=np.float32)
    )
    assert response.usage.total_tokens > 0
