"""Traces and logs of the shipped processes: uvicorn (`manage.py serve`, as `make run` starts it) and
a Celery worker export their spans to a real OTLP/HTTP receiver this test starts, and a Triton
started with OpenTelemetry tracing exports its own; one request is one trace, from the server span
to Triton's, and its JSON log lines carry the same request id and trace id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from django.conf import settings

from embeddings.services.accounts.api_keys import parse_api_key
from tests.conftest import require_exported_model, start_triton
from tests.job_stack import JobStack, job_stack_running
from tests.observability.otlp_receiver import (
    SPAN_KIND_CLIENT,
    SPAN_KIND_SERVER,
    OtlpReceiver,
    ReceivedSpan,
    otlp_receiver,
)

MODEL = "all-MiniLM-L6-v2"
SERVICE = "embedsite-under-test"
# Against hanging only: exporters send every few hundred milliseconds.
HANG_DEADLINE_S = 60


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_triton(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory):
    """A real Triton tracing every inference with OpenTelemetry, to the same receiver."""
    repository = Path(settings.TRITON_MODEL_REPOSITORY)
    require_exported_model(repository)
    tracing = [
        "mode=opentelemetry",
        "rate=1",
        "count=-1",
        "level=TIMESTAMPS",
        f"opentelemetry,url={receiver.url}/v1/traces",
        "opentelemetry,resource=service.name=triton",
        "opentelemetry,bsp_schedule_delay=200",
    ]
    server = start_triton(
        tmp_path_factory.mktemp("traced_triton"),
        [repository],
        name="traced",
        extra_args=[f"--trace-config={setting}" for setting in tracing],
    )
    yield server
    server.stop(timeout_s=0)


@pytest.fixture(scope="module")
def traced_stack(
    traced_triton, redis_server, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JobStack]:
    """uvicorn and a Celery worker with JSON logs, exporting spans to `receiver`."""
    with job_stack_running(
        triton_server=traced_triton,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("traced_stack"),
        chunk_size=2,
        extra_env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "LOG_FORMAT": "json",
        },
    ) as stack:
        yield stack


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [
        span for span in spans if span.parent_span_id == parent.span_id and span.trace_id == parent.trace_id
    ]


def only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    named = [span for span in spans if span.name == name]
    assert len(named) == 1, (name, [span.name for span in spans])
    return named[0]


def server_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    for span in spans:
        if span.kind == SPAN_KIND_SERVER and span.attributes.get("embedsite.request_id") == request_id:
            return span
    return None


def json_lines(path: Path) -> list[dict]:
    """Every line of a process's output, each of which must be one JSON object."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{path.name}: a line that is not JSON: {line!r}")
    return parsed


def test_one_request_is_one_trace_down_to_triton_and_its_logs_name_it(traced_stack, receiver):
    request_id = "trace-test-embeddings-1"
    response = httpx2.post(
        f"{traced_stack.base_url}/v1/embeddings",
        json={"model": MODEL, "input": ["hello there", "general kenobi"]},
        headers={**traced_stack.headers, "X-Request-Id": request_id},
        timeout=HANG_DEADLINE_S,
    )
    assert response.status_code == 200, (response.text, traced_stack.logs_tail())
    assert response.headers["x-request-id"] == request_id

    def complete(spans: list[ReceivedSpan]) -> bool:
        server = server_span(spans, request_id)
        if server is None:
            return False
        trace = [span for span in spans if span.trace_id == server.trace_id]
        return any(span.service == "triton" for span in trace) and any(
            span.name == "serialize" for span in trace
        )

    spans = receiver.wait_for(complete, timeout_s=HANG_DEADLINE_S)
    server = server_span(spans, request_id)
    trace = [span for span in spans if span.trace_id == server.trace_id]

    # The request's span: the root (the client sent no trace context), with who asked what.
    assert server.service == SERVICE
    assert server.parent_span_id == ""
    assert (server.name, server.attributes["http.route"]) == ("POST /v1/embeddings", "/v1/embeddings")
    assert server.attributes["embedsite.tenant"] == "jobs"
    assert server.attributes["embedsite.endpoint"] == "openai"
    assert server.attributes["embedsite.model"] == MODEL
    assert server.attributes["embedsite.inputs"] == 2
    assert server.attributes["embedsite.tokens"] == response.json()["usage"]["total_tokens"]
    status = server.attributes.get("http.status_code", server.attributes.get("http.response.status_code"))
    assert status == 200

    # Its steps, each a child of it, in the order the request took them.
    steps = sorted(children(trace, server), key=lambda span: span.start)
    assert [span.name for span in steps] == [
        "authenticate", "tokenize", "quota.reserve", "inference", "quota.settle", "serialize",
    ]  # fmt: skip

    # Inference: the merged Triton call it went out in, and that call's gRPC span.
    inference = only(steps, "inference")
    batch = only(children(trace, inference), "triton.batch")
    assert batch.attributes["rows"] == 2
    infer_calls = [span for span in children(trace, batch) if span.name.endswith("/ModelInfer")]
    assert len(infer_calls) == 1 and infer_calls[0].kind == SPAN_KIND_CLIENT, children(trace, batch)

    # Triton joined the trace: the trace context went in the gRPC metadata, and Triton's own
    # spans for that inference are children of our call's span.
    triton_spans = [span for span in trace if span.service == "triton"]
    assert triton_spans
    assert {span.parent_span_id for span in triton_spans} & {infer_calls[0].span_id}
    triton_ids = {span.span_id for span in triton_spans} | {infer_calls[0].span_id}
    assert all(span.parent_span_id in triton_ids for span in triton_spans)

    # The request's log lines: JSON, with its id and its trace id; the access line says the rest.
    server_log, _ = traced_stack.logs
    lines = json_lines(server_log)
    assert not [line for line in lines if "color_message" in line]
    mine = [line for line in lines if line.get("request_id") == request_id]
    assert mine and all(line["trace_id"] == server.trace_id for line in mine)
    access = [line for line in mine if line["logger"] == "embedsite.access"]
    assert len(access) == 1
    assert access[0] == access[0] | {
        "level": "INFO",
        "method": "POST",
        "path": "/v1/embeddings",
        "status": 200,
        "tenant": "jobs",
        "endpoint": "openai",
        "model": MODEL,
        "inputs": 2,
        "tokens": response.json()["usage"]["total_tokens"],
    }
    assert access[0]["key_id"] and access[0]["key_id"] in traced_stack.api_key
    assert access[0]["duration_ms"] > 0 and access[0]["timestamp"]
    [embedded] = [line for line in mine if line["logger"] == "embeddings.requests"]
    assert 0 < embedded["inference_ms"] < access[0]["duration_ms"] and embedded["tokenization_ms"] > 0
    # The key's secret is in no line.
    # Split as the service splits a key (a secret may hold "_": its last piece could be one letter).
    _, secret = parse_api_key(traced_stack.api_key)
    assert secret not in server_log.read_text()


