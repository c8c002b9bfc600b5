"""HTTP views. Thin: validate, call the embedding service, render."""

from __future__ import annotations

import logging
import time

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
)
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api import serializers as s
from embeddings.api.authentication import ensure_model_allowed
from embeddings.api.base import ApiView
from embeddings.api.errors import (
    BadRequest,
    Forbidden,
    InsufficientQuota,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamTimeout,
    UpstreamUnavailable,
    ValidationFailed,
    as_api_error,
)
from embeddings.api.middleware import ARRIVED
from embeddings.api.schema import ListLengthAutoSchema
from embeddings.callers import Caller
from embeddings.metrics import embedded_observed
from embeddings.models import EmbeddingModel
from embeddings.services import catalog
from embeddings.services.embedding import (
    EmbeddingOptions,
    EmbeddingResult,
    EmbeddingTarget,
    embeddings_create,
)
from embeddings.services.errors import ModelNotLoaded, QuotaUnavailable
from embeddings.services.openai_embeddings import embeddings_response_body

logger = logging.getLogger("embeddings.requests")


def _error_response(description: str, *errors: Exception) -> OpenApiResponse:
    """A documented error status, its examples rendered as the API renders those errors."""
    examples = [
        OpenApiExample(
            f"{type(error).__name__}: {as_api_error(error).error_code}",
            value=as_api_error(error).body(with_request_id=False),
            response_only=True,
        )
        for error in errors
    ]
    return OpenApiResponse(s.ErrorSerializer, description=description, examples=examples)


ERRORS = {
    400: _error_response("Malformed JSON", BadRequest("The request body is not valid JSON: ...")),
    401: _error_response("Missing, unknown, revoked or expired API key", Unauthorized()),
    403: _error_response("Inactive tenant, or a model this key may not use", Forbidden()),
    404: _error_response(
        "Unknown model",
        ModelNotFound("The model 'nope' does not exist or you do not have access to it.", param="model"),
    ),
    413: _error_response(
        "Body, inputs or tokens over a limit (or an input too long with truncation off)",
        PayloadTooLarge("3000 inputs in one request; this model takes at most 2048", param="input"),
    ),
    415: _error_response(
        "A body that is not JSON, or JSON declared in another charset than UTF-8",
        UnsupportedMediaType("A JSON body must be UTF-8; charset 'latin-1' is not supported."),
    ),
    422: _error_response(
        "Invalid fields",
        ValidationFailed(
            "input: must be a string, an array of strings, an array of token ids or an array of "
            "arrays of token ids",
            param="input",
        ),
    ),
    429: _error_response(
        "A rate limit (requests or tokens per minute, concurrent requests: `rate_limit_exceeded`), the "
        "daily or monthly token budget (`insufficient_quota`), or the server is overloaded. Retry after "
        "the Retry-After header's seconds; the x-ratelimit-* headers describe the binding window.",
        RateLimited(
            "Rate limit reached for this tenant's requests per minute (RPM): limit 60, used 60, "
            "requested 1. Please try again in 12s.",
            limit_type="requests",
        ),
        InsufficientQuota(
            "You exceeded this tenant's quota of tokens per month: limit 1000000, used 999990, "
            "requested 24. It resets in 190h0m0s."
        ),
        RateLimited(),
    ),
    503: _error_response(
        "The model server is unavailable, the model is registered but not loaded on it "
        "(`model_not_loaded`), or quotas cannot be checked (Redis down, QUOTA_REDIS_FAILURE=closed)",
        UpstreamUnavailable(),
        ModelNotLoaded(model="bge-small", triton_model="bge_small", version="2"),
        QuotaUnavailable("Rate limiting is unavailable, so the request was not served; retry shortly."),
    ),
    504: _error_response("The model server missed its deadline", UpstreamTimeout()),
}
AUTH_ERRORS = {code: ERRORS[code] for code in (401, 403)}
# Shortened vectors for examples (real ones have the model's dimensions, e.g. 384).
EXAMPLE_VECTOR = [0.0123, -0.0456, 0.0789]


