"""The HTTP/1.1 edge of the shipped server: uvicorn's httptools protocol with the bounds a server
facing the internet needs before a request reaches the application.

uvicorn 0.54 (pinned) bounds none of these: httptools joins the pieces of a header line for as long
as they come (a 256 MB header took 58 s of the event loop and 700 MB), a client may take forever
to send its head, a response may wait forever for a client that stopped reading, and a process
holds as many connections as its file limit allows. `EdgeProtocol` adds, per connection:

- **Head size and fields.** A request line plus headers over `max_head_bytes`, or more than
  `max_headers` fields, is answered 431 and the connection closed as soon as a read crosses the
  limit: at most one socket read (256 KiB) is parsed past it, nothing is buffered beyond.
- **Head timeout.** A head must be complete within `head_timeout_s` of the connection opening, of
  the previous response ending, or of its first byte (whichever starts the wait): a client that
  sends half a request line and stops is answered 408 and closed. Idle kept-alive connections
  close after uvicorn's `timeout_keep_alive`.
- **Chunk sizes.** A chunk declared larger than the request's body limit is answered 413 at once
  (its bytes would be refused anyway; waiting for them only held the connection until a timeout).
- **Write stalls.** A response whose client has read nothing for `write_timeout_s` (the socket's
  buffer full all along) is cut: the request ends as if the client had gone away.
- **Connections.** Beyond `max_connections` in this process, the connection that has waited longest
  without sending a complete head (idle kept-alive ones, slow heads) is closed to make room; when
  none is waiting, the newcomer is answered 503 and closed. Descriptors never run out.
- **Admission.** Before a request's task starts, `admission` (embeddings/api/admission.py) decides
  from its head whether it runs now, waits (no task exists meanwhile; its body is left unread past
  uvicorn's 64 KiB) or is refused; a refusal is written here, without the application.

What is refused here is counted in `embedsite_http_edge_refused` and summarised in the log at most
once per LOG_SUMMARY_INTERVAL_S, never a line per refusal: a flood must not become a flood of logs.

The class relies on uvicorn's protocol internals (the parser callbacks, `cycle`, `pipeline`,
`_start_asgi_task`): uvicorn is pinned, and tests/api/test_edge.py drives each bound through the
real server on a socket, so an upgrade that moves them fails there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

logger = logging.getLogger("embedsite.edge")

LOG_SUMMARY_INTERVAL_S = 10.0
# A refused request whose declared body is at most this long keeps its connection: the rest of its
# body is read and dropped, as uvicorn drops any unread body. A longer one (or chunked) is closed.
DROP_BODY_BYTES = 64 * 1024
REQUEST_LINE_AND_END_BYTES = len("  HTTP/1.1\r\n\r\n")
# The bytes of the previous read kept to find a chunk-size line that a read boundary split.
CHUNK_LINE_TAIL_BYTES = 128


@dataclass(frozen=True)
class EdgeLimits:
    max_head_bytes: int
    max_headers: int
    head_timeout_s: float
    write_timeout_s: float
    max_connections: int
    # The body limit of a request (its route's), asked only of chunked bodies.
    body_limit: Callable[[dict], int]


@dataclass(frozen=True)
class Refusal:
    """An answer the edge gives instead of the application: a JSON error body in the API's shape."""

    status: int
    code: str
    message: str
    reason: str  # the metric's label: bounded, never client text
    headers: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False
    error_type: str = "invalid_request_error"

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.code}}
        )


class Admission(Protocol):
    """What the edge asks before a request's task starts (embeddings/api/admission.py)."""

    def arrive(self, scope: dict, owner: EdgeProtocol) -> Any | None:
        """None: run it, not counted. Otherwise a ticket that is admitted now (`ticket.admitted`),
        refused now (`ticket.refusal`), or waiting: later `owner.admitted(ticket)` or
        `owner.refused(ticket)` is called."""

    def release(self, ticket: Any) -> None:
        """The admitted request's task has ended."""

    def withdraw(self, ticket: Any) -> None:
        """The waiting request's connection is gone."""