def test_a_jobs_chunks_run_in_its_submissions_trace_and_log_its_request_id(traced_stack, receiver):
    request_id = "trace-test-job-1"
    submitted = httpx2.post(
        f"{traced_stack.base_url}/v1/jobs",
        json={"model": MODEL, "input": ["one", "two", "three", "four"]},
        headers={**traced_stack.headers, "X-Request-Id": request_id},
        timeout=HANG_DEADLINE_S,
    )
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]

    def chunks_ran(spans: list[ReceivedSpan]) -> bool:
        server = server_span(spans, request_id)
        if server is None:
            return False
        runs = [s for s in spans if s.trace_id == server.trace_id and s.name.startswith("run/")]
        return len(runs) >= 2 and any(s.name.endswith("/ModelInfer") and s.service == SERVICE for s in spans)

    spans = receiver.wait_for(chunks_ran, timeout_s=HANG_DEADLINE_S)
    server = server_span(spans, request_id)
    assert server.attributes["embedsite.job"] == job_id
    # Reading the job: its span is named by the route, not by the job's id.
    read = httpx2.get(
        f"{traced_stack.base_url}/v1/jobs/{job_id}",
        headers={**traced_stack.headers, "X-Request-Id": "trace-test-job-read"},
        timeout=HANG_DEADLINE_S,
    )
    assert read.status_code == 200
    read_span = server_span(
        receiver.wait_for(
            lambda spans: server_span(spans, "trace-test-job-read") is not None, timeout_s=HANG_DEADLINE_S
        ),
        "trace-test-job-read",
    )
    assert read_span.name == "GET /v1/jobs/<str:job_id>"
    trace = [span for span in spans if span.trace_id == server.trace_id]
    by_id = {span.span_id: span for span in trace}

    # Both chunks were handed out by the submission (JOB_CHUNKS_IN_FLIGHT): each worker run is
    # the child of a publish span the request made, and embeds under it.
    runs = [span for span in trace if span.name == "run/embeddings.tasks.job_chunk_task"]
    assert len(runs) == 2, [span.name for span in trace]
    for run in runs:
        publish = by_id[run.parent_span_id]
        assert publish.name == "apply_async/embeddings.tasks.job_chunk_task"
        ancestor = publish
        while ancestor.parent_span_id in by_id:
            ancestor = by_id[ancestor.parent_span_id]
        assert ancestor == server
        inference = only(children(trace, run), "inference")
        assert any(span.name.endswith("/ModelInfer") for span in children(trace, inference))

    # The worker's lines for those chunks are JSON and name the request that submitted the job.
    _, worker_log = traced_stack.logs
    lines = json_lines(worker_log)
    succeeded = [
        line
        for line in lines
        if line.get("request_id") == request_id and "succeeded" in line["message"] and line.get("task")
    ]
    assert len(succeeded) == 2, [line["message"] for line in lines][-20:]
    assert all(line["task"] == "embeddings.tasks.job_chunk_task" for line in succeeded)
    assert all(line["trace_id"] == server.trace_id for line in succeeded)
