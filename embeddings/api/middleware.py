"""Request middleware for the API (the lean, async-only stack of embeddings/api/handler.py)."""

from __future__ import annotations

import logging
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost

from embeddings.errors.answers import BadRequest, json_error_response

ARRIVED = "embedsite.arrived"

# Where Django itself reports a refused Host, so log filters set up for it keep working.
disallowed_host_logger = logging.getLogger("django.security.DisallowedHost")


class ArrivalTimeMiddleware:
    """Stamps when a request reached Django, for the `queue` timing of /api/v1/embed."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        request.META[ARRIVED] = time.perf_counter()
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request):
        return await self.get_response(request)


class ApiSecurityMiddleware:
    """What the full stack's CommonMiddleware and SecurityMiddleware give the other paths: a Host
    outside ALLOWED_HOSTS is refused (400, in the API's error shape), and every response says
    `X-Content-Type-Options: nosniff`. Async only: no thread hop on the API path."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response):
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request):
        try:
            request.get_host()
        except DisallowedHost as error:
            disallowed_host_logger.warning("%s", error)
            response = json_error_response(
                BadRequest("The Host header names a host this server does not serve.", code="invalid_host")
            )
        else:
            response = await self.get_response(request)
        response["X-Content-Type-Options"] = "nosniff"
        return response
