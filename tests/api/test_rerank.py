"""Rerank in its three shapes (Cohere v2, Jina and Cohere v1, TEI) through the real server as `make
run` starts it, ranked by the bundled MiniLM's cosine similarity; and the catalog's task rules
in process."""

from __future__ import annotations

import httpx2
import numpy as np
import pytest

from embeddings.models import EmbeddingModel
from tests.api.conftest import LiveServer

MODEL = "all-MiniLM-L6-v2"
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are a yellow fruit rich in potassium.",
    "Paris is the capital and largest city of France.",
    "The stock market fell sharply on Tuesday.",
    "France is a country in Western Europe.",
]


def post(server: LiveServer, path: str, body: dict, **headers) -> httpx2.Response:
    return httpx2.post(
        f"{server.base_url}{path}", json=body, headers={**server.headers, **headers}, timeout=60
    )


def cosine_scores(server: LiveServer, query: str, documents: list[str]) -> np.ndarray:
    """What similarity ranking must give: the cosine of /v1/embeddings' vectors."""
    response = post(server, "/v1/embeddings", {"model": MODEL, "input": [query, *documents]})
    assert response.status_code == 200, response.text
    vectors = np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors[1:] @ vectors[0]


def test_cohere_v2_ranks_the_relevant_document_first_with_cosine_scores(uvicorn_server):
    response = post(uvicorn_server, "/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = cosine_scores(uvicorn_server, QUERY, DOCUMENTS)
    assert [result["index"] for result in body["results"]] == list(np.argsort(-expected))
    assert body["results"][0]["index"] == 1  # the capital, not merely France
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
    scores = [result["relevance_score"] for result in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(-1 <= score <= 1 for score in scores)
    assert body["meta"]["api_version"] == {"version": "2"}
    assert body["meta"]["billed_units"]["search_units"] == 1
    assert len(body["id"]) == 36
    assert "inference;dur=" in response.headers["server-timing"]


def test_every_token_of_query_and_documents_is_billed(uvicorn_server):
    embedded = post(uvicorn_server, "/v1/embeddings", {"model": MODEL, "input": [QUERY, *DOCUMENTS]})
    ranked = post(uvicorn_server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    tokens = embedded.json()["usage"]["total_tokens"]
    assert ranked.json()["usage"] == {"total_tokens": tokens, "prompt_tokens": tokens}
    assert ranked.json()["meta"]["billed_units"]["input_tokens"] == tokens


def test_top_n_and_return_documents(uvicorn_server):
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    v2 = post(uvicorn_server, "/v2/rerank", body).json()
    v1 = post(uvicorn_server, "/v1/rerank", {**body, "return_documents": True}).json()
    plain = post(uvicorn_server, "/v1/rerank", body).json()
    assert [r["index"] for r in v2["results"]] == [r["index"] for r in v1["results"]] == [1, 3]
    assert [r["document"]["text"] for r in v1["results"]] == [DOCUMENTS[1], DOCUMENTS[3]]
    assert all("document" not in r for r in plain["results"]) and plain["model"] == MODEL
    # More than there are documents: all of them.
    assert len(post(uvicorn_server, "/v2/rerank", {**body, "top_n": 50}).json()["results"]) == 4


def test_documents_as_text_objects_rank_as_strings(uvicorn_server):
    objects = [{"text": document} for document in DOCUMENTS]
    as_objects = post(uvicorn_server, "/v1/rerank", {"query": QUERY, "documents": objects}).json()
    as_strings = post(uvicorn_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert as_objects["results"] == as_strings["results"]
    assert as_objects["model"] == MODEL  # no model named: the one that ranks


def test_tei_shape_ranks_with_texts_and_truncates_only_when_asked(uvicorn_server):
    body = {"query": QUERY, "texts": DOCUMENTS, "return_text": True}
    ranks = post(uvicorn_server, "/rerank", body)
    assert ranks.status_code == 200, ranks.text
    assert [rank["index"] for rank in ranks.json()][:2] == [1, 3]
    assert ranks.json()[0] == {
        "index": 1,
        "score": pytest.approx(cosine_scores(uvicorn_server, QUERY, DOCUMENTS)[1], abs=1e-5),
        "text": DOCUMENTS[1],
    }
    long_text = "word " * 400
    refused = post(uvicorn_server, "/rerank", {"query": QUERY, "texts": ["short", long_text]})
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "documents")
    assert error["message"].startswith("Document 1 has 402 tokens")
    too_long_query = post(uvicorn_server, "/rerank", {"query": long_text, "texts": ["short"]})
    assert too_long_query.json()["error"]["param"] == "query"
    truncated = post(
        uvicorn_server, "/rerank", {"query": QUERY, "texts": ["short", long_text], "truncate": True}
    )
    assert truncated.status_code == 200 and len(truncated.json()) == 2


def test_max_tokens_per_doc_keeps_a_documents_first_tokens(uvicorn_server):
    # [CLS] paris is [SEP]: four tokens keep the document's first two words.
    cut = post(
        uvicorn_server,
        "/v2/rerank",
        {"model": MODEL, "query": QUERY, "documents": [DOCUMENTS[1]], "max_tokens_per_doc": 4},
    ).json()
    expected = cosine_scores(uvicorn_server, QUERY, ["Paris is"])[0]
    assert cut["results"][0]["relevance_score"] == pytest.approx(expected, abs=1e-5)
    assert cut["meta"]["billed_units"]["input_tokens"] == 9 + 4  # the query's nine, the document's four


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": []}, 422, None, "documents"),
        ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["a", ""]}, 422, None, "documents"),
        ("/v2/rerank", {"model": MODEL, "query": "", "documents": ["a"]}, 422, None, "query"),
        ("/v2/rerank", {"model": MODEL, "query": 7, "documents": ["a"]}, 422, None, "query"),
        ("/v2/rerank", {"model": MODEL, "documents": ["a"]}, 422, None, "query"),
        ("/v2/rerank", {"query": QUERY, "documents": ["a"]}, 422, None, "model"),
        ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": [{"txt": "a"}]}, 422, None, "documents"),
        ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["a"], "top_n": 0}, 422, None, "top_n"),
        (
            "/v2/rerank",
            {"model": MODEL, "query": QUERY, "documents": ["a"], "max_tokens_per_doc": 1},
            422,
            None,
            "max_tokens_per_doc",
        ),
        (
            "/v2/rerank",
            {"model": MODEL, "query": QUERY, "documents": ["a"], "max_tokens_per_doc": 4097},
            422,
            None,
            "max_tokens_per_doc",
        ),
        ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["a"] * 1001}, 413, None, "documents"),
        # 140 documents of 252 tokens: over MAX_TOKENS_PER_REQUEST (32,768) in all.
        ("/v1/rerank", {"query": QUERY, "documents": ["word " * 250] * 140}, 413, None, "documents"),
        ("/v2/rerank", {"model": "no-such-model", "query": QUERY, "documents": ["a"]}, 404, None, "model"),
        ("/v1/rerank", {"query": QUERY, "documents": "a"}, 422, None, "documents"),
        ("/rerank", {"query": QUERY, "texts": ["a"], "truncation_direction": "Up"}, 422, None, None),
    ],
)
def test_bad_requests_are_clear_4xx(uvicorn_server, path, body, status, code, param):
    response = post(uvicorn_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_a_key_is_needed(uvicorn_server):
    response = httpx2.post(
        f"{uvicorn_server.base_url}/v2/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a"]}
    )
    assert response.status_code == 401


