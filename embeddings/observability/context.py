"""The request (or Celery task) being served: its id and what log lines and error bodies say of it.

One `RequestContext` per HTTP request, set by `RequestIdMiddleware` in a context variable before
anything else runs, so every log line written while serving it (in the view's task, its threads
and the tasks it starts, which copy the context) names the request; the view adds who is calling
and what they asked as it learns them. Celery tasks get one too, carrying the id of the request
that caused them (embeddings/observability/celery_hooks.py).
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar, Token
from dataclasses import dataclass

from embeddings.observability.redaction import holds_key

# What a client may send as X-Request-Id and have kept: ids of the usual shapes (UUIDs, ULIDs,
# `req_...`, base64), nothing that could break a log line or a header. Anything else is replaced.
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


@dataclass
class RequestContext:
    """What the log lines of one request (or task) carry; filled in as the request is served."""

    request_id: str
    # The tenant's slug and the API key's public id (never the key itself).
    tenant: str = ""
    key_id: str = ""
    endpoint: str = ""
    model: str = ""
    inputs: int | None = None
    tokens: int | None = None
    # Of the request's rows (texts or chunks), those the embedding cache answered; None: not looked up.
    cache_hits: int | None = None
    # A Celery task's name and a job's public id, for work a request caused.
    task: str = ""
    job: str = ""
    # The route's pattern (`/v1/jobs/<str:job_id>`), for the server span's name; not logged.
    route: str = ""

    def log_fields(self) -> dict[str, str | int]:
        """The fields known so far, for a log line (empty ones left out)."""
        fields = {
            "tenant": self.tenant,
            "key_id": self.key_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "inputs": self.inputs,
            "tokens": self.tokens,
            "cache_hits": self.cache_hits,
            "task": self.task,
            "job": self.job,
        }
        return {name: value for name, value in fields.items() if value not in ("", None)}


_current: ContextVar[RequestContext | None] = ContextVar("embedsite_request_context", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(sent: str | None) -> str:
    """The client's X-Request-Id when it is sane, else a fresh one. An id shaped like one of our keys
    is not sane: the id goes into every log line, error body and task of the request."""
    if sent and SANE_REQUEST_ID.fullmatch(sent) and not holds_key(sent):
        return sent
    return new_request_id()


def current() -> RequestContext | None:
    return _current.get()


def current_request_id() -> str | None:
    context = _current.get()
    return None if context is None else context.request_id


def begin(context: RequestContext) -> Token:
    return _current.set(context)


def end(token: Token) -> None:
    _current.reset(token)


def annotate(**fields: str | int | None) -> None:
    """Record what the request turned out to be (tenant, key, endpoint, model, inputs, tokens)."""
    context = _current.get()
    if context is not None:
        for name, value in fields.items():
            setattr(context, name, value)
