"""The base of every API view: adrf's async APIView with an all-async request path.

adrf runs DRF's `initial()` (authentication, permissions, throttles) through `sync_to_async`, a hop
to one shared thread per request, and calls async authenticators through `async_to_sync` from
there. Our authenticators are coroutines, so this base awaits them directly on the event loop and
renders every failure through `embeddings.errors.answers`. Responses are rendered here too, on the
loop (orjson takes microseconds): Django renders a template response, which DRF's Response is,
through a thread hop.
"""

from __future__ import annotations

import inspect
import time
from typing import ClassVar

from adrf.views import APIView
from django.http import HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import ApiKeyAuthentication
from embeddings.api.middleware import ARRIVED
from embeddings.api.rendering import OrjsonParser, OrjsonRenderer
from embeddings.callers import Caller
from embeddings.errors.answers import ApiError, as_api_error
from embeddings.metrics import request_observed
from embeddings.models import EmbeddingModel
from embeddings.observability import context as request_context
from embeddings.observability import tracing
from embeddings.services.inference.catalog import embedding_model_variant
from embeddings.services.quotas.limits import RequestQuota, answer_ratelimit_headers


def rendered(response: HttpResponseBase) -> HttpResponseBase:
    """A DRF Response rendered now, as a plain HttpResponse with the same status and headers."""
    if not isinstance(response, SimpleTemplateResponse):
        return response  # streamed downloads, Django's own responses
    response.render()
    plain = HttpResponse(response.content, status=response.status_code)
    plain.headers = response.headers
    plain.cookies = response.cookies
    return plain


def list_page(data: list[dict], has_more: bool) -> dict:
    """A page of a list as OpenAI answers one (jobs, files, batches)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def error_response(error: ApiError) -> Response:
    return Response(error.body(), status=error.status, headers=error.headers)


def model_request_quota(
    *, caller: Caller, model: EmbeddingModel, endpoint: str, started: float
) -> RequestQuota:
    """One request's quota and usage bookkeeping for `model`: its usage records the variant serving
    it (remembered by the catalog: no file is read per request)."""
    variant = embedding_model_variant(model=model)
    return RequestQuota(
        caller=caller,
        model=model.name,
        model_version=variant.version,
        model_dtype=variant.dtype,
        endpoint=endpoint,
        started=started,
    )


class ApiView(APIView):
    authentication_classes = [ApiKeyAuthentication]
    permission_classes: list = []
    throttle_classes: list = []
    renderer_classes = [OrjsonRenderer]
    parser_classes = [OrjsonParser]
    # The `endpoint` label of this view's metrics.
    endpoint: ClassVar[str] = "other"
    # The catalog model the request resolved to (set by the view), for the `model` label.
    model_name: str = ""
    # Set once the request is authenticated: its x-ratelimit-* headers are then always sent.
    caller: Caller | None = None
    # The quota bookkeeping of a request that embeds (see request_quota).
    quota: RequestQuota | None = None

    async def async_dispatch(self, request, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            method = request.method.lower()
            handler = getattr(self, method, None)
            if method not in self.http_method_names or handler is None:
                handler = self.http_method_not_allowed
            # OPTIONS says which methods a route takes, as a CORS preflight (which carries no
            # credentials) needs: no key.
            if method != "options":
                await self.authenticate(request)
            response = handler(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except Exception as exc:  # every failure becomes an API error response, never a 500 page
            response = self.handle_exception(exc)
        if self.caller is not None:
            await self.add_ratelimit_headers(response)
        match = request._request.resolver_match
        request_context.annotate(
            endpoint=self.endpoint, model=self.model_name, route=f"/{match.route}" if match else ""
        )
        with tracing.span("serialize", endpoint=self.endpoint):
            self.response = rendered(self.finalize_response(request, response, *args, **kwargs))
        arrived = request._request.META.get(ARRIVED)
        request_observed(
            endpoint=self.endpoint,
            model=self.model_name,
            status=self.response.status_code,
            seconds=None if arrived is None else time.perf_counter() - arrived,
        )
        return self.response

    async def options(self, request: Request, *args, **kwargs) -> Response:
        """204 with the route's methods in `Allow` (set on every response by finalize_response)."""
        return Response(status=204)

    async def authenticate(self, request: Request) -> None:
        with tracing.span("authenticate"):
            for authenticator in request.authenticators:
                result = await authenticator.authenticate(request)
                if result is not None:
                    request._authenticator = authenticator
                    request.user, request.auth = result
                    self.caller = result[0]
                    request_context.annotate(tenant=self.caller.tenant_slug, key_id=self.caller.key_public_id)
                    return
            request._not_authenticated()

    def request_quota(self, model: EmbeddingModel) -> RequestQuota:
        """The quota and usage bookkeeping for this request's embedding call (embeddings_create)."""
        arrived = self.request._request.META.get(ARRIVED, time.perf_counter())
        self.quota = model_request_quota(
            caller=self.caller, model=model, endpoint=self.endpoint, started=arrived
        )
        return self.quota

    async def add_ratelimit_headers(self, response: Response) -> None:
        for name, value in (await answer_ratelimit_headers(self.caller, self.quota)).items():
            response[name] = value

    def handle_exception(self, exc: Exception) -> Response:
        return error_response(as_api_error(exc))
