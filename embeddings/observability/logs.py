"""Log lines that name their request: the filter that adds the request's fields, and the formats.

LOG_FORMAT=json writes one JSON object a line (python-json-logger): timestamp, level, logger,
message, the request id, the tenant's slug and the key's public id once known, the trace and span
ids when tracing is on, and whatever the line passed in `extra` (the access log: method, path,
status, duration_ms, endpoint, model, inputs, tokens). LOG_FORMAT=text (the default) writes one
readable line with the request id in brackets. Both take every credential out of the finished line
(embeddings/observability/redaction.py).
"""

from __future__ import annotations

import io
import logging

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from embeddings.observability import context, tracing
from embeddings.observability.redaction import redact_credentials

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# Never a key, a secret or an input text: these are the only request fields a line gets.
JSON_RENAMED = {"levelname": "level", "name": "logger"}


class RequestContextFilter(logging.Filter):
    """Adds the current request's (or task's) fields and the trace ids to every record that passes
    the handler it is on; a field the line sets itself (`extra`) wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = context.current()
        if current is not None:
            if not hasattr(record, "request_id"):
                record.request_id = current.request_id
            for name, value in current.log_fields().items():
                if not hasattr(record, name):
                    setattr(record, name, value)
        ids = tracing.log_ids()
        if ids is not None:
            record.trace_id, record.span_id = ids
        return True


class Redacted:
    """Formats a record as the formatter it is mixed into does, then redacts the finished line: the
    message, every extra field (Django's 4xx lines attach the request, query string and all) and the
    traceback, whoever logged it."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_credentials(super().format(record))


class TextFormatter(Redacted, logging.Formatter):
    pass


class JsonLinesFormatter(Redacted, JsonFormatter):
    pass


def text_formatter() -> logging.Formatter:
    return TextFormatter(TEXT_FORMAT, defaults={"request_id": "-"})


def json_formatter() -> logging.Formatter:
    # Python's warnings (Celery's as root, deprecations) become log lines too: none escapes JSON.
    logging.captureWarnings(True)
    return JsonLinesFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields=JSON_RENAMED,
        # uvicorn's lines carry their message again with terminal colours: left out.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
        timestamp=True,
    )


class LogLines(io.TextIOBase):
    """A text stream whose every line becomes an INFO record of `logger`: what a command prints for
    people (runstack's announcements) joins the JSON log stream instead of breaking it."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.pending = ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line.strip():
                self.logger.info(line.strip())
        return len(text)

    def flush(self) -> None:
        if self.pending.strip():
            self.logger.info(self.pending.strip())
        self.pending = ""
