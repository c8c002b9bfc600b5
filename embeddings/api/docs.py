"""What the OpenAPI document shows alike for several endpoints: the error answers (rendered as the
API renders those errors), the shape of an error, of a page of a list and of a vector, and the
example vector."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema_field
from rest_framework import serializers

from embeddings.errors.answers import (
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
from embeddings.errors.service import ModelNotLoaded, QuotaUnavailable


@extend_schema_field(
    {
        "oneOf": [
            {"type": "array", "items": {"type": "number", "format": "float"}},
            {"type": "string", "format": "byte"},
        ],
        "description": "A float array, or with encoding_format=base64 the base64 of the vector's "
        "little-endian float32 bytes.",
    }
)
class EmbeddingVectorField(serializers.JSONField):
    """Documentation only: responses are rendered straight from numpy arrays."""


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)
    request_id = serializers.CharField(required=False, help_text="The response's X-Request-Id")


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class ListPageSerializer(serializers.Serializer):
    """A page of a list as OpenAI answers one (api/base.py list_page); subclasses name `data`'s items."""

    object = serializers.CharField(default="list", help_text='Always "list".')
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


def error_response(description: str, *errors: Exception) -> OpenApiResponse:
    """A documented error status, its examples rendered as the API renders those errors."""
    examples = [
        OpenApiExample(
            f"{type(error).__name__}: {as_api_error(error).error_code}",
            value=as_api_error(error).body(with_request_id=False),
            response_only=True,
        )
        for error in errors
    ]
    return OpenApiResponse(ErrorSerializer, description=description, examples=examples)


ERRORS = {
    400: error_response("Malformed JSON", BadRequest("The request body is not valid JSON: ...")),
    401: error_response("Missing, unknown, revoked or expired API key", Unauthorized()),
    403: error_response("Inactive tenant, or a model this key may not use", Forbidden()),
    404: error_response(
        "Unknown model",
        ModelNotFound("The model 'nope' does not exist or you do not have access to it.", param="model"),
    ),
    413: error_response(
        "Body, inputs or tokens over a limit (or an input too long with truncation off)",
        PayloadTooLarge("3000 inputs in one request; this model takes at most 2048", param="input"),
    ),
    415: error_response(
        "A body that is not JSON, or JSON declared in another charset than UTF-8",
        UnsupportedMediaType("A JSON body must be UTF-8; charset 'latin-1' is not supported."),
    ),
    422: error_response(
        "Invalid fields",
        ValidationFailed(
            "input: must be a string, an array of strings, an array of token ids or an array of "
            "arrays of token ids",
            param="input",
        ),
    ),
    429: error_response(
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
    503: error_response(
        "The model server is unavailable, the model is registered but not loaded on it "
        "(`model_not_loaded`), or quotas cannot be checked (Redis down, QUOTA_REDIS_FAILURE=closed)",
        UpstreamUnavailable(),
        ModelNotLoaded(model="bge-small", triton_model="bge_small", version="2"),
        QuotaUnavailable("Rate limiting is unavailable, so the request was not served; retry shortly."),
    ),
    504: error_response("The model server missed its deadline", UpstreamTimeout()),
}
AUTH_ERRORS = {code: ERRORS[code] for code in (401, 403)}
# Shortened vectors for examples (real ones have the model's dimensions, e.g. 384).
EXAMPLE_VECTOR = [0.0123, -0.0456, 0.0789]


class CohereApiVersionSerializer(serializers.Serializer):
    """`meta.api_version` of Cohere's answers (rerank and embed)."""

    version = serializers.CharField()
