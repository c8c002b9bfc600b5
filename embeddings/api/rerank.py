"""Rerank views in the three shapes peers serve: Cohere's v2, Jina's and Cohere's v1, TEI's.

Thin: validate, pick the model, call the ranking service (services/inference/ranking.py), render.
Each answer lists the documents best first; metered, logged and counted like embeddings.
"""

from __future__ import annotations

import math
import uuid

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import model_for_request
from embeddings.api.base import ApiView
from embeddings.api.docs import ERRORS, CohereApiVersionSerializer
from embeddings.api.served import embedding_response, log_request
from embeddings.contracts.fields import validated
from embeddings.contracts.rerank_request import CohereRerankRequest, RerankRequest, TeiRerankRequest
from embeddings.errors.answers import ModelNotFound
from embeddings.models import EmbeddingModel
from embeddings.services.inference import catalog
from embeddings.services.inference.ranking import RankingOptions, RankingResult, rerank_create

# Cohere bills a search unit per query of up to 100 documents.
DOCUMENTS_PER_SEARCH_UNIT = 100
EXAMPLE_DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow."]
EXAMPLE_ID = "5c5a4e8e-7a1b-4d6e-9a8f-2f1c3b4d5e6f"
EXAMPLE_BILLED = {"search_units": 1, "input_tokens": 24}


# --- Response shapes (documentation) -----------------------------------------------------------


class CohereResultSerializer(serializers.Serializer):
    index = serializers.IntegerField(help_text="The document's position in the request")
    relevance_score = serializers.FloatField(
        help_text="Higher is more relevant: a cross-encoder's activated logit (sigmoid: 0 to 1), or a cosine "
        "similarity (-1 to 1); GET /v1/models says which"
    )


class BilledUnitsSerializer(serializers.Serializer):
    search_units = serializers.IntegerField(help_text="One per query and 100 documents")
    input_tokens = serializers.IntegerField(
        help_text="Every token the model read: a cross-encoder's pairs (the query in each), or the "
        "query's and every document's for a similarity ranking"
    )


class MetaSerializer(serializers.Serializer):
    api_version = CohereApiVersionSerializer()
    billed_units = BilledUnitsSerializer()


class CohereRerankResponse(serializers.Serializer):
    id = serializers.CharField()
    results = CohereResultSerializer(many=True)
    meta = MetaSerializer()


class DocumentSerializer(serializers.Serializer):
    text = serializers.CharField()


class RerankResultSerializer(CohereResultSerializer):
    document = DocumentSerializer(required=False, help_text="With return_documents")


class RerankUsageSerializer(serializers.Serializer):
    total_tokens = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()


class RerankResponse(serializers.Serializer):
    id = serializers.CharField()
    model = serializers.CharField()
    results = RerankResultSerializer(many=True)
    usage = RerankUsageSerializer()
    meta = MetaSerializer()


class TeiRankSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    score = serializers.FloatField()
    text = serializers.CharField(required=False, help_text="With return_text")


# --- Shared steps --------------------------------------------------------------------------------


def _meta(result: RankingResult, documents: int, version: str) -> dict:
    return {
        "api_version": {"version": version},
        "billed_units": {
            "search_units": math.ceil(documents / DOCUMENTS_PER_SEARCH_UNIT),
            "input_tokens": result.total_tokens,
        },
    }


def _results(result: RankingResult, documents: list[str], top_n: int | None, *, with_documents: bool) -> list:
    """Cohere's and Jina's results: the best `top_n` documents first, with their texts if asked."""
    results = []
    for index in result.ranked(top_n):
        item = {"index": index, "relevance_score": float(result.scores[index])}
        if with_documents:
            item["document"] = {"text": documents[index]}
        results.append(item)
    return results


async def _rank(
    view: ApiView, name: str | None, query: str, documents: list[str], options: RankingOptions
) -> tuple[EmbeddingModel, RankingResult]:
    """The model the request names (or the caller's default ranking model), checked before any
    work, and its scores for the documents."""
    if name is None:
        default = await catalog.rerank_model_default(caller=view.caller)
        if default is None:
            raise ModelNotFound("No model this key may use ranks documents.", param="model")
        name = default.name
    model = await model_for_request(view, name, embeds=False)
    result = await rerank_create(
        model=model,
        query=query,
        documents=documents,
        options=options,
        quota=view.request_quota(model),
        cache_scope=None if view.caller is None else view.caller.cache_scope_for(model),
    )
    log_request(view.caller, view.endpoint, model, result, action="rerank")
    return model, result


