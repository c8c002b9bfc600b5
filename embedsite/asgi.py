"""ASGI entry point: channels routes HTTP to Django and WebSockets to embeddings/consumers.py.

API paths go to a lean Django handler (embeddings/api/handler.py: async-only middleware, bodies
read under limits, no thread per request, the common POST /v1/embeddings by an express lane that
skips Django's and DRF's request layers); the admin and docs to Django's own, full stack.
"""

import asyncio
import contextlib
import os

from embedsite import process_start

process_start.begin()  # resumed once the application is built, below (embedsite/process_start.py)

from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")

# Django must be set up before anything imports models.
get_asgi_application()
process_start.begin()  # Django's set-up resumed the collector; what follows is start-up too

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from embeddings import lifecycle, metrics  # noqa: E402
from embeddings.api.express import ExpressEmbeddings  # noqa: E402
from embeddings.api.handler import FullStackASGIHandler, LeanASGIHandler  # noqa: E402
from embeddings.consumers import JobProgressConsumer, UnknownRouteConsumer  # noqa: E402
from embeddings.errors.answers import ShuttingDown, json_error_response  # noqa: E402
from embeddings.observability import tracing  # noqa: E402
from embeddings.observability.middleware import RequestIdMiddleware  # noqa: E402

# Before any client is made: the gRPC and Celery instrumentations patch what makes them.
tracing.setup("web")
api_asgi_app = LeanASGIHandler(express=ExpressEmbeddings())
django_asgi_app = FullStackASGIHandler()


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

# Outermost: the server span (tracing on), then the request id every response and log line carries.
application = ProtocolTypeRouter(
    {
        "http": tracing.asgi_application(RequestIdMiddleware(http_router)),
        "websocket": tracing.asgi_application(RequestIdMiddleware(websocket_router)),
        "lifespan": metrics.lifespan,
    }
)
process_start.end()
