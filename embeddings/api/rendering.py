"""JSON in and out with orjson: numpy arrays are serialised directly, with no per-float Python loop."""

from __future__ import annotations

import time

import orjson
from django.conf import settings
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer

from embeddings.api.errors import BadRequest, PayloadTooLarge
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


class OrjsonParser(BaseParser):
    """application/json bodies, refused past MAX_REQUEST_BODY_BYTES even without a Content-Length."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
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