# --- Views -------------------------------------------------------------------------------------


class CohereRerankView(ApiView):
    endpoint = "cohere_rerank"

    @extend_schema(
        operation_id="rerank_v2",
        summary="Rerank documents (Cohere v2)",
        description="Works with the official `cohere` SDK: `cohere.ClientV2(base_url=...)`, then "
        "`client.rerank(...)`.",
        request=CohereRerankRequest,
        responses={200: CohereRerankResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "Two documents",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "query": "What is the capital of France?",
                    "documents": EXAMPLE_DOCUMENTS,
                    "top_n": 1,
                },
                request_only=True,
            ),
            OpenApiExample(
                "The best document",
                value={
                    "id": EXAMPLE_ID,
                    "results": [{"index": 0, "relevance_score": 0.81}],
                    "meta": {"api_version": {"version": "2"}, "billed_units": EXAMPLE_BILLED},
                },
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["rerank"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(CohereRerankRequest, request.data)
        documents = params["documents"]
        _, result = await _rank(
            self,
            params["model"],
            params["query"],
            documents,
            RankingOptions(max_tokens_per_document=params.get("max_tokens_per_doc")),
        )
        results = _results(result, documents, params.get("top_n"), with_documents=False)
        return embedding_response(
            {"id": str(uuid.uuid4()), "results": results, "meta": _meta(result, len(documents), "2")}, result
        )


class RerankView(ApiView):
    endpoint = "rerank"

    @extend_schema(
        operation_id="rerank_v1",
        summary="Rerank documents (Jina, Cohere v1)",
        description="The shape Jina's and Cohere's v1 rerank share; `return_documents` adds each text.",
        request=RerankRequest,
        responses={200: RerankResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "With the documents' texts",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "query": "What is the capital of France?",
                    "documents": EXAMPLE_DOCUMENTS,
                    "return_documents": True,
                },
                request_only=True,
            ),
            OpenApiExample(
                "Best first, with texts",
                value={
                    "id": EXAMPLE_ID,
                    "model": "all-MiniLM-L6-v2",
                    "results": [
                        {"index": 0, "relevance_score": 0.81, "document": {"text": EXAMPLE_DOCUMENTS[0]}},
                        {"index": 1, "relevance_score": 0.02, "document": {"text": EXAMPLE_DOCUMENTS[1]}},
                    ],
                    "usage": {"total_tokens": 24, "prompt_tokens": 24},
                    "meta": {"api_version": {"version": "1"}, "billed_units": EXAMPLE_BILLED},
                },
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["rerank"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(RerankRequest, request.data)
        documents = params["documents"]
        model, result = await _rank(
            self,
            params.get("model"),
            params["query"],
            documents,
            RankingOptions(max_tokens_per_document=params.get("max_tokens_per_doc")),
        )
        results = _results(result, documents, params.get("top_n"), with_documents=params["return_documents"])
        body = {
            "id": str(uuid.uuid4()),
            "model": model.name,
            "results": results,
            "usage": {"total_tokens": result.total_tokens, "prompt_tokens": result.total_tokens},
            "meta": _meta(result, len(documents), "1"),
        }
        return embedding_response(body, result)


class TeiRerankView(ApiView):
    endpoint = "tei_rerank"

    @extend_schema(
        operation_id="rerank_tei",
        summary="Rerank texts (TEI)",
        description="TEI's shape: the ranks best first. The model is a rerank model this key may use, "
        "else the default embedding model if it ranks by similarity.",
        request=TeiRerankRequest,
        responses={200: TeiRankSerializer(many=True), **ERRORS},
        examples=[
            OpenApiExample(
                "Two texts",
                value={"query": "What is the capital of France?", "texts": EXAMPLE_DOCUMENTS},
                request_only=True,
            ),
            OpenApiExample(
                "Ranks", value={"index": 0, "score": 0.81}, response_only=True, status_codes=["200"]
            ),
        ],
        tags=["rerank"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(TeiRerankRequest, request.data)
        texts = params["texts"]
        _, result = await _rank(
            self,
            None,
            params["query"],
            texts,
            RankingOptions(
                truncate=params["truncate"],
                direction="left" if params["truncation_direction"] == "Left" else "right",
                raw_scores=params["raw_scores"],
            ),
        )
        ranks = []
        for index in result.ranked():
            item = {"index": index, "score": float(result.scores[index])}
            if params["return_text"]:
                item["text"] = texts[index]
            ranks.append(item)
        return embedding_response(ranks, result)