# --- The catalog's tasks, in process ----------------------------------------------------------


@pytest.fixture
def reranker(api_setup) -> EmbeddingModel:
    """A cross-encoder in the catalog that this Triton does not serve (served ones rank in
    tests/model_serving/test_second_model.py)."""
    return EmbeddingModel.objects.create(
        name="a-reranker", task="rerank", triton_model="a_reranker", dimensions=1, max_tokens=512
    )


async def test_models_say_which_rank_and_how(client, alpha, reranker, model, settings):
    settings.MODEL_CACHE_SECONDS = 0
    listed = (await client.get("/v1/models", headers=alpha.headers)).json()["data"]
    by_id = {item["id"]: item for item in listed}
    assert by_id[MODEL]["task"] == "embed"
    assert by_id[MODEL]["rerank"] == {
        "method": "cosine_similarity",
        "activation": None,
        "score_range": [-1.0, 1.0],
    }
    assert by_id["a-reranker"]["task"] == "rerank"
    # No activation recorded: the logit is the score, unbounded.
    assert by_id["a-reranker"]["rerank"] == {
        "method": "cross_encoder",
        "activation": "identity",
        "score_range": None,
    }
    reranker.score_activation = "sigmoid"
    await reranker.asave(update_fields=["score_activation"])
    detail = (await client.get("/v1/models/a-reranker", headers=alpha.headers)).json()
    assert detail["rerank"] == {"method": "cross_encoder", "activation": "sigmoid", "score_range": [0.0, 1.0]}
    model.rerank_by_similarity = False
    await model.asave(update_fields=["rerank_by_similarity"])
    detail = (await client.get(f"/v1/models/{MODEL}", headers=alpha.headers)).json()
    assert detail["rerank"] is None
    refused = await client.post(
        "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a"]}, headers=alpha.headers
    )
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "unsupported_by_model"


async def test_a_rerank_model_makes_no_embeddings(client, alpha, reranker, settings):
    settings.MODEL_CACHE_SECONDS = 0
    for path, body in [
        ("/v1/embeddings", {"model": "a-reranker", "input": "hello"}),
        ("/api/v1/embed", {"model": "a-reranker", "inputs": "hello"}),
        ("/v1/jobs", {"model": "a-reranker", "input": ["hello", "world"]}),
    ]:
        response = await client.post(path, json=body, headers=alpha.headers)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_by_model", "model")
        assert "is a rerank model" in error["message"]


async def test_a_rerank_model_is_preferred_where_none_is_named(client, alpha, reranker, settings):
    settings.MODEL_CACHE_SECONDS = 0
    response = await client.post("/rerank", json={"query": QUERY, "texts": ["a"]}, headers=alpha.headers)
    # The cross-encoder is chosen over MiniLM's similarity (and said not to be loaded here).
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_not_loaded" and "a-reranker" in response.text
    reranker.enabled = False
    await reranker.asave(update_fields=["enabled"])
    assert (
        await client.post("/rerank", json={"query": QUERY, "texts": ["a"]}, headers=alpha.headers)
    ).status_code == 200


def test_a_batch_line_naming_a_rerank_model_is_refused_as_such(alpha, reranker):
    from embeddings.services.openai_api.batches import _LineProblem, _Models

    models = _Models(alpha.tenant)
    assert models.resolve(MODEL).name == MODEL
    with pytest.raises(_LineProblem) as refused:
        models.resolve("a-reranker")
    assert (refused.value.code, refused.value.param) == ("unsupported_by_model", "model")
    assert "is a rerank model" in refused.value.message
