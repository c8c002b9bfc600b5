"""Log lines: the request's fields added to every line, JSON or text, nothing of a key; tracing's
switch read from the standard OTEL_* variables."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from embeddings.observability import context, logs, tracing
from tests.processes import REPO_ROOT, run_python


def logged(formatter: logging.Formatter, emit) -> list[str]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(logs.RequestContextFilter())
    logger = logging.getLogger("embedsite.test_logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_json_lines_carry_the_requests_fields_and_extra_wins():
    def emit(logger):
        logger.info("outside any request")
        token = context.begin(context.RequestContext(request_id="r-1", tenant="acme", key_id="k1"))
        try:
            context.annotate(endpoint="openai", model="m", inputs=2, tokens=7)
            logger.warning("served %s", "it", extra={"status": 200, "model": "from-extra"})
        finally:
            context.end(token)

    outside, inside = map(json.loads, logged(logs.json_formatter(), emit))
    assert outside["message"] == "outside any request" and "request_id" not in outside
    assert set(outside) == {"timestamp", "level", "logger", "message"}
    assert inside == inside | {
        "level": "WARNING",
        "logger": "embedsite.test_logs",
        "message": "served it",
        "request_id": "r-1",
        "tenant": "acme",
        "key_id": "k1",
        "endpoint": "openai",
        "inputs": 2,
        "tokens": 7,
        "status": 200,
        "model": "from-extra",
    }
    assert inside["timestamp"].endswith("+00:00")


def test_text_lines_show_the_request_id_or_a_dash():
    def emit(logger):
        logger.info("before")
        token = context.begin(context.RequestContext(request_id="r-2"))
        try:
            logger.info("during")
        finally:
            context.end(token)

    before, during = logged(logs.text_formatter(), emit)
    assert before.endswith("INFO embedsite.test_logs [-]: before")
    assert during.endswith("INFO embedsite.test_logs [r-2]: during")


@pytest.mark.integration
def test_an_unknown_log_format_stops_startup():
    done = run_python(["manage.py", "check"], {**_environment(), "LOG_FORMAT": "xml"})
    assert done.returncode != 0
    assert "LOG_FORMAT must be text or json, not 'xml'" in done.stderr


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}


@pytest.mark.parametrize(
    ("environment", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ],
)
def test_tracing_is_on_only_when_the_otel_variables_ask(environment, wanted):
    assert tracing.wanted(environment) is wanted


@pytest.mark.parametrize(
    "environment",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    ],
)
def test_an_exporter_we_do_not_ship_stops_startup(environment):
    with pytest.raises(ImproperlyConfigured):
        tracing.wanted(environment)


def test_off_spans_cost_one_shared_no_op():
    assert not tracing.enabled()
    assert tracing.span("a") is tracing.span("b", attribute=1)
    assert tracing.captured() is None and tracing.log_ids() is None


def test_what_a_command_prints_becomes_json_log_lines():
    def emit(logger):
        lines = logs.LogLines(logger)
        lines.write("Triton ready: gRPC 127.0.0.1:8001\n  health  http://127.0.0.1:8080/health\n\npartial ")
        lines.write("line")
        lines.flush()

    records = [json.loads(line) for line in logged(logs.json_formatter(), emit)]
    assert [record["message"] for record in records] == [
        "Triton ready: gRPC 127.0.0.1:8001",
        "health  http://127.0.0.1:8080/health",
        "partial line",
    ]
    assert {record["level"] for record in records} == {"INFO"}


@pytest.mark.integration
def test_with_otel_unset_the_served_app_installs_no_tracing():
    script = """
import asyncio, sys
import django
django.setup()
import grpc
import httpx2
original_channel = grpc.aio.insecure_channel
from embedsite.asgi import application

async def main():
    transport = httpx2.ASGITransport(app=application)
    async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as client:
        answer = await client.post("/v1/embeddings", json={"input": "x"})
        assert answer.status_code == 401 and answer.headers["x-request-id"]

asyncio.run(main())
from opentelemetry import trace
print(type(trace.get_tracer_provider()).__name__)
print(grpc.aio.insecure_channel is original_channel)
loaded = ("opentelemetry.instrumentation", "opentelemetry.exporter", "opentelemetry.sdk.trace")
print(sorted(name for name in sys.modules if name.startswith(loaded)))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env={**_environment(), "DJANGO_SETTINGS_MODULE": "embedsite.settings", "LOG_FORMAT": "json"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # No provider set (the API's proxy), gRPC channels as grpc makes them, no instrumentation,
    # exporter or tracing SDK loaded. (redis-py imports the SDK's metrics module when present.)
    assert done.stdout.strip().splitlines()[-3:] == ["ProxyTracerProvider", "True", "[]"]
