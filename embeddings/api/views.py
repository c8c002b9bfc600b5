"""HTTP views. Thin: validate, call the embedding service, render."""

from __future__ import annotations

import base64
import logging
import time

import numpy as np
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api import serializers as s
from embeddings.api.authentication import ApiPrincipal, ensure_model_allowed
from embeddings.api.base import ApiView
from embeddings.api.errors import ModelNotFound, ValidationFailed
from embeddings.api.middleware import ARRIVED
from embeddings.models import EmbeddingModel
from embeddings.services import catalog
from embeddings.services.embedding import (
    EmbeddingOptions,
    EmbeddingResult,
    EmbeddingTarget,
    embeddings_create,
)

logger = logging.getLogger("embeddings.requests")

ERRORS = {
    code: OpenApiResponse(s.ErrorSerializer, description=description)
    for code, description in {
        400: "Malformed JSON",
        401: "Missing, unknown, revoked or expired API key",
        403: "Inactive tenant, or a model this key may not use",
        404: "Unknown model",
        413: "Body, inputs or tokens over a limit (or an input too long with truncation off)",
        422: "Invalid fields",
        429: "Overloaded: retry after Retry-After seconds",
        503: "The model server is unavailable",
        504: "The model server missed its deadline",
    }.items()
}


def validated(serializer_class: type, data: object) -> dict:
    if not isinstance(data, dict):
        raise ValidationFailed("The request body must be a JSON object.")
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


async def model_for_request(principal: ApiPrincipal, name: str | None) -> EmbeddingModel:
    """The model a request names (or the default), which this key must be allowed to use."""
    model = await catalog.embedding_model_resolve(name=name or settings.DEFAULT_EMBEDDING_MODEL)
    if model is None:
        raise ModelNotFound(
            f"The model {name!r} does not exist or you do not have access to it.", param="model"
        )
    ensure_model_allowed(principal, model)
    return model


def log_request(
    request: Request, endpoint: str, model: EmbeddingModel, result: EmbeddingResult, user: str = ""
):
    principal: ApiPrincipal = request.user
    logger.info(
        "embed endpoint=%s tenant=%s key=%s model=%s inputs=%d tokens=%d inference_ms=%.1f user=%s",
        endpoint,
        principal.tenant_slug,
        principal.key_public_id,
        model.name,
        len(result.token_counts),
        result.total_tokens,
        result.inference_s * 1000,
        user,
    )


def embedding_response(data: object, result: EmbeddingResult) -> Response:
    """The response, with where the time went in a Server-Timing header (milliseconds)."""
    timing = f"tokenize;dur={result.tokenization_s * 1000:.3f}, inference;dur={result.inference_s * 1000:.3f}"
    return Response(data, headers={"Server-Timing": timing})


def usage(result: EmbeddingResult) -> dict:
    return {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}


def base64_rows(vectors: np.ndarray) -> list[str]:
    """Each row as the base64 of its little-endian float32 bytes, straight from the array's buffer."""
    little_endian = np.ascontiguousarray(vectors, dtype="<f4")
    row_bytes = little_endian.shape[1] * 4
    raw = little_endian.tobytes()
    return [base64.b64encode(raw[i : i + row_bytes]).decode("ascii") for i in range(0, len(raw), row_bytes)]


class OpenAIEmbeddingsView(ApiView):
    @extend_schema(
        operation_id="create_embeddings",
        summary="Create embeddings (OpenAI-compatible)",
        description="Works with the official `openai` SDKs: point `base_url` at `/v1`.",
        request=s.OpenAIEmbeddingsRequest,
        responses={200: s.OpenAIEmbeddingsResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "Two texts",
                value={"model": "all-MiniLM-L6-v2", "input": ["hello", "world"], "encoding_format": "float"},
                request_only=True,
            )
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(s.OpenAIEmbeddingsRequest, request.data)
        model = await model_for_request(request.user, params["model"])
        parsed: s.ParsedInput = params["input"]
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model),
            texts=parsed.texts,
            token_ids=parsed.token_ids,
            options=EmbeddingOptions(dimensions=params.get("dimensions")),
        )
        log_request(request, "openai", model, result, params.get("user", ""))
        if params["encoding_format"] == "base64":
            embeddings = base64_rows(result.vectors)
        else:
            embeddings = list(result.vectors)
        data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
        return embedding_response(
            {"object": "list", "data": data, "model": model.name, "usage": usage(result)}, result
        )


