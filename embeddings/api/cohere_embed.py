"""POST /v2/embed in Cohere's v2 shape: the official `cohere` SDK's `ClientV2.embed` unmodified.

Thin: validate, pick the model, embed once in float, answer each asked type (quantised from those
vectors), metered and logged as every embedding request.
"""

from __future__ import annotations

import dataclasses
import uuid

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import model_for_request
from embeddings.api.base import ApiView
from embeddings.api.docs import ERRORS, CohereApiVersionSerializer
from embeddings.api.served import embedding_response, log_request
from embeddings.contracts.cohere_embed_request import CohereEmbedRequest
from embeddings.contracts.fields import validated
from embeddings.result_dtypes import base64_rows
from embeddings.services.inference.embedding import (
    EmbeddingOptions,
    EmbeddingTarget,
    embeddings_create,
    output_type_check,
    vectors_as,
)

EXAMPLE_EMBEDDINGS = {"float": [[0.0123, -0.0456, 0.0789]], "int8": [[12, -45, 78]]}


class EmbeddingsByTypeSerializer(serializers.Serializer):
    float = serializers.ListField(child=serializers.ListField(child=serializers.FloatField()), required=False)
    int8 = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField()), required=False
    )
    uint8 = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField()), required=False
    )
    binary = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField()),
        required=False,
        help_text="Sign bits packed eight to a byte, each byte as a signed int8",
    )
    ubinary = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField()), required=False
    )
    base64 = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="Each float vector's float32 bytes, base64"
    )


class EmbedBilledUnitsSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()


class EmbedMetaSerializer(serializers.Serializer):
    api_version = CohereApiVersionSerializer()
    billed_units = EmbedBilledUnitsSerializer()


class CohereEmbedResponse(serializers.Serializer):
    id = serializers.CharField()
    response_type = serializers.CharField(default="embeddings_by_type")
    embeddings = EmbeddingsByTypeSerializer(help_text="One array per asked type, in input order")
    texts = serializers.ListField(child=serializers.CharField())
    meta = EmbedMetaSerializer()


class CohereEmbedView(ApiView):
    endpoint = "cohere_embed"

    @extend_schema(
        operation_id="embed_v2",
        summary="Embed texts (Cohere v2)",
        description="Works with the official `cohere` SDK: `cohere.ClientV2(base_url=...)`, then "
        "`client.embed(...)`.",
        request=CohereEmbedRequest,
        responses={200: CohereEmbedResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "A query, in float and int8",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "input_type": "search_query",
                    "texts": ["What is the capital of France?"],
                    "embedding_types": ["float", "int8"],
                },
                request_only=True,
            ),
            OpenApiExample(
                "Embeddings by type",
                value={
                    "id": "5c5a4e8e-7a1b-4d6e-9a8f-2f1c3b4d5e6f",
                    "response_type": "embeddings_by_type",
                    "embeddings": EXAMPLE_EMBEDDINGS,
                    "texts": ["What is the capital of France?"],
                    "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": 9}},
                },
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(CohereEmbedRequest, request.data)
        texts = params.get("texts") or params["inputs"]
        model = await model_for_request(self, params["model"])
        target = EmbeddingTarget.for_model(model)
        options = EmbeddingOptions(
            truncate=params["truncate"] != "NONE",
            direction="left" if params["truncate"] == "START" else "right",
            dimensions=params.get("output_dimension"),
            input_type=params["input_type"],
            max_tokens=params.get("max_tokens"),
        )
        kinds = params["embedding_types"]
        for kind in kinds:  # every asked type refused before any work if the model cannot give it
            if kind != "base64":
                output_type_check(target, dataclasses.replace(options, output_type=kind))
        result = await embeddings_create(
            target=target,
            texts=texts,
            options=options,
            quota=self.request_quota(model),
            cache_scope=None if self.caller is None else self.caller.cache_scope_for(model),
        )
        log_request(self.caller, self.endpoint, model, result)
        embeddings = {
            kind: base64_rows(result.vectors)
            if kind == "base64"
            else list(vectors_as(target, result.vectors, dataclasses.replace(options, output_type=kind)))
            for kind in kinds
        }
        body = {
            "id": str(uuid.uuid4()),
            "response_type": "embeddings_by_type",
            "embeddings": embeddings,
            "texts": texts,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": result.total_tokens}},
        }
        return embedding_response(body, result)
