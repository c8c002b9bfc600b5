"""An OTLP/HTTP trace receiver for tests: a real endpoint on 127.0.0.1 that decodes what exporters
send (protobuf, as the OpenTelemetry collector does, with the opentelemetry-proto package) and
keeps every span it received."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3


# OTLP/JSON writes these ids in hex, where protobuf's JSON mapping expects base64.
HEX_ID_FIELDS = {"traceId", "spanId", "parentSpanId"}


def _hex_ids_as_base64(node):
    if isinstance(node, dict):
        return {
            key: base64.b64encode(bytes.fromhex(value)).decode()
            if key in HEX_ID_FIELDS and isinstance(value, str)
            else _hex_ids_as_base64(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids_as_base64(item) for item in node]
    return node


def _from_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON (what Triton's C++ exporter sends by default)."""
    return json_format.ParseDict(
        _hex_ids_as_base64(json.loads(body)), ExportTraceServiceRequest(), ignore_unknown_fields=True
    )


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


# The attribute our server spans carry the request id in.
REQUEST_ID = "embedsite.request_id"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    # Nanoseconds since the epoch, as the exporter sent them.
    start: int
    attributes: dict
    links: tuple[tuple[str, str], ...]


class OtlpReceiver:
    """Serves POST /v1/traces; `spans` is everything received so far."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                json_body = self.headers.get("Content-Type", "").startswith("application/json")
                request = _from_json(body) if json_body else ExportTraceServiceRequest.FromString(body)
                receiver.add(request)
                response = ExportTraceServiceResponse()
                answer = (
                    json_format.MessageToJson(response).encode()
                    if json_body
                    else response.SerializeToString()
                )
                self.send_response(200)
                self.send_header(
                    "Content-Type", "application/json" if json_body else "application/x-protobuf"
                )
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start=span.start_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        )
                    )
        with self.lock:
            self.spans.extend(received)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(
        self, found: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float
    ) -> list[ReceivedSpan]:
        """The spans once `found(spans)` holds; fails after timeout_s (against hanging only)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if found(spans):
                return spans
            time.sleep(0.1)
        spans = self.snapshot()
        # Each span's trace and parent, and the request id a server span carries: what decides
        # whether spans belong together.
        seen = [
            (s.service, s.name, s.trace_id[:8], s.parent_span_id[:8], s.attributes.get(REQUEST_ID))
            for s in spans
        ]
        raise AssertionError(f"not received within {timeout_s:g} s; got {seen}")


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        thread.join(timeout=10)
