"""OpenTelemetry traces, exported over OTLP/HTTP, on only when the standard OTEL_* variables ask.

Off (no OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_TRACES_EXPORTER,
or OTEL_SDK_DISABLED=true) this module imports nothing of OpenTelemetry: no provider, no
instrumentation, and `span()` hands back one shared no-op context manager. On, `setup()` installs
the SDK's tracer provider (service name, resource attributes and sampler from OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], as the SDK reads them), a batching OTLP/HTTP
exporter (OTEL_EXPORTER_OTLP_* as the exporter reads them), and the instrumentations: the gRPC
clients (both our Triton transports: a span per call, the W3C trace context in the call's
metadata, so Triton's own spans join the trace when it traces) and Celery (a task runs in the trace
of whoever sent it). The HTTP server span is the ASGI instrumentation's (`asgi_application`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console", "none")
# Probes and scrapes come every few seconds and say nothing about a request: not traced unless
# OTEL_PYTHON_ASGI_EXCLUDED_URLS says otherwise.
DEFAULT_EXCLUDED_URLS = "/health$,/ready$,/metrics$"

_NO_SPAN = contextlib.nullcontext()
_tracer: Any = None
_role = ""


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint or an exporter named)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter and exporter not in EXPORTERS:
        raise ImproperlyConfigured(
            f"OTEL_TRACES_EXPORTER must be one of {', '.join(EXPORTERS)}, not {exporter!r}"
        )
    if exporter == "none":
        return False
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        raise ImproperlyConfigured(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is installed, not {protocol!r}"
        )
    return bool(
        exporter
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def enabled() -> bool:
    return _tracer is not None


def setup(role: str) -> bool:
    """Install tracing in this process for `role` (web, worker, beat) when the environment asks for
    it (once: later calls change nothing); whether it is on."""
    global _tracer, _role
    if _tracer is not None or not wanted():
        return _tracer is not None
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcInstrumentorClient
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {"embedsite.role": role}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "embedsite"
    provider = TracerProvider(resource=Resource.create(attributes))
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    GrpcInstrumentorClient().instrument()
    GrpcAioInstrumentorClient().instrument()
    CeleryInstrumentor().instrument()
    _tracer = trace.get_tracer("embedsite")
    _role = role
    logger.info("tracing on: %s spans exported (%s)", role, type(exporter).__name__)
    return True


def asgi_application(app):
    """`app` inside the ASGI instrumentation's server span when tracing is on, else `app` itself."""
    if _tracer is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    excluded = os.environ.get("OTEL_PYTHON_ASGI_EXCLUDED_URLS", DEFAULT_EXCLUDED_URLS)
    return OpenTelemetryMiddleware(app, excluded_urls=excluded, exclude_spans=["receive", "send"])


def span(name: str, **attributes: str | int | float | bool):
    """A child span of the current one for the block (a shared no-op when tracing is off)."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes)


def captured() -> Any:
    """The current trace context, for work done later elsewhere on its behalf (None when off)."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def batch_span(name: str, contexts: Sequence[Any], **attributes: str | int | float | bool):
    """A span for one piece of work done for several requests (a merged Triton call): the child
    of the first request's span, linked to the others', so each request's trace shows the call
    and the call shows every request it served."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry import trace

    live = [context for context in contexts if context is not None]
    links = [trace.Link(trace.get_current_span(context).get_span_context()) for context in live[1:]]
    return _tracer.start_as_current_span(
        name, context=live[0] if live else None, links=links, attributes=attributes
    )


def current_span() -> Any:
    """The current span (None when off), to annotate later from elsewhere."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def annotate(span: Any, **attributes: str | int | float | bool | None) -> None:
    """Set attributes on `span` (from current_span(); empty values left out)."""
    if span is None or not span.is_recording():
        return
    for name, value in attributes.items():
        if value not in ("", None):
            span.set_attribute(name, value)


def log_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span in hex, as OTLP backends show them; None when off
    or outside a span."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")


def flush(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (a process about to exit)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    with contextlib.suppress(Exception):
        provider.force_flush(timeout_ms)
