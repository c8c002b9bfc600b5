"""The official `cohere` SDK, unmodified, against the real server: ranking with the v2 and v1
clients, and embedding with v2 in every embedding type."""

from __future__ import annotations

import base64

import cohere
import httpx2
import numpy as np
import pytest
from cohere.core.api_error import ApiError
from cohere.errors import NotFoundError, UnauthorizedError, UnprocessableEntityError

from tests.api.conftest import LiveServer

MODEL = "all-MiniLM-L6-v2"
QUERY = "Which animal says woof?"
DOCUMENTS = [
    "Cats purr when they are content.",
    "The stock exchange opens at nine.",
    "Dogs bark at strangers.",
]


@pytest.fixture(scope="module")
def client(uvicorn_server: LiveServer) -> cohere.ClientV2:
    return cohere.ClientV2(api_key=uvicorn_server.api_key, base_url=uvicorn_server.base_url, timeout=60)


def test_rerank_ranks_every_document_best_first(client):
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS)
    assert response.results[0].index == 2
    assert sorted(result.index for result in response.results) == [0, 1, 2]
    scores = [result.relevance_score for result in response.results]
    assert scores == sorted(scores, reverse=True)
    assert response.meta.api_version.version == "2"
    assert response.meta.billed_units.search_units == 1 and response.meta.billed_units.input_tokens > 0


def test_rerank_top_n_and_max_tokens_per_doc(client):
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=1, max_tokens_per_doc=64)
    assert [result.index for result in response.results] == [2]


def test_v1_client_returns_documents(uvicorn_server: LiveServer):
    v1 = cohere.Client(api_key=uvicorn_server.api_key, base_url=uvicorn_server.base_url, timeout=60)
    response = v1.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=True)
    assert response.results[0].document.text == DOCUMENTS[2]
    assert len(response.results) == 2


def test_errors_are_the_sdks_exception_types(client, uvicorn_server: LiveServer):
    with pytest.raises(NotFoundError) as not_found:
        client.rerank(model="no-such-model", query=QUERY, documents=DOCUMENTS)
    assert not_found.value.body["error"]["code"] == "model_not_found"
    with pytest.raises(UnprocessableEntityError) as invalid:
        client.rerank(model=MODEL, query=QUERY, documents=[])
    assert invalid.value.body["error"]["param"] == "documents"
    stranger = cohere.ClientV2(api_key="emb_unknown_key", base_url=uvicorn_server.base_url, timeout=60)
    with pytest.raises(UnauthorizedError):
        stranger.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS)


# --- Embed (POST /v2/embed) ------------------------------------------------------------------------

TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "Bananas are yellow."]


def openai_floats(server: LiveServer, texts: list[str], **fields) -> np.ndarray:
    answer = httpx2.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": MODEL, "input": texts, **fields},
        headers=server.headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)


def test_embed_answers_every_embedding_type_from_one_set_of_vectors(client, uvicorn_server: LiveServer):
    response = client.embed(
        model=MODEL,
        input_type="search_document",
        texts=TEXTS,
        embedding_types=["float", "int8", "uint8", "binary", "ubinary", "base64"],
    )
    floats = np.array(response.embeddings.float_, dtype=np.float32)
    np.testing.assert_allclose(floats, openai_floats(uvicorn_server, TEXTS), atol=1e-6)
    for name, dtype in (("int8", "int8"), ("uint8", "uint8"), ("binary", "binary"), ("ubinary", "ubinary")):
        expected = openai_floats(uvicorn_server, TEXTS, output_dtype=dtype)
        np.testing.assert_array_equal(np.array(getattr(response.embeddings, name)), expected)
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(row), dtype="<f4") for row in response.embeddings.base64]
    )
    np.testing.assert_array_equal(decoded, floats)
    np.testing.assert_array_equal(np.array(response.embeddings.ubinary), np.packbits(floats > 0, axis=1))
    assert response.texts == TEXTS
    assert response.meta.api_version.version == "2" and response.meta.billed_units.input_tokens > 0


def test_embed_options_as_cohere_names_them(client, uvicorn_server: LiveServer):
    short = client.embed(model=MODEL, input_type="search_query", texts=TEXTS, output_dimension=64)
    assert np.array(short.embeddings.float_).shape == (3, 64)
    # Only float unless asked; max_tokens keeps each text's first tokens (special tokens included).
    cut = client.embed(
        model=MODEL, input_type="classification", texts=["one two three four five six"], max_tokens=4
    )
    assert cut.embeddings.int8 is None and cut.meta.billed_units.input_tokens == 4
    start = client.embed(
        model=MODEL,
        input_type="clustering",
        texts=["one two three four five six"],
        max_tokens=4,
        truncate="START",
    )
    assert not np.allclose(start.embeddings.float_, cut.embeddings.float_)
    mixed = client.embed(
        model=MODEL, input_type="search_query", inputs=[{"content": [{"type": "text", "text": TEXTS[0]}]}]
    )
    np.testing.assert_allclose(mixed.embeddings.float_, openai_floats(uvicorn_server, TEXTS[:1]), atol=1e-6)


def test_embed_errors_are_the_sdks_exception_types(client):
    with pytest.raises(ApiError) as too_long:
        client.embed(model=MODEL, input_type="search_query", texts=["word " * 400], truncate="NONE")
    assert too_long.value.status_code == 413
    assert too_long.value.body["error"]["code"] == "context_length_exceeded"
    with pytest.raises(UnprocessableEntityError) as image:
        client.embed(model=MODEL, input_type="image", texts=["a cat"])
    assert image.value.body["error"]["param"] == "input_type"
    with pytest.raises(UnprocessableEntityError) as images:
        client.embed(model=MODEL, input_type="search_query", images=["data:image/png;base64,AAAA"])
    assert images.value.body["error"]["param"] == "images"
    with pytest.raises(UnprocessableEntityError) as binary:
        client.embed(
            model=MODEL,
            input_type="search_query",
            texts=TEXTS,
            embedding_types=["binary"],
            output_dimension=100,
        )
    assert binary.value.body["error"]["code"] == "unsupported_by_model"
    with pytest.raises(NotFoundError):
        client.embed(model="no-such-model", input_type="search_query", texts=TEXTS)
