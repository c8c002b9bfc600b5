"""The express lane of POST /v1/embeddings: the common request answered without Django's request,
URL resolver and middleware or DRF's request, serializer copies and response, byte for byte as
OpenAIEmbeddingsView answers it.

On a one-text request those layers cost about as much web CPU as tokenising, reserving the quota
and calling Triton together (bench/notes/). The lane takes a request only when nothing in it needs
them: a JSON body that OpenAIEmbeddingsRequest accepts as it is, a Host in ALLOWED_HOSTS, one
Authorization header. Anything else (a body the view refuses, a form, another media type, a
header sent twice) is declined before anything is done, and LeanASGIHandler serves it through the
view, which then also writes the refusal. Once taken, the request runs what the view runs
(`openai_embeddings`, the same authentication, the same error answers), and its response has the
view's status, headers in the same order, body, metrics and log lines: tests/api/test_express.py
sends requests both ways and compares what comes back. EXPRESS_EMBEDDINGS=false sends every
request through the view.
"""

from __future__ import annotations

import time

import orjson
from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from rest_framework.exceptions import ValidationError

from embeddings.api.authentication import caller_for_authorization
from embeddings.api.base import model_request_quota
from embeddings.api.rendering import OrjsonRenderer
from embeddings.api.served import timing_header
from embeddings.api.views import OpenAIEmbeddingsView, openai_embeddings
from embeddings.callers import Caller
from embeddings.contracts.embeddings_request import OpenAIEmbeddingsRequest
from embeddings.contracts.fields import validated
from embeddings.errors.answers import ValidationFailed, as_api_error
from embeddings.metrics import request_observed
from embeddings.models import EmbeddingModel
from embeddings.observability import context as request_context
from embeddings.observability import tracing
from embeddings.services.quotas.limits import RequestQuota, answer_ratelimit_headers

ROUTE = "/v1/embeddings"
# The view's renderer (its only one), which also times the rendering.
RENDERER = OrjsonRenderer()
# The view's `Allow` (DRF sets it on every response of the view).
ALLOW = ", ".join(OpenAIEmbeddingsView().allowed_methods)
# The JSON media types DRF's parser takes as they are (any other: the view decides).
JSON_CONTENT_TYPES = {
    b"application/json",
    b"application/json; charset=utf-8",
    b"application/json;charset=utf-8",
}
# Host header values found in ALLOWED_HOSTS, with the ALLOWED_HOSTS that allowed them (a setting
# changed since, as tests do, asks again); bounded: a client can send many.
_hosts_allowed: dict[bytes, object] = {}
HOSTS_REMEMBERED = 64


def _host_allowed(host: bytes) -> bool:
    """Whether Django's request.get_host() would take this Host, as ApiSecurityMiddleware asks it."""
    allowed_hosts = settings.ALLOWED_HOSTS
    if _hosts_allowed.get(host) is allowed_hosts:
        return True
    if settings.DEBUG and not allowed_hosts:
        allowed_hosts = [".localhost", "127.0.0.1", "[::1]"]
    domain, _ = split_domain_port(host.decode("latin-1"))
    if not (domain and validate_host(domain, allowed_hosts)):
        return False
    if len(_hosts_allowed) < HOSTS_REMEMBERED:
        _hosts_allowed[host] = settings.ALLOWED_HOSTS
    return True


def express_request(scope: dict, body: bytes) -> tuple[str, dict] | None:
    """(the Authorization header, the body's validated fields) of a request the lane can take as
    the view would; None to decline it (the view then answers, refusals included)."""
    if not body:
        return None
    host = content_type = authorization = None
    for name, value in scope["headers"]:
        if name == b"host":
            if host is not None:
                return None
            host = value
        elif name == b"content-type":
            if content_type is not None:
                return None
            content_type = value
        elif name == b"authorization":
            if authorization is not None:
                return None
            authorization = value
        elif name == b"x-forwarded-host" and settings.USE_X_FORWARDED_HOST:
            return None
    if host is None or content_type is None or authorization is None:
        return None
    if content_type.lower() not in JSON_CONTENT_TYPES or not _host_allowed(host):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    try:
        params = validated(OpenAIEmbeddingsRequest, data)
    except (ValidationError, DjangoValidationError, ValidationFailed):
        return None
    return authorization.decode("latin-1"), params


class ExpressCall:
    """One request on the lane: what openai_embeddings and model_for_request need of a view."""

    endpoint = OpenAIEmbeddingsView.endpoint

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.caller: Caller | None = None
        self.model_name = ""
        self.quota: RequestQuota | None = None

    def request_quota(self, model: EmbeddingModel) -> RequestQuota:
        self.quota = model_request_quota(
            caller=self.caller, model=model, endpoint=self.endpoint, started=self.arrived
        )
        return self.quota


async def express_answer(authorization: str, params: dict, arrived: float) -> HttpResponse:
    """The view's response to a request express_request took."""
    call = ExpressCall(arrived)
    try:
        with tracing.span("authenticate"):
            call.caller = await caller_for_authorization(authorization)
            request_context.annotate(tenant=call.caller.tenant_slug, key_id=call.caller.key_public_id)
        body, result = await openai_embeddings(call, params)
        status, headers = 200, {"Server-Timing": timing_header(result)}
    except Exception as exc:  # as ApiView.handle_exception: every failure is an API error answer
        error = as_api_error(exc)
        body, status, headers = error.body(), error.status, error.headers or {}
    ratelimit = {} if call.caller is None else await answer_ratelimit_headers(call.caller, call.quota)
    request_context.annotate(endpoint=call.endpoint, model=call.model_name, route=ROUTE)
    with tracing.span("serialize", endpoint=call.endpoint):
        content = RENDERER.render(body, renderer_context={"view": call})
        response = HttpResponse(content, status=status, content_type=RENDERER.media_type)
        # In the view's order: the answer's own headers, the rate limits, Allow, nosniff (Django's
        # headers are case-insensitive: a name set again keeps its place).
        for name, value in (*headers.items(), *ratelimit.items()):
            response[name] = value
        response["Allow"] = ALLOW
        response["X-Content-Type-Options"] = "nosniff"
    request_observed(
        endpoint=call.endpoint, model=call.model_name, status=status, seconds=time.perf_counter() - arrived
    )
    return response


class ExpressEmbeddings:
    """The lane as LeanASGIHandler takes it (embedsite/asgi.py)."""

    def take(self, scope: dict, body_file) -> tuple[str, dict] | None:
        if not (settings.EXPRESS_EMBEDDINGS and scope["method"] == "POST" and scope["path"] == ROUTE):
            return None
        body = body_file.read()
        body_file.seek(0)
        return express_request(scope, body)

    async def answer(self, taken: tuple[str, dict], arrived: float) -> HttpResponse:
        return await express_answer(*taken, arrived)
