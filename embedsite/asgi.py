"""ASGI entry point: channels routes HTTP to Django and WebSockets to embeddings/consumers.py.

API paths go to a Django handler with a lean middleware stack. Django runs each sync
`MiddlewareMixin` (sessions, auth, CSRF, messages, ...) through `sync_to_async`, two thread hops
per middleware and request: measured here at ~3 ms a request, more than the whole embedding path
costs. The API authenticates with API keys and needs none of them; the admin and docs keep the
full stack. The lean handler also reads the body itself, under size limits and timeouts
(embeddings/api/intake.py), where Django would read any body for as long as it takes.
"""

import asyncio
import contextlib
import os
from contextvars import ContextVar

from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")

# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from embeddings import lifecycle, metrics  # noqa: E402
from embeddings.api import intake  # noqa: E402
from embeddings.api.errors import ShuttingDown, json_error_response  # noqa: E402
from embeddings.consumers import JobProgressConsumer, UnknownRouteConsumer  # noqa: E402

# The limits and declared length of the request being handled, for read_body (which Django calls
# with `receive` alone).
_body_admission: ContextVar[tuple[intake.BodyLimits, int | None]] = ContextVar("body_admission")


class LeanASGIHandler(ASGIHandler):
    """Django's ASGI handler with settings.API_MIDDLEWARE instead of settings.MIDDLEWARE, and
    the request body read under limits and timeouts."""

    def load_middleware(self, is_async: bool = False) -> None:
        # Django builds the chain from settings.MIDDLEWARE; swap it only while this handler is
        # built (once, at import, before any request is served).
        full_stack = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full_stack

    async def handle(self, scope, receive, send):
        limits = intake.body_limits(scope)
        try:
            declared = intake.admit(scope, limits)
            token = _body_admission.set((limits, declared))
            try:
                await super().handle(scope, receive, send)
            finally:
                _body_admission.reset(token)
        except intake.BodyRefused as refusal:
            # Raised by admit() or read_body(), before Django has sent anything.
            response = json_error_response(refusal.error)
            response["X-Content-Type-Options"] = "nosniff"
            await self.send_response(response, send)

    async def read_body(self, receive):
        limits, declared = _body_admission.get()
        return await intake.read_request_body(receive, limits, declared)

    def create_request(self, scope, body_file):
        request, error_response = super().create_request(scope, body_file)
        if request is not None:
            # What was read, however it was framed: DRF and the multipart parser read this many
            # bytes (a chunked body has no Content-Length and would read as empty).
            request.META["CONTENT_LENGTH"] = str(intake.body_length(body_file))
        return request, error_response


api_asgi_app = LeanASGIHandler()


async def http_router(scope, receive, send):
    app = api_asgi_app if scope["path"].startswith(settings.API_PATH_PREFIXES) else django_asgi_app
    if lifecycle.shutting_down():
        send = lifecycle.connection_closing(send)
    try:
        await app(scope, receive, send)
    except asyncio.CancelledError:
        # uvicorn cancels what still runs SHUTDOWN_TIMEOUT_S after SIGTERM (embedsite/server.py): say
        # so, retryably, rather than its bare 500. Once the response has begun (send refuses a second
        # start), the connection just ends.
        if not lifecycle.shutting_down():
            raise
        response = json_error_response(ShuttingDown())
        response["X-Content-Type-Options"] = "nosniff"
        with contextlib.suppress(RuntimeError):
            await api_asgi_app.send_response(response, send)
            return
        raise


# No origin check: WebSockets authenticate with an API key the client sends, never a cookie, so a
# foreign page gains nothing by opening one.
websocket_router = URLRouter(
    [
        path("ws/v1/jobs/<str:job_id>", JobProgressConsumer.as_asgi()),
        re_path(r"", UnknownRouteConsumer.as_asgi()),
    ]
)

application = ProtocolTypeRouter(
    {"http": http_router, "websocket": websocket_router, "lifespan": metrics.lifespan}
)
