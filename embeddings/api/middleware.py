"""Request middleware for the API."""

from __future__ import annotations

import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

ARRIVED = "embedsite.arrived"


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