def validated(serializer_class: type, data: object, *, form: bool = False) -> dict:
    """The serializer's validated data. form: the values are multipart form fields (text), read
    as DRF reads them; otherwise JSON values must have the type the schema names."""
    if not isinstance(data, dict):
        raise ValidationFailed("The request body must be a JSON object.")
    serializer = serializer_class(data=data, context={"form": form})
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


async def model_for_request(view: ApiView, name: str | None) -> EmbeddingModel:
    """The model a request names (or the default), which this key must be allowed to use.

    The view's metrics are labelled with it from here on (errors included).
    """
    model = await catalog.embedding_model_resolve(name=name or settings.DEFAULT_EMBEDDING_MODEL)
    if model is None:
        raise ModelNotFound(
            f"The model {name!r} does not exist or you do not have access to it.", param="model"
        )
    view.model_name = model.name
    ensure_model_allowed(view.request.user, model)
    return model


def log_request(
    request: Request, endpoint: str, model: EmbeddingModel, result: EmbeddingResult, user: str = ""
):
    principal: Caller = request.user
    embedded_observed(
        endpoint=endpoint, model=model.name, inputs=len(result.token_counts), tokens=result.total_tokens
    )
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
        # As fields of their own in JSON lines (README "Observability").
        extra={
            "tokenization_ms": round(result.tokenization_s * 1000, 3),
            "inference_ms": round(result.inference_s * 1000, 3),
        },
    )


def embedding_response(data: object, result: EmbeddingResult) -> Response:
    """The response, with where the time went in a Server-Timing header (milliseconds)."""
    timing = f"tokenize;dur={result.tokenization_s * 1000:.3f}, inference;dur={result.inference_s * 1000:.3f}"
    return Response(data, headers={"Server-Timing": timing})


def usage(result: EmbeddingResult) -> dict:
    return {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}


class OpenAIEmbeddingsView(ApiView):
    endpoint = "openai"

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
            ),
            OpenApiExample(
                "Token ids, base64, 64 dimensions",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "input": [[7592, 2088]],
                    "encoding_format": "base64",
                    "dimensions": 64,
                },
                request_only=True,
            ),
            OpenApiExample(
                "Floats",
                value={
                    "object": "list",
                    "data": [
                        {"object": "embedding", "index": 0, "embedding": EXAMPLE_VECTOR},
                        {"object": "embedding", "index": 1, "embedding": EXAMPLE_VECTOR},
                    ],
                    "model": "all-MiniLM-L6-v2",
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                },
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(s.OpenAIEmbeddingsRequest, request.data)
        model = await model_for_request(self, params["model"])
        parsed: s.ParsedInput = params["input"]
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model),
            texts=parsed.texts,
            token_ids=parsed.token_ids,
            options=EmbeddingOptions(dimensions=params.get("dimensions")),
            quota=self.request_quota(model.name),
        )
        log_request(request, self.endpoint, model, result, params.get("user", ""))
        body = embeddings_response_body(
            model_name=model.name,
            vectors=result.vectors,
            total_tokens=result.total_tokens,
            encoding_format=params["encoding_format"],
        )
        return embedding_response(body, result)


class SeedEmbeddingView(ApiView):
    endpoint = "seed"
    # Its body is an array: `[]` is documented as refused (minItems 1).
    schema = ListLengthAutoSchema()

    @extend_schema(
        operation_id="create_embedding_seed",
        summary="Embed queries (the seed proxy's shape)",
        description='`[{"query": "..."}, ...]` → `[{"embedding": [...]}, ...]`, with the default model.',
        request=s.SeedQuerySerializer(many=True, min_length=1),
        responses={200: s.SeedEmbeddingSerializer(many=True), **ERRORS},
        # drf-spectacular lists a many=True example itself: each value is one item of the array.
        examples=[
            OpenApiExample("One query", value={"query": "hello"}, request_only=True),
            OpenApiExample(
                "One embedding", value={"embedding": EXAMPLE_VECTOR}, response_only=True, status_codes=["200"]
            ),
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        texts = s.SeedQueriesField().run_validation(request.data)
        model = await model_for_request(self, None)
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model), texts=texts, quota=self.request_quota(model.name)
        )
        log_request(request, self.endpoint, model, result)
        return embedding_response([{"embedding": vector} for vector in result.vectors], result)


