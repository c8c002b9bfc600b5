"""OpenAPI extensions for drf-spectacular: how our API key authentication appears in the schema."""

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
