"""What an API request must satisfy before Django parses it: a readable query string, a body sent
as it is (no Content-Encoding), within its size limit, that arrives in time.

Django's ASGI handler reads the whole body before any view runs, with no limit and no timeout, and
DRF and Django's multipart parser then trust the Content-Length header (a chunked body, which has
none, reads as empty). `read_request_body` replaces that read for API paths (see
embeddings/api/handler.py): it counts bytes as they arrive and refuses the request (413) the moment it
crosses its limit, refuses a declared Content-Length over the limit before reading anything, and
answers 408 to a body that stalls (REQUEST_BODY_IDLE_TIMEOUT_S between two pieces) or arrives too
slowly (REQUEST_BODY_TIMEOUT_S plus one second per REQUEST_BODY_MIN_BYTES_PER_S bytes). The body
is spooled to a temporary file past FILE_UPLOAD_MAX_MEMORY_SIZE, never held whole in memory, and
its real length is what the request then reports.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.urls import Resolver404, resolve

from embeddings.errors import EmbedsiteError
from embeddings.errors.answers import (
    ApiError,
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)

# A multipart upload's envelope (boundaries, part headers, the option fields) on top of the file.
MULTIPART_ENVELOPE_BYTES = 64 * 1024
# The job submission route, whose multipart uploads may be up to JOB_MAX_UPLOAD_BYTES.
JOB_UPLOAD_ROUTE = "jobs"
# POST /v1/files, whose uploads may be up to FILES_MAX_UPLOAD_BYTES.
FILE_UPLOAD_ROUTE = "files"


class BodyRefused(EmbedsiteError):
    """The request is answered with `error` before Django sees it (nothing has been sent yet)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    # The field a refusal names (`file` for an upload), as the error's `param`.
    param: str | None
    idle_timeout_s: float
    timeout_s: float
    min_bytes_per_s: int

    def allowed_seconds(self, size: int) -> float:
        """How long a body of `size` bytes may take to arrive."""
        return self.timeout_s + size / self.min_bytes_per_s


def _header(scope: dict, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


def _upload_route(scope: dict) -> str | None:
    """The route name of a multipart POST (an upload), else None."""
    content_type = b";".join(_header(scope, b"content-type")).lower()
    if scope["method"] != "POST" or not content_type.startswith(b"multipart/form-data"):
        return None
    try:
        return resolve(scope["path"]).url_name
    except Resolver404:
        return None


def body_limits(scope: dict) -> BodyLimits:
    route = _upload_route(scope)
    if route == JOB_UPLOAD_ROUTE:
        max_bytes, param = settings.JOB_MAX_UPLOAD_BYTES + MULTIPART_ENVELOPE_BYTES, "file"
    elif route == FILE_UPLOAD_ROUTE:
        max_bytes, param = settings.FILES_MAX_UPLOAD_BYTES + MULTIPART_ENVELOPE_BYTES, "file"
    else:
        max_bytes, param = settings.MAX_REQUEST_BODY_BYTES, None
    return BodyLimits(
        max_bytes=max_bytes,
        param=param,
        idle_timeout_s=settings.REQUEST_BODY_IDLE_TIMEOUT_S,
        timeout_s=settings.REQUEST_BODY_TIMEOUT_S,
        min_bytes_per_s=settings.REQUEST_BODY_MIN_BYTES_PER_S,
    )


def body_limit(scope: dict) -> int:
    """The request's body limit in bytes (the HTTP edge refuses a larger chunk at once)."""
    return body_limits(scope).max_bytes


def _closing(error: ApiError) -> BodyRefused:
    # The rest of the body is never read: the connection cannot carry another request.
    error.headers["Connection"] = "close"
    return BodyRefused(error)


def _too_large(limits: BodyLimits) -> BodyRefused:
    what = "The upload" if limits.param == "file" else "The request body"
    return _closing(PayloadTooLarge(f"{what} is larger than {limits.max_bytes} bytes.", param=limits.param))


def _encodings(scope: dict) -> list[str]:
    """The Content-Encoding header's codings, in the order they were applied ("identity" dropped)."""
    codings = b",".join(_header(scope, b"content-encoding")).decode("latin-1").split(",")
    return [coding.strip().lower() for coding in codings if coding.strip().lower() not in ("", "identity")]


def admit(scope: dict, limits: BodyLimits) -> int | None:
    """Check what can be checked before reading the body; the declared Content-Length, if any.

    Raises BodyRefused: a query string that is not UTF-8 or a malformed Content-Length (400), a
    Content-Encoding other than identity (415), a declared length over the limit (413).
    """
    try:
        query_string = scope.get("query_string", b"")
        if isinstance(query_string, bytes):
            query_string.decode()
    except UnicodeDecodeError:
        raise BodyRefused(BadRequest("The query string is not valid UTF-8.")) from None
    encodings = _encodings(scope)
    if encodings:
        # No parser here inflates a body: gzip bytes were read as text (a 400 naming surrogates).
        # Inflating one would need its own bound on the inflated size; no client of an OpenAI-
        # compatible API compresses requests (the SDKs do not), so it is refused, unread.
        raise _closing(
            UnsupportedMediaType(
                f"Content-Encoding {', '.join(encodings)} is not supported: send the body uncompressed.",
                code="unsupported_content_encoding",
            )
        )
    declared = _header(scope, b"content-length")
    if not declared:
        return None
    if len(set(declared)) != 1 or not declared[0].isdigit():
        raise _closing(BadRequest("The Content-Length header is not a number."))
    length = int(declared[0])
    if length > limits.max_bytes:
        raise _too_large(limits)
    return length


async def read_request_body(
    receive, limits: BodyLimits, declared: int | None
) -> tempfile.SpooledTemporaryFile:
    """The body, spooled, read to its end under the limits (see the module docstring).

    Raises BodyRefused (413, 408) or RequestAborted (the client went away).
    """
    # Returned open: Django closes it once the response is sent.
    body = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")  # noqa: SIM115
    loop = asyncio.get_running_loop()
    started = loop.time()
    received = 0
    try:
        while True:
            allowed = limits.allowed_seconds(max(declared or 0, received))
            remaining = started + allowed - loop.time()
            idle = remaining > limits.idle_timeout_s
            try:
                async with asyncio.timeout(max(0.0, min(limits.idle_timeout_s, remaining))):
                    message = await receive()
            except TimeoutError:
                reason = (
                    f"no data for {limits.idle_timeout_s:g} s"
                    if idle
                    else f"it took longer than {allowed:.0f} s"
                )
                raise _closing(
                    RequestTimeout(f"The request body did not arrive in time: {reason}.")
                ) from None
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            piece = message.get("body", b"")
            received += len(piece)
            if received > limits.max_bytes:
                raise _too_large(limits)
            body.write(piece)
            if not message.get("more_body", False):
                break
    except BaseException:
        body.close()
        raise
    body.seek(0)
    return body


def body_length(body) -> int:
    position = body.tell()
    body.seek(0, 2)
    length = body.tell()
    body.seek(position)
    return length
