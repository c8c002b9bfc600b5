"""The Django handlers: `LeanASGIHandler` for API requests and `FullStackASGIHandler` for the rest
(admin, docs), both reading bodies under limits (embedsite/asgi.py routes between them).

LeanASGIHandler is Django's ASGIHandler with three differences, each measured on a one-text
embedding request.

- A lean middleware stack (settings.API_MIDDLEWARE). Django runs each sync `MiddlewareMixin`
  (sessions, auth, CSRF, messages, ...) through `sync_to_async`, two thread hops per middleware
  and request: ~3 ms a request, more than the whole embedding path. The API authenticates with
  API keys and needs none of them; the admin and docs keep the full stack.
- The body is read under size limits and timeouts (embeddings/api/intake.py), where Django would
  read any body for as long as it takes.
- No thread per request. Django gives each request a thread of its own for its thread-sensitive
  sync work (ORM calls), started on first use and joined at the end, and sends the request
  signals from it, so every request paid a thread start and join and two thread hops (~1 ms CPU,
  a third of the request), although API requests rarely run sync code at all (a key lookup on a
  cache miss, job endpoints). Here each request borrows a `RequestThread` from a pool, and the
  request signals go to it only if the request used it: request_started just before its first
  sync call, request_finished at the end. Their receivers (Django's close_old_connections,
  reset_queries, close_caches, reset_urlconf) tidy what that thread's sync code opened; a
  request that ran none has nothing there to tidy, and request_finished runs on the loop.

And an express lane (embeddings/api/express.py, given by embedsite/asgi.py): the common POST
/v1/embeddings is answered without Django's request, URL resolver and middleware and DRF's request
and response, as its view would answer it; everything else goes the way above.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpResponseBase
from django.urls import set_script_prefix
from django.utils.log import log_response

from embeddings.api import intake
from embeddings.errors.answers import json_error_response

# Threads kept between API requests: about the requests one process has in flight at once.
IDLE_REQUEST_THREADS = 64


async def read_body_or_refuse(handler: ASGIHandler, scope, receive, send):
    """The request's body read under its limits (embeddings/api/intake.py); None once the refusal
    (413, 408, 400) is sent or the client has gone."""
    limits = intake.body_limits(scope)
    try:
        declared = intake.admit(scope, limits)
        return await intake.read_request_body(receive, limits, declared)
    except intake.BodyRefused as refusal:
        response = json_error_response(refusal.error)
        response["X-Content-Type-Options"] = "nosniff"
        await handler.send_response(response, send)
    except RequestAborted:
        pass
    return None


# The body FullStackASGIHandler.handle has read, for Django's own handle() (same task, so the same
# context) to take instead of reading it again.
_body_read = contextvars.ContextVar("body_read")


class FullStackASGIHandler(ASGIHandler):
    """Django's own handler (the full middleware stack: admin, docs), whose body read has the API's
    limits and timeouts: Django's would wait forever for a body that never comes."""

    async def handle(self, scope, receive, send):
        body_file = await read_body_or_refuse(self, scope, receive, send)
        if body_file is None:
            return
        token = _body_read.set(body_file)
        try:
            await super().handle(scope, receive, send)
        finally:
            _body_read.reset(token)

    async def read_body(self, receive):
        return _body_read.get()