class RefusalLog:
    """Counts refusals by reason and logs a summary at most once per LOG_SUMMARY_INTERVAL_S."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.counts: dict[str, int] = {}
        self.since = time.monotonic()

    def add(self, reason: str) -> None:
        from embeddings.metrics import HTTP_EDGE_REFUSED

        HTTP_EDGE_REFUSED.labels(reason).inc()
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self.since >= LOG_SUMMARY_INTERVAL_S:
            summary = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.counts.items()))
            logger.warning("%s in the last %.0f s: %s", self.what, now - self.since, summary)
            self.counts.clear()
            self.since = now


edge_refusals = RefusalLog("HTTP edge refused or closed connections")

HEAD_TOO_LARGE = "request_head_too_large"
TOO_MANY_HEADERS = "too_many_headers"


class HeadRefused(Exception):
    """Raised in a parser callback to stop parsing: the head crossed a limit."""


def _too_large_head(limit: int) -> Refusal:
    return Refusal(
        431, HEAD_TOO_LARGE, f"The request line and headers are larger than {limit} bytes.", "head_too_large",
        close=True,
    )  # fmt: skip


def _too_many_headers(limit: int) -> Refusal:
    return Refusal(
        431,
        TOO_MANY_HEADERS,
        f"The request has more than {limit} header fields.",
        "too_many_headers",
        close=True,
    )


def _head_timeout(seconds: float) -> Refusal:
    return Refusal(
        408,
        "request_timeout",
        f"The request head did not arrive within {seconds:g} s.",
        "head_timeout",
        close=True,
    )


def _chunk_too_large(limit: int) -> Refusal:
    return Refusal(
        413, "payload_too_large", f"A chunk of the request body is larger than its limit, {limit} bytes.",
        "chunk_too_large", close=True,
    )  # fmt: skip


TOO_MANY_CONNECTIONS = Refusal(
    503, "too_many_connections", "This server process holds its maximum of connections; retry shortly.",
    "too_many_connections", headers=((b"retry-after", b"1"),), close=True, error_type="server_error",
)  # fmt: skip


def _idle_registry(server_state) -> dict[EdgeProtocol, None]:
    """This process's connections waiting for a head, oldest first (a dict keeps insertion order)."""
    registry = getattr(server_state, "edge_awaiting_head", None)
    if registry is None:
        registry = server_state.edge_awaiting_head = {}
    return registry


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: EdgeLimits = config.edge_limits
        self.admission: Admission | None = config.admission
        self.awaiting = _idle_registry(server_state)
        # Between a message's end (or the connection's start) and the next head's end.
        self.awaiting_head = True
        self.head_begun = False
        # Bytes read while awaiting the head: an upper bound of its size so far.
        self.head_bytes = 0
        # The head's size and fields as parsed (request line and each field as it completes).
        self.head_size = 0
        self.header_fields = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        # The chunk whose header was parsed last and whose data has not all arrived.
        self.open_chunk = False
        self.open_chunk_checked = True
        self.open_chunk_data = 0
        self.previous_tail = b""
        # The request waiting for admission (at most one: a pipelined one starts after it).
        self.waiting: tuple[RequestResponseCycle, Any, Any] | None = None

    # --- Connections -------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            oldest = next(iter(self.awaiting), None)
            if oldest is None:
                edge_refusals.add(TOO_MANY_CONNECTIONS.reason)
                self._answer_and_close(TOO_MANY_CONNECTIONS)
                return
            del self.awaiting[oldest]
            edge_refusals.add("closed_waiting_connection")
            oldest.transport.close()
        self._await_head()

    def connection_lost(self, exc) -> None:
        self.awaiting.pop(self, None)
        self._cancel_head_timer()
        self._cancel_write_timer()
        if self.waiting is not None:
            _, _, ticket = self.waiting
            self.waiting = None
            self.admission.withdraw(ticket)
        super().connection_lost(exc)

    def _await_head(self) -> None:
        """The client may send a head now: it has head_timeout_s to complete it."""
        self.awaiting[self] = None
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _cancel_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        edge_refusals.add("head_timeout")
        if self.head_begun:
            self._answer_and_close(_head_timeout(self.limits.head_timeout_s))
        else:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def _write_stalled(self) -> None:
        self.write_timer = None
        edge_refusals.add("write_stalled")
        # connection_lost follows: the response's send returns and the request ends as disconnected.
        self.transport.abort()

    # --- Reading -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self.awaiting_head:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as error:
            refused = error.__context__ if isinstance(error.__context__, HeadRefused) else None
            if refused is not None:
                edge_refusals.add(refused.args[0].reason)
                self._answer_and_close(refused.args[0])
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        if self.awaiting_head and self.head_bytes > self.limits.max_head_bytes:
            edge_refusals.add("head_too_large")
            self._answer_and_close(_too_large_head(self.limits.max_head_bytes))
            return
        if self.open_chunk and not self.open_chunk_checked:
            self._check_open_chunk(data)
        self.previous_tail = data[-CHUNK_LINE_TAIL_BYTES:]

    def on_message_begin(self) -> None:
        self.head_begun = True
        # The request line's spaces, " HTTP/1.1" and CRLF, and the head's closing CRLF; the method
        # is added when known.
        self.head_size, self.header_fields = REQUEST_LINE_AND_END_BYTES, 0
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self.head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_fields += 1
        self.head_size += len(name) + len(value) + 4  # ": " and CRLF
        if self.header_fields > self.limits.max_headers:
            raise HeadRefused(_too_many_headers(self.limits.max_headers))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # Exact, where data_received's bound may have missed the head's first read (one that also
        # carried the end of the previous request).
        if self.head_size + len(self.parser.get_method()) > self.limits.max_head_bytes:
            raise HeadRefused(_too_large_head(self.limits.max_head_bytes))
        self.awaiting_head = self.head_begun = False
        self.head_bytes = 0
        self.awaiting.pop(self, None)
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        self.open_chunk, self.open_chunk_checked, self.open_chunk_data = True, False, 0

    def on_chunk_complete(self) -> None:
        self.open_chunk = False

    def on_body(self, body: bytes) -> None:
        if self.open_chunk:
            self.open_chunk_data += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.awaiting_head, self.head_bytes = True, 0
        super().on_message_complete()
        if self.cycle.response_complete and not self.transport.is_closing():
            # Answered before its body ended (refused, or the application did not read it).
            self._await_head()

    def _check_open_chunk(self, data: bytes) -> None:
        """The size of the chunk whose header this read ended with (its data not all here yet),
        read back from its size line: everything after that line in this read is its data."""
        self.open_chunk_checked = True
        end = len(data) - self.open_chunk_data - 2  # the size line's CRLF
        if end < 0 or data[end : end + 2] != b"\r\n":
            return
        start = data.rfind(b"\n", 0, end) + 1
        line = data[start:end] if start > 0 else (self.previous_tail + data[:end]).rsplit(b"\n", 1)[-1]
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            return
        if self.cycle is None or self.cycle.response_complete:
            return
        limit = self.limits.body_limit(self.cycle.scope)
        if size > limit:
            edge_refusals.add("chunk_too_large")
            self._answer_and_close(_chunk_too_large(limit))

    # --- Writing what the edge answers -------------------------------------------------------------

    def _response_bytes(self, refusal: Refusal, *, close: bool, head_only: bool = False) -> bytes:
        body = refusal.body()
        status = HTTPStatus(refusal.status)
        lines = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        for name, value in (*self.server_state.default_headers, *refusal.headers):
            lines += [name, b": ", value, b"\r\n"]
        lines += [
            b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\n",
            b"x-content-type-options: nosniff\r\n",
            b"connection: close\r\n" if close else b"",
            b"\r\n",
            b"" if head_only else body,
        ]  # fmt: skip
        return b"".join(lines)

    def _answer_and_close(self, refusal: Refusal) -> None:
        """Answer `refusal` (unless a response has begun) and close: nothing more is read."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The application, if running, sees the client gone: its sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        if not self.transport.is_closing():
            self.transport.write(self._response_bytes(refusal, close=True))
            self.transport.close()

    # --- Admission -----------------------------------------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        if self.admission is None or app is not self.app:
            super()._start_asgi_task(cycle, app)
            return
        ticket = self.admission.arrive(cycle.scope, self)
        if ticket is None:
            super()._start_asgi_task(cycle, app)
        elif ticket.admitted:
            self._run(cycle, app, ticket)
        elif ticket.refusal is not None:
            self._refuse_request(cycle, ticket.refusal)
        else:
            self.waiting = (cycle, app, ticket)

    def admitted(self, ticket) -> None:
        """Called by the admission controller: the waiting request may run now."""
        cycle, app, _ = self.waiting
        self.waiting = None
        self._run(cycle, app, ticket)

    def refused(self, ticket) -> None:
        """Called by the admission controller: the waiting request is refused."""
        cycle, _, _ = self.waiting
        self.waiting = None
        self._refuse_request(cycle, ticket.refusal)

    def _run(self, cycle: RequestResponseCycle, app, ticket) -> None:
        task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self.admission.release(ticket))
        self.tasks.add(task)

    def _refuse_request(self, cycle: RequestResponseCycle, refusal: Refusal) -> None:
        """Answer a request that never ran, as uvicorn ends a response: kept alive when its body is
        small enough to read and drop, closed otherwise."""
        if self.transport.is_closing():
            return
        close = refusal.close or not cycle.keep_alive or _body_too_long_to_drop(cycle.scope["headers"])
        cycle.response_started = cycle.response_complete = True
        self.transport.write(
            self._response_bytes(refusal, close=close, head_only=cycle.scope["method"] == "HEAD")
        )
        if close:
            self.transport.close()
        else:
            self.on_response_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next head is awaited unless it has already arrived (pipelined).
        if self.awaiting_head and not self.transport.is_closing():
            self._await_head()


def _body_too_long_to_drop(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return not value.isdigit() or int(value) > DROP_BODY_BYTES
        if name == b"transfer-encoding":
            return True
    return False
