"""The request id middleware: the outermost of our ASGI application, so every response has one.

Every HTTP response carries `X-Request-Id`: the client's when it sent a sane one, else a fresh one.
The id is set in the request's context (embeddings.observability.context) before anything else
runs, so it is in every log line, error body and span of the request, even of one refused at the
HTTP edge before any view (a body too large, a stalled upload). When the response is done the
middleware writes the access log line (logger `embedsite.access`), and the request's fields go to
its server span when tracing is on.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings

from embeddings.observability import context, tracing

REQUEST_ID_HEADER = b"x-request-id"
access_logger = logging.getLogger("embedsite.access")


def _sent_request_id(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return None


class RequestIdMiddleware:
    """ASGI middleware for http and websocket scopes (lifespan passes through)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        request = context.RequestContext(request_id=context.request_id_from(_sent_request_id(scope)))
        header = (REQUEST_ID_HEADER, request.request_id.encode("ascii"))
        server_span = tracing.current_span()
        status: list[int] = []

        async def send_with_request_id(message):
            kind = message["type"]
            if kind in ("http.response.start", "websocket.accept"):
                if kind == "http.response.start":
                    status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), header]}
            elif kind == "http.response.body" and not message.get("more_body", False):
                # The server span ends with the last body message: annotated before it.
                _annotate(server_span, request, scope.get("method", ""))
            await send(message)

        token = context.begin(request)
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_request_id)
        finally:
            if settings.LOG_ACCESS:
                _log_access(scope, request, status[0] if status else None, time.perf_counter() - started)
            context.end(token)


def _annotate(span, request: context.RequestContext, method: str) -> None:
    if span is None:
        return
    if request.route and span.is_recording():
        # Named by route, not path: one name for every job's `GET /v1/jobs/<str:job_id>`.
        span.update_name(f"{method} {request.route}")
        span.set_attribute("http.route", request.route)
    tracing.annotate(
        span,
        **{
            "embedsite.request_id": request.request_id,
            "embedsite.tenant": request.tenant,
            "embedsite.key_id": request.key_id,
            "embedsite.endpoint": request.endpoint,
            "embedsite.model": request.model,
            "embedsite.inputs": request.inputs,
            "embedsite.tokens": request.tokens,
            "embedsite.job": request.job,
        },
    )


# Paths are logged as sent (percent-encoded: no line break reaches a text log), cut at this length.
MAX_LOGGED_PATH = 1024


def _log_access(scope, request: context.RequestContext, status: int | None, elapsed_s: float) -> None:
    method = scope.get("method", "WEBSOCKET")
    raw_path = scope.get("raw_path")
    path = raw_path.decode("latin-1") if raw_path else scope["path"].encode("unicode_escape").decode()
    path = path[:MAX_LOGGED_PATH]
    duration_ms = round(elapsed_s * 1000, 3)
    fields = request.log_fields()
    summary = " ".join(f"{name}={value}" for name, value in fields.items())
    access_logger.info(
        "%s %s %s %.1f ms%s",
        method,
        path,
        status if status is not None else "-",
        duration_ms,
        f" {summary}" if summary else "",
        extra={"method": method, "path": path, "status": status, "duration_ms": duration_ms},
    )