TEI_EMBED_SCHEMA = dict(
    request=s.TeiEmbedRequest,
    responses={200: s.TeiEmbedResponse, **ERRORS},
    examples=[
        OpenApiExample(
            "A query with a prompt",
            value={"inputs": ["What is Deep Learning?"], "truncate": True, "normalize": True},
            request_only=True,
        ),
        OpenApiExample(
            "One embedding with timings",
            value={
                "data": [{"embedding": EXAMPLE_VECTOR, "index": 0}],
                "model": "all-MiniLM-L6-v2",
                "usage": {"prompt_tokens": 8, "total_tokens": 8},
                "timings": {"tokenization": 0.05, "queue": 0.12, "inference": 2.4},
            },
            response_only=True,
            status_codes=["200"],
        ),
    ],
    tags=["embeddings"],
)


class TeiEmbedView(ApiView):
    endpoint = "tei"

    @extend_schema(
        operation_id="embed", summary="Embed inputs (TEI-like shape, with timings)", **TEI_EMBED_SCHEMA
    )
    async def post(self, request: Request) -> Response:
        arrived = request._request.META.get(ARRIVED, time.perf_counter())
        params = validated(s.TeiEmbedRequest, request.data)
        model = await model_for_request(self, params.get("model"))
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
            quota=self.request_quota(model.name),
        )
        log_request(request, self.endpoint, model, result)
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


class TeiEmbedShortView(TeiEmbedView):
    """The same endpoint at the seed's short path, documented as its own operation."""

    # Its own async method: drf-spectacular's extend_schema_view would wrap the inherited one in a
    # sync function, which adrf then refuses to await.
    @extend_schema(
        operation_id="embed_short",
        summary="Embed inputs (TEI-like shape; `/embed` alias)",
        **TEI_EMBED_SCHEMA,
    )
    async def post(self, request: Request) -> Response:
        return await super().post(request)


MODEL_EXAMPLE = {
    "id": "all-MiniLM-L6-v2",
    "object": "model",
    "created": 1767225600,
    "owned_by": "embedsite",
    "dimensions": 384,
    "max_tokens": 256,
    "aliases": ["minilm", "sentence-transformers/all-MiniLM-L6-v2"],
}


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
    endpoint = "models"

    @extend_schema(
        operation_id="list_models",
        summary="Models this key may use",
        responses={200: s.ModelListSerializer, **AUTH_ERRORS},
        examples=[
            OpenApiExample(
                "The local model",
                value={"object": "list", "data": [MODEL_EXAMPLE]},
                response_only=True,
                status_codes=["200"],
            )
        ],
        tags=["models"],
    )
    async def get(self, request: Request) -> Response:
        models = await catalog.embedding_models_for_principal(principal=request.user)
        return Response({"object": "list", "data": [model_object(model) for model in models]})


class ModelDetailView(ApiView):
    endpoint = "model"

    @extend_schema(
        operation_id="retrieve_model",
        summary="One model",
        parameters=[
            OpenApiParameter(
                "model_id",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                description="A model id or alias; it may contain `/`.",
            )
        ],
        responses={200: s.ModelObjectSerializer, **AUTH_ERRORS, 404: ERRORS[404]},
        examples=[
            OpenApiExample("The local model", value=MODEL_EXAMPLE, response_only=True, status_codes=["200"])
        ],
        tags=["models"],
    )
    async def get(self, request: Request, model_id: str) -> Response:
        model = await model_for_request(self, model_id)
        return Response(model_object(model))
