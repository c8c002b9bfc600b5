"""The page a locked-out admin login gets (django-axes calls it): 429 with Retry-After."""

from __future__ import annotations

import math

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def admin_lockout_response(request: HttpRequest, *args: object) -> HttpResponse:
    """Axes passes the original response and the credentials (in an order that differs between its
    sync and async middleware paths); neither is needed here."""
    cool_off_s = settings.AXES_COOLOFF_TIME.total_seconds()
    context = {
        "failure_limit": settings.AXES_FAILURE_LIMIT,
        "cool_off_minutes": f"{cool_off_s / 60:g}",
        "title": "Login locked",
    }
    response = render(request, "admin/login_locked_out.html", context, status=429)
    response["Retry-After"] = str(math.ceil(cool_off_s))
    return response
