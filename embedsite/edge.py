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
import functools
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


class Refusal:
    """An answer the edge gives instead of the application: a JSON error body in the API's shape.

    Made once per kind (the edge's own refusals, admission's), so that refusing costs a write of
    bytes prepared in advance; only the Date and X-Request-Id headers vary."""

    __slots__ = ("close", "code", "encoded", "reason", "status")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        reason: str,
        *,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        close: bool = False,
        error_type: str = "invalid_request_error",
    ) -> None:
        self.status, self.code, self.reason, self.close = status, code, reason, close
        body = orjson.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}})
        self.encoded = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode(),
            b"".join(name + b": " + value + b"\r\n" for name, value in headers)
            + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\nx-content-type-options: nosniff\r\n",
            body,
        )

    def body(self) -> bytes:
        return self.encoded[2]

    def response(
        self,
        default_headers: list[tuple[bytes, bytes]],
        *,
        request_id: bytes | None,
        close: bool,
        head_only: bool,
    ) -> bytes:
        status_line, headers, body = self.encoded
        parts = [status_line]
        for name, value in default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(headers)
        if request_id is not None:
            parts += (b"x-request-id: ", request_id, b"\r\n")
        parts.append(b"connection: close\r\n\r\n" if close else b"\r\n")
        if not head_only:
            parts.append(body)
        return b"".join(parts)


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
        self.counters: dict[str, Any] = {}
        self.since = time.monotonic()

    def prepare(self, reasons: tuple[str, ...]) -> None:
        """Make each reason's counter exist at 0, so that rate() and the alerts see it before the
        first refusal (call in each server process)."""
        from embeddings.metrics import HTTP_EDGE_REFUSED

        for reason in reasons:
            self.counters.setdefault(reason, HTTP_EDGE_REFUSED.labels(reason))

    def add(self, reason: str) -> None:
        counter = self.counters.get(reason)
        if counter is None:
            from embeddings.metrics import HTTP_EDGE_REFUSED

            counter = self.counters[reason] = HTTP_EDGE_REFUSED.labels(reason)
        counter.inc()
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self.since >= LOG_SUMMARY_INTERVAL_S:
            summary = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.counts.items()))
            logger.warning("%s in the last %.0f s: %s", self.what, now - self.since, summary)
            self.counts.clear()
            self.since = now


edge_refusals = RefusalLog("HTTP edge refused or closed connections")
EDGE_REFUSAL_REASONS = (
    "head_too_large", "too_many_headers", "head_timeout", "chunk_too_large", "write_stalled",
    "too_many_connections", "closed_waiting_connection",
)  # fmt: skip


class HeadRefused(Exception):
    """Raised in a parser callback to stop parsing: the head crossed a limit."""


@dataclass(frozen=True)
class EdgeRefusals:
    """The edge's answers to a bad head, made once per set of limits."""

    head_too_large: Refusal
    too_many_headers: Refusal
    head_timeout: Refusal


@functools.lru_cache(maxsize=4)
def edge_refusals_for(limits: EdgeLimits) -> EdgeRefusals:
    return EdgeRefusals(
        head_too_large=Refusal(
            431, "request_head_too_large",
            f"The request line and headers are larger than {limits.max_head_bytes} bytes.", "head_too_large",
            close=True,
        ),
        too_many_headers=Refusal(
            431, "too_many_headers", f"The request has more than {limits.max_headers} header fields.",
            "too_many_headers", close=True,
        ),
        head_timeout=Refusal(
            408, "request_timeout", f"The request head did not arrive within {limits.head_timeout_s:g} s.",
            "head_timeout", close=True,
        ),
    )  # fmt: skip


def _chunk_too_large(limit: int) -> Refusal:
    return Refusal(
        413, "payload_too_large", f"A chunk of the request body is larger than its limit, {limit} bytes.",
        "chunk_too_large", close=True,
    )  # fmt: skip


TOO_MANY_CONNECTIONS = Refusal(
    503, "too_many_connections", "This server process holds its maximum of connections; retry shortly.",
    "too_many_connections", headers=((b"retry-after", b"1"),), close=True, error_type="server_error",
)  # fmt: skip


