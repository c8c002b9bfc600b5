"""ASGI entry point: channels routes HTTP to Django and WebSockets to embeddings/consumers.py.

API paths go to a Django handler with a lean middleware stack. Django runs each sync
`MiddlewareMixin` (sessions, auth, CSRF, messages, ...) through `sync_to_async`, two thread hops
per middleware and request: measured here at ~3 ms a request, more than the whole embedding path
costs. The API authenticates with API keys and needs none of them; the admin and docs keep the
full stack.
"""

import os

from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")

# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from embeddings import metrics  # noqa: E402
from embeddings.consumers import JobProgressConsumer, UnknownRouteConsumer  # noqa: E402


class LeanASGIHandler(ASGIHandler):
    """Django's ASGI handler with settings.API_MIDDLEWARE instead of settings.MIDDLEWARE."""

    def load_middleware(self, is_async: bool = False) -> None:
        # Django builds the chain from settings.MIDDLEWARE; swap it only while this handler is
        # built (once, at import, before any request is served).
        full_stack = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full_stack


api_asgi_app = LeanASGIHandler()


async def http_router(scope, receive, send):
    app = api_asgi_app if scope["path"].startswith(settings.API_PATH_PREFIXES) else django_asgi_app
    await app(scope, receive, send)


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
