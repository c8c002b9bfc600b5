"""JSON in and out with orjson (numpy arrays are serialised directly, with no per-float Python loop),
the request parsers, which take UTF-8 only, and streamed downloads (`in_threads`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils.http import parse_header_parameters
from rest_framework.parsers import BaseParser, MultiPartParser
from rest_framework.renderers import BaseRenderer

from embeddings.errors.answers import BadRequest, PayloadTooLarge, UnsupportedMediaType
from embeddings.metrics import SERIALIZATION_SECONDS

ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def dumps(data: object) -> bytes:
    return orjson.dumps(data, option=ORJSON_OPTIONS)


class OrjsonRenderer(BaseRenderer):
    media_type = "application/json"
    format = "json"
    charset = None  # JSON is UTF-8 by definition; no charset parameter

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        if data is None:
            return b""
        started = time.perf_counter()
        body = dumps(data)
        view = (renderer_context or {}).get("view")
        SERIALIZATION_SECONDS.labels(getattr(view, "endpoint", "other")).observe(
            time.perf_counter() - started
        )
        return body


# US-ASCII is a subset of UTF-8.
UTF8_CHARSETS = {"utf-8", "utf8", "us-ascii", "ascii"}


def refuse_non_utf8(charset: str | bytes | None, *, what: str, param: str | None = None) -> None:
    """415 for a declared charset other than UTF-8: JSON is UTF-8 (RFC 8259), and so are uploads.

    Decoding latin-1 or UTF-16 text as UTF-8 would embed something else than the client sent.
    """
    if isinstance(charset, bytes):  # a multipart part's header parameter, as Django's parser leaves it
        charset = charset.decode("latin-1")
    if charset is not None and charset.strip().strip('"').lower() not in UTF8_CHARSETS:
        raise UnsupportedMediaType(
            f"{what} must be UTF-8; charset {charset!r} is not supported.", param=param
        )


def media_type_charset(media_type: str | None) -> str | None:
    return parse_header_parameters(media_type or "")[1].get("charset")


class OrjsonParser(BaseParser):
    """application/json bodies, UTF-8, at most MAX_REQUEST_BODY_BYTES (also checked as it arrives)."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        refuse_non_utf8(media_type_charset(media_type), what="A JSON body")
        if stream is None:
            raise BadRequest("The request body is empty; send a JSON object.")
        limit = settings.MAX_REQUEST_BODY_BYTES
        body = stream.read(limit + 1)
        if len(body) > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise BadRequest(f"The request body is not valid JSON: {error}") from None


class MultipartUploadParser(MultiPartParser):
    """Django's multipart parser, for UTF-8 forms only (the form's charset decodes its fields)."""

    def parse(self, stream, media_type=None, parser_context=None):
        refuse_non_utf8(media_type_charset(media_type), what="A multipart form")
        return super().parse(stream, media_type, parser_context)


async def in_threads(chunks: Callable[[], Iterator[bytes]]) -> AsyncIterator[bytes]:
    """A sync generator's pieces, each produced in a worker thread (its Redis read blocks)."""
    iterator = await sync_to_async(chunks, thread_sensitive=False)()
    done = object()
    while True:
        piece = await sync_to_async(next, thread_sensitive=False)(iterator, done)
        if piece is done:
            return
        yield piece
