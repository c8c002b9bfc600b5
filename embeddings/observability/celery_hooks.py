"""Celery's side of observability: its processes log as the web does, trace when asked, and each
task carries the id of the request that caused it.

- Logging: a `setup_logging` receiver makes Celery leave the root logger to Django's LOGGING
  (LOG_FORMAT), so worker and beat lines have the web's format, JSON included.
- Tracing: set up in the worker (and each prefork child) and in beat when OTEL_* asks; the Celery
  instrumentation puts each task in the trace of whoever sent it (a job's first chunks in the
  submission's, each later chunk in its predecessor's).
- Request ids: a task sent while serving a request (or running a task that has one) carries that
  id in its message headers; the worker puts it in the task's log context, so a job's chunk lines
  name the request that submitted the job.
"""

from __future__ import annotations

import contextlib
import logging.config

from celery import signals
from django.conf import settings

from embeddings.observability import context, tracing

REQUEST_ID_HEADER = "embedsite_request_id"
_TOKEN = "_embedsite_context_token"


@signals.setup_logging.connect
def logging_as_django(**kwargs) -> None:
    logging.config.dictConfig(settings.LOGGING)


@signals.celeryd_init.connect
def no_banner_in_json(instance=None, **kwargs) -> None:
    # The worker's startup banner is plain text on stdout: with JSON logs, lines only. (Beat prints
    # its banner before any hook: `celery --quiet beat`, as runstack starts it.)
    if settings.LOG_FORMAT == "json" and instance is not None:
        instance.quiet = True


@signals.worker_init.connect
@signals.worker_process_init.connect
def tracing_in_worker(**kwargs) -> None:
    tracing.setup("worker")


@signals.beat_init.connect
def tracing_in_beat(**kwargs) -> None:
    tracing.setup("beat")


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def spans_flushed(**kwargs) -> None:
    tracing.flush()


@signals.before_task_publish.connect
def request_id_sent(headers=None, **kwargs) -> None:
    request_id = context.current_request_id()
    if request_id is not None and headers is not None:
        headers.setdefault(REQUEST_ID_HEADER, request_id)


def _sent_request_id(task) -> str | None:
    request = task.request
    sent = getattr(request, REQUEST_ID_HEADER, None) or (getattr(request, "headers", None) or {}).get(
        REQUEST_ID_HEADER
    )
    return sent if isinstance(sent, str) else None


@signals.task_prerun.connect
def task_context_begun(task=None, **kwargs) -> None:
    if task is None:
        return
    sent = _sent_request_id(task)
    task_context = context.RequestContext(request_id=context.request_id_from(sent), task=task.name)
    setattr(task.request, _TOKEN, context.begin(task_context))


@signals.task_postrun.connect
def task_context_ended(task=None, **kwargs) -> None:
    token = getattr(task.request, _TOKEN, None) if task is not None else None
    if token is not None:
        setattr(task.request, _TOKEN, None)
        with contextlib.suppress(ValueError):  # set in another context: nothing of ours to undo
            context.end(token)