class SeedEmbeddingView(ApiView):
    @extend_schema(
        operation_id="create_embedding_seed",
        summary="Embed queries (the seed proxy's shape)",
        description='`[{"query": "..."}, ...]` → `[{"embedding": [...]}, ...]`, with the default model.',
        request={"application/json": s.SeedQueriesField},
        responses={200: s.SeedEmbeddingSerializer(many=True), **ERRORS},
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        texts = s.SeedQueriesField().run_validation(request.data)
        model = await model_for_request(request.user, None)
        result = await embeddings_create(target=EmbeddingTarget.for_model(model), texts=texts)
        log_request(request, "seed", model, result)
        return embedding_response([{"embedding": vector} for vector in result.vectors], result)


class TeiEmbedView(ApiView):
    @extend_schema(
        operation_id="embed",
        summary="Embed inputs (TEI-like shape, with timings)",
        request=s.TeiEmbedRequest,
        responses={200: s.TeiEmbedResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "A query with a prompt",
                value={"inputs": ["What is Deep Learning?"], "truncate": True, "normalize": True},
                request_only=True,
            )
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        arrived = request._request.META.get(ARRIVED, time.perf_counter())
        params = validated(s.TeiEmbedRequest, request.data)
        model = await model_for_request(request.user, params.get("model"))
        queue_s = time.perf_counter() - arrived
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model),
            texts=params["inputs"],
            options=EmbeddingOptions(
                truncate=params["truncate"],
                direction="left" if params["truncation_direction"] == "Left" else "right",
                dimensions=params.get("dimensions"),
                normalize=params["normalize"],
                prompt_name=params.get("prompt_name"),
            ),
        )
        log_request(request, "tei", model, result)
        return embedding_response(
            {
                "data": [{"embedding": vector, "index": i} for i, vector in enumerate(result.vectors)],
                "model": model.name,
                "usage": usage(result),
                "timings": {
                    "tokenization": result.tokenization_s * 1000,
                    "queue": queue_s * 1000,
                    "inference": result.inference_s * 1000,
                },
            },
            result,
        )


def model_object(model: EmbeddingModel) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "created": int(model.created_at.timestamp()),
        "owned_by": model.owned_by,
        "dimensions": model.dimensions,
        "max_tokens": model.max_tokens,
        "aliases": list(model.aliases or []),
    }


class ModelListView(ApiView):
    @extend_schema(
        operation_id="list_models",
        summary="Models this key may use",
        responses={200: s.ModelListSerializer, 401: ERRORS[401], 403: ERRORS[403]},
        tags=["models"],
    )
    async def get(self, request: Request) -> Response:
        models = await catalog.embedding_models_for_principal(principal=request.user)
        return Response({"object": "list", "data": [model_object(model) for model in models]})


class ModelDetailView(ApiView):
    @extend_schema(
        operation_id="retrieve_model",
        summary="One model",
        responses={200: s.ModelObjectSerializer, 401: ERRORS[401], 403: ERRORS[403], 404: ERRORS[404]},
        tags=["models"],
    )
    async def get(self, request: Request, model_id: str) -> Response:
        model = await model_for_request(request.user, model_id)
        return Response(model_object(model))


async def health(request: HttpRequest) -> HttpResponse:
    """Liveness: the process answers. Readiness (Triton, database) is /ready."""
    return HttpResponse("ok", content_type="text/plain")