class RequestThread(ThreadPoolExecutor):
    """One request's thread-sensitive thread. Sends Django's request_started there before the
    request's first sync call, and remembers that the request used it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="api-request")
        self.scope: dict | None = None
        self.used = False

    def begin(self, scope: dict) -> None:
        self.scope, self.used = scope, False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        # Called from the event loop only (asgiref's sync_to_async), so `used` needs no lock.
        if not self.used:
            self.used = True
            return super().submit(_request_started_then, self.scope, fn, *args, **kwargs)
        return super().submit(fn, *args, **kwargs)


def _request_started_then(scope, fn, /, *args, **kwargs):
    signals.request_started.send(sender=LeanASGIHandler, scope=scope)
    return fn(*args, **kwargs)


class RequestThreads:
    """RequestThreads lent to requests, one each, for as long as the request runs.

    Used from the event loop only (no lock). The number of threads follows the requests in flight,
    as with Django's thread per request; at most `keep_idle` wait between requests.
    """

    def __init__(self, keep_idle: int) -> None:
        self.keep_idle = keep_idle
        self.idle: list[RequestThread] = []

    def lend(self, scope: dict) -> RequestThread:
        thread = self.idle.pop() if self.idle else RequestThread()
        thread.begin(scope)
        return thread

    def give_back(self, thread: RequestThread) -> None:
        if len(self.idle) < self.keep_idle:
            self.idle.append(thread)
        else:
            thread.shutdown(wait=False)


class ExpressLane(Protocol):
    """Requests answered without Django's request, URL resolver and middleware (embeddings/api/
    express.py): `take` says whether it answers this one (None: Django and the view do), before
    anything is done; `answer` makes the response."""

    def take(self, scope: dict, body_file) -> object | None: ...

    async def answer(self, taken: object, arrived: float) -> HttpResponseBase: ...


class LeanASGIHandler(ASGIHandler):
    def __init__(self, express: ExpressLane | None = None) -> None:
        super().__init__()
        self.request_threads = RequestThreads(keep_idle=IDLE_REQUEST_THREADS)
        self.express = express

    def load_middleware(self, is_async: bool = False) -> None:
        # Django builds the chain from settings.MIDDLEWARE; swap it only while this handler is
        # built (once, at import, before any request is served).
        full_stack = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full_stack

    async def __call__(self, scope, receive, send):
        thread = self.request_threads.lend(scope)
        try:
            # handle() finishes every task it starts before it returns, as a context with a given
            # executor requires.
            async with ThreadSensitiveContext(executor=thread):
                await self.handle(scope, receive, send, thread)
        except BaseException:
            # Cancelled (shutdown) or failed, maybe during a sync call still running there: the
            # next request must not queue behind it.
            thread.shutdown(wait=False)
            raise
        self.request_threads.give_back(thread)

    async def handle(self, scope, receive, send, thread: RequestThread):
        body_file = await read_body_or_refuse(self, scope, receive, send)
        if body_file is None:
            return
        try:
            set_script_prefix(get_script_prefix(scope))
            taken = self.express.take(scope, body_file) if self.express is not None else None
            if taken is not None:
                response = await self.respond_unless_aborted(
                    functools.partial(self.express_response, scope, body_file, taken), receive, send
                )
            else:
                request, response = self.create_request(scope, body_file)
                if request is None:
                    await self.send_response(response, send)
                else:
                    response = await self.respond_unless_aborted(
                        functools.partial(self.run_get_response, request), receive, send
                    )
            if response is None:
                finish = functools.partial(signals.request_finished.send, sender=self.__class__)
            else:
                finish = response.close  # sends request_finished
            if thread.used:
                await sync_to_async(finish)()  # in the request's thread, after its sync work
            else:
                finish()
        finally:
            body_file.close()

    async def express_response(self, scope, body_file, taken: object) -> HttpResponseBase:
        """The express lane's answer, logged as Django's handler logs a view's 4xx and 5xx (with the
        request Django would have made: refusals are the rare case)."""
        response = await self.express.answer(taken, time.perf_counter())
        if response.status_code >= 400:
            request, _ = self.create_request(scope, body_file)
            log_response("%s: %s", response.reason_phrase, scope["path"], response=response, request=request)
        return response

    async def respond_unless_aborted(
        self, produce: Callable[[], Awaitable[HttpResponseBase]], receive, send
    ) -> HttpResponseBase | None:
        """The response `produce` makes (the view's), sent; None if the client went away first (its
        making is cancelled)."""

        async def respond() -> HttpResponseBase:
            response = await produce()
            # The client may go away while it is sent: the response is closed all the same.
            with contextlib.suppress(asyncio.CancelledError):
                await self.send_response(response, send)
            return response

        listening = asyncio.create_task(self.listen_for_disconnect(receive))
        responding = asyncio.create_task(respond())
        await asyncio.wait((listening, responding), return_when=asyncio.FIRST_COMPLETED)
        for task in (listening, responding):
            task.cancel()  # the one still running: the view when the client left, or the listener
        outcomes = await asyncio.gather(listening, responding, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError | RequestAborted
            ):
                raise outcome
        return None if responding.cancelled() else responding.result()

    def create_request(self, scope, body_file):
        request, error_response = super().create_request(scope, body_file)
        if request is not None:
            # What was read, however it was framed: DRF and the multipart parser read this many
            # bytes (a chunked body has no Content-Length and would read as empty).
            request.META["CONTENT_LENGTH"] = str(intake.body_length(body_file))
        return request, error_response
