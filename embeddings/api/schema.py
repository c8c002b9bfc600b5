"""OpenAPI extensions for drf-spectacular: how our API key authentication appears in the schema,
and the rate-limit headers of authenticated responses."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object


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
    "x-ratelimit-limit-requests": "The binding requests-per-minute limit (tenant's or key's)",
    "x-ratelimit-remaining-requests": "Requests left in that window",
    "x-ratelimit-reset-requests": 'Until that window resets, e.g. "1s", "6m0s"',
    "x-ratelimit-limit-tokens": "The binding token limit (per minute, day or month; tenant's or key's)",
    "x-ratelimit-remaining-tokens": "Tokens left in that window",
    "x-ratelimit-reset-tokens": 'Until that window resets, e.g. "20ms", "6m0s"',
}
RETRY_AFTER = {"Retry-After": "Seconds to wait before retrying"}


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
                    headers["Retry-After"] = _header(RETRY_AFTER["Retry-After"], "integer")
    return result