class HeadWaits:
    """This process's connections waiting for a head, with the time each must have it by.

    One sweep a fraction of the timeout apart closes those past it, instead of a timer per request:
    every wait has the same length, so the dict's order (insertion) is the deadlines' order, and a
    sweep stops at the first that has time left. A connection is in it from when it may send a head
    (opened, or its last response ended) until that head is complete."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self.deadlines: dict[EdgeProtocol, float] = {}
        self.interval_s = min(1.0, timeout_s / 4)
        self.sweeper: asyncio.TimerHandle | None = None

    def add(self, connection: EdgeProtocol) -> None:
        if connection not in self.deadlines:
            self.deadlines[connection] = self.loop.time() + self.timeout_s
            if self.sweeper is None:
                self.sweeper = self.loop.call_later(self.interval_s, self.sweep)

    def discard(self, connection: EdgeProtocol) -> None:
        self.deadlines.pop(connection, None)

    def sweep(self) -> None:
        self.sweeper = None
        now = self.loop.time()
        late = []
        for connection, deadline in self.deadlines.items():
            if deadline > now:
                break
            late.append(connection)
        for connection in late:
            del self.deadlines[connection]
            connection.head_timed_out()
        if self.deadlines:
            self.sweeper = self.loop.call_later(self.interval_s, self.sweep)

    def oldest_idle(self) -> EdgeProtocol | None:
        """The connection waiting longest with no request of its own running (a pipelined head may
        be arriving while its previous request runs: that one is not idle)."""
        for connection in self.deadlines:
            if connection.cycle is None or connection.cycle.response_complete:
                return connection
        return None


def _head_waits(server_state, loop: asyncio.AbstractEventLoop, timeout_s: float) -> HeadWaits:
    waits = getattr(server_state, "edge_head_waits", None)
    if waits is None:
        waits = server_state.edge_head_waits = HeadWaits(loop, timeout_s)
    return waits


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: EdgeLimits = config.edge_limits
        self.admission: Admission | None = config.admission
        self.limits_refusals = edge_refusals_for(self.limits)
        self.head_waits = _head_waits(server_state, self.loop, self.limits.head_timeout_s)
        # Between a message's end (or the connection's start) and the next head's end.
        self.awaiting_head = True
        self.head_begun = False
        # Bytes read while awaiting the head: an upper bound of its size so far.
        self.head_bytes = 0
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
            oldest = self.head_waits.oldest_idle()
            if oldest is None:
                edge_refusals.add(TOO_MANY_CONNECTIONS.reason)
                self._answer_and_close(TOO_MANY_CONNECTIONS)
                return
            self.head_waits.discard(oldest)
            edge_refusals.add("closed_waiting_connection")
            oldest.transport.close()
        self.head_waits.add(self)

    def connection_lost(self, exc) -> None:
        self.head_waits.discard(self)
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if self.waiting is not None:
            _, _, ticket = self.waiting
            self.waiting = None
            self.admission.withdraw(ticket)
        super().connection_lost(exc)

    def head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        edge_refusals.add("head_timeout")
        if self.head_begun:
            self._answer_and_close(self.limits_refusals.head_timeout)
        else:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

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
            edge_refusals.add(self.limits_refusals.head_too_large.reason)
            self._answer_and_close(self.limits_refusals.head_too_large)
            return
        if self.open_chunk and not self.open_chunk_checked:
            self._check_open_chunk(data)
        self.previous_tail = data[-CHUNK_LINE_TAIL_BYTES:]

    def on_message_begin(self) -> None:
        self.head_begun = True
        # A head that starts while the previous request runs (pipelined) is waited for from now.
        self.head_waits.add(self)
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        # Judged as parsed, exactly: data_received's bound may have missed the head's first read
        # (one that also carried the end of the previous request).
        refusals = self.limits_refusals
        if len(self.headers) > self.limits.max_headers:
            raise HeadRefused(refusals.too_many_headers)
        size = REQUEST_LINE_AND_END_BYTES + len(self.parser.get_method()) + len(self.url)
        for name, value in self.headers:
            size += len(name) + len(value) + 4  # ": " and CRLF
        if size > self.limits.max_head_bytes:
            raise HeadRefused(refusals.head_too_large)
        self.awaiting_head = self.head_begun = False
        self.head_bytes = 0
        self.head_waits.discard(self)
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
        # (No cycle: a WebSocket upgrade, whose request never runs as HTTP.)
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            # Answered before its body ended (refused, or the application did not read it).
            self.head_waits.add(self)

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
            default_headers = self.server_state.default_headers
            self.transport.write(
                refusal.response(default_headers, request_id=None, close=True, head_only=False)
            )
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
            self._refuse_request(cycle, ticket)
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
        self._refuse_request(cycle, ticket)

    def _run(self, cycle: RequestResponseCycle, app, ticket) -> None:
        task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self.admission.release(ticket))
        self.tasks.add(task)

    def _refuse_request(self, cycle: RequestResponseCycle, ticket) -> None:
        """Answer a request that never ran, as uvicorn ends a response: kept alive when its body is
        small enough to read and drop, closed otherwise."""
        if self.transport.is_closing():
            return
        refusal = ticket.refusal
        close = refusal.close or not cycle.keep_alive or _body_too_long_to_drop(cycle.scope["headers"])
        cycle.response_started = cycle.response_complete = True
        self.transport.write(
            refusal.response(
                self.server_state.default_headers,
                request_id=ticket.request_id,
                close=close,
                head_only=cycle.scope["method"] == "HEAD",
            )
        )
        if close:
            self.transport.close()
        else:
            self.on_response_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next head is awaited unless it has already arrived (pipelined).
        if self.awaiting_head and not self.transport.is_closing():
            self.head_waits.add(self)


def _body_too_long_to_drop(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return not value.isdigit() or int(value) > DROP_BODY_BYTES
        if name == b"transfer-encoding":
            return True
    return False
