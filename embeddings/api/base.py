"""The base of every API view: adrf's async APIView with an all-async request path.

adrf runs DRF's `initial()` (authentication, permissions, throttles) through `sync_to_async`, a hop
to one shared thread per request, and calls async authenticators through `async_to_sync` from
there. Our authenticators are coroutines, so this base awaits them directly on the event loop and
renders every failure through `embeddings.api.errors`.
"""

from __future__ import annotations

from typing import ClassVar

from adrf.views import APIView
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import ApiKeyAuthentication
from embeddings.api.errors import ApiError, as_api_error
from embeddings.api.rendering import OrjsonParser, OrjsonRenderer
from embeddings.metrics import request_observed


def error_response(error: ApiError) -> Response:
    return Response(error.body(), status=error.status, headers=error.headers)


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

    async def async_dispatch(self, request, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            await self.authenticate(request)
            handler = getattr(self, request.method.lower(), None)
            if request.method.lower() not in self.http_method_names or handler is None:
                handler = self.http_method_not_allowed
                response = handler(request, *args, **kwargs)
            else:
                response = await handler(request, *args, **kwargs)
        except Exception as exc:  # every failure becomes an API error response, never a 500 page
            response = self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        request_observed(endpoint=self.endpoint, model=self.model_name, status=self.response.status_code)
        return self.response

    async def authenticate(self, request: Request) -> None:
        for authenticator in request.authenticators:
            result = await authenticator.authenticate(request)
            if result is not None:
                request._authenticator = authenticator
                request.user, request.auth = result
                return
        request._not_authenticated()

    def handle_exception(self, exc: Exception) -> Response:
        return error_response(as_api_error(exc))
