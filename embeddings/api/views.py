"""HTTP views. Thin: parse, call one service, render."""

from django.http import HttpRequest, HttpResponse


async def health(request: HttpRequest) -> HttpResponse:
    """Liveness: the process answers. Readiness (Triton, database) is a separate check."""
    return HttpResponse("ok", content_type="text/plain")
