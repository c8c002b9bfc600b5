"""The official `cohere` SDK, unmodified, ranking against the real server: v2 and v1 clients."""

from __future__ import annotations

import cohere
import pytest
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
