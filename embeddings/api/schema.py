"""OpenAPI extensions for drf-spectacular: how our API key authentication appears in the schema,
the rate-limit headers of authenticated responses, the errors any request can meet at the HTTP
edge, the request bodies that admit no other field, and the links from an object to the operations
on it (which Schemathesis's stateful tests follow).

The extensions register with drf-spectacular when this module is imported: SPECTACULAR_SETTINGS
names SchemaGenerator below, so whatever generates the schema imports this module first.
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.generators import SchemaGenerator as SpectacularSchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_bearer_security_scheme_object, is_list_serializer

from embeddings.errors.answers import (
    ApiError,
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)


class SchemaGenerator(SpectacularSchemaGenerator):
    """drf-spectacular's generator, named in SPECTACULAR_SETTINGS["DEFAULT_GENERATOR_CLASS"]: the
    /api/schema/ view, `manage.py spectacular` and `check --deploy` load it before generating, and
    so this module with its extensions. Django's start-up need not import them (DRF, and through
    its compat module psycopg, requests and pygments): most processes never generate a schema."""


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """`Authorization: Bearer emb_<public id>_<secret>` (Swagger UI's Authorize button sends it)."""

    target_class = "embeddings.api.authentication.ApiKeyAuthentication"
    name = "ApiKeyBearer"

    def get_security_definition(self, auto_schema):
        scheme = build_bearer_security_scheme_object(
            header_name="Authorization", token_prefix="Bearer", bearer_format="emb_<public id>_<secret>"
        )
        return {
            **scheme,
            "description": "An API key created in the admin or with `manage.py create_api_key`.",
        }


RATELIMIT_HEADERS = {
    "x-ratelimit-limit-requests": "The binding request limit (tenant's or key's): a request rate's burst",
    "x-ratelimit-remaining-requests": "Requests that may pass now",
    "x-ratelimit-reset-requests": 'Until that bucket is full again, e.g. "625ms", "1m0s"',
    "x-ratelimit-limit-tokens": "The binding token limit (tenant's or key's): the token rate's burst, "
    "or the day's or month's budget",
    "x-ratelimit-remaining-tokens": "Tokens that may pass now",
    "x-ratelimit-reset-tokens": "Until that bucket is full again or that budget window ends, "
    'e.g. "20ms", "6m0s"',
}
RETRY_AFTER = {
    "Retry-After": ("Seconds to wait before retrying", "integer"),
    "retry-after-ms": (
        "Milliseconds until every limit that refused the request would admit it (429 only)",
        "integer",
    ),
}


def _header(description: str, kind: str = "string") -> dict:
    return {"description": description, "schema": {"type": kind}}


def ratelimit_headers_hook(result, generator, request, public):
    """drf-spectacular postprocessing hook: every authenticated response documents the x-ratelimit-*
    headers (sent only when a limit of that kind applies), and 429/503 document Retry-After."""
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                if status == "401":
                    continue
                headers = response.setdefault("headers", {})
                for name, description in RATELIMIT_HEADERS.items():
                    headers[name] = _header(f"{description}. Sent only when such a limit applies.")
                if status in ("429", "503"):
                    for name, (description, kind) in RETRY_AFTER.items():
                        if status == "429" or name == "Retry-After":
                            headers[name] = _header(description, kind)
    return result


class ListLengthAutoSchema(AutoSchema):
    """drf-spectacular drops a list serializer's min_length and max_length from an array body
    (`[]` would be documented as valid): this keeps them as minItems and maxItems."""

    def _unwrap_list_serializer(self, serializer, direction):
        schema = super()._unwrap_list_serializer(serializer, direction)
        if schema and is_list_serializer(serializer):
            if serializer.min_length is not None:
                schema["minItems"] = serializer.min_length
            if serializer.max_length is not None:
                schema["maxItems"] = serializer.max_length
        return schema


# Answers the HTTP edge gives any request, before or beside the view (embeddings/api/intake.py,
# ApiSecurityMiddleware, the parsers): documented on every operation that does not already say more.
EDGE_ERRORS: dict[str, tuple[str, ApiError]] = {
    "400": (
        "Malformed: a body that is not JSON, a query string that is not UTF-8, a bad Content-Length, "
        "or a Host header outside ALLOWED_HOSTS (`invalid_host`)",
        BadRequest("The Host header names a host this server does not serve.", code="invalid_host"),
    ),
    "408": (
        "The body stalled (REQUEST_BODY_IDLE_TIMEOUT_S) or arrived too slowly (REQUEST_BODY_TIMEOUT_S)",
        RequestTimeout("The request body did not arrive in time: no data for 10 s."),
    ),
    "413": (
        "A body over MAX_REQUEST_BODY_BYTES (JOB_MAX_UPLOAD_BYTES for an upload), refused as it arrives",
        PayloadTooLarge("The request body is larger than 16777216 bytes."),
    ),
    "415": (
        "A Content-Encoding other than identity (a compressed body): send it uncompressed",
        UnsupportedMediaType(
            "Content-Encoding gzip is not supported: send the body uncompressed.",
            code="unsupported_content_encoding",
        ),
    ),
}
ERROR_SCHEMA = {"$ref": "#/components/schemas/Error"}


def error_response(description: str, error: ApiError) -> dict:
    name = f"{type(error).__name__}: {error.error_code}"
    return {
        "description": description,
        "content": {
            # Built while serving /api/schema/: not that request's id.
            "application/json": {
                "schema": ERROR_SCHEMA,
                "examples": {name: {"value": error.body(with_request_id=False)}},
            }
        },
    }


def edge_errors_hook(result, generator, request, public):
    """drf-spectacular postprocessing hook: 400, 408, 413 and 415 on every operation (beside what an
    operation documents itself under the same status)."""
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status, (description, error) in EDGE_ERRORS.items():
                edge = error_response(description, error)
                own = responses.setdefault(status, edge)
                if own is not edge:
                    own["description"] = f"{own['description']}; or: {description}"
                    examples = own["content"]["application/json"].setdefault("examples", {})
                    examples.update(edge["content"]["application/json"]["examples"])
    return result


# Request bodies whose server refuses any field they do not name (the Files API's form, as OpenAI's):
# their schema says so, or a form with one more field would be documented as valid.
CLOSED_REQUEST_BODIES = ("FileUploadRequestRequest",)


def closed_bodies_hook(result, generator, request, public):
    """drf-spectacular postprocessing hook: `additionalProperties: false` on CLOSED_REQUEST_BODIES."""
    schemas = result.get("components", {}).get("schemas", {})
    for name in CLOSED_REQUEST_BODIES:
        schemas[name]["additionalProperties"] = False
    return result


# What each object's id leads to: from the operations that answer the object (and their statuses),
# a link to each operation on it, with the object's `id` as that operation's `parameters` (or merged
# into its `requestBody`). Schemathesis's stateful phase follows them: a job is read, cancelled,
# downloaded and deleted; a file is read, downloaded, deleted and run as a batch.
ID = "$response.body#/id"
OBJECT_LINKS = [
    (
        {"create_job": ("200", "202"), "retrieve_job": ("200",), "cancel_job": ("200",)},
        {
            "RetrieveJob": ("retrieve_job", {"parameters": {"job_id": ID}}),
            "CancelJob": ("cancel_job", {"parameters": {"job_id": ID}}),
            "RetrieveJobResults": ("retrieve_job_results", {"parameters": {"job_id": ID}}),
            "DeleteJob": ("delete_job", {"parameters": {"job_id": ID}}),
        },
    ),
    (
        {"create_file": ("200",), "retrieve_file": ("200",)},
        {
            "RetrieveFile": ("retrieve_file", {"parameters": {"file_id": ID}}),
            "DownloadFile": ("download_file", {"parameters": {"file_id": ID}}),
            "DeleteFile": ("delete_file", {"parameters": {"file_id": ID}}),
            "CreateBatch": ("create_batch", {"requestBody": {"input_file_id": ID}}),
        },
    ),
    (
        {"create_batch": ("200",), "retrieve_batch": ("200",), "cancel_batch": ("200",)},
        {
            "RetrieveBatch": ("retrieve_batch", {"parameters": {"batch_id": ID}}),
            "CancelBatch": ("cancel_batch", {"parameters": {"batch_id": ID}}),
        },
    ),
]


def object_links_hook(result, generator, request, public):
    """drf-spectacular postprocessing hook: the OpenAPI links of OBJECT_LINKS."""
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            operation_id = operation.get("operationId")
            for sources, targets in OBJECT_LINKS:
                for status in sources.get(operation_id, ()):
                    response = operation["responses"].get(status)
                    if response is None:
                        continue
                    response["links"] = {
                        name: {"operationId": target, **values}
                        for name, (target, values) in targets.items()
                        if target != operation_id
                    }
    return result
