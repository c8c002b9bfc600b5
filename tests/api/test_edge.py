"""The HTTP edge of the shipped server (embedsite/edge.py) through a real uvicorn on a socket
(`edge_server`, tests/api/conftest.py EDGE_LIMITS): heads bounded in size and fields, slow heads and
silent connections cut off, idle connections closed, a connection cap, chunk sizes refused at once,
stalled readers cut, and Django's own pages (the admin) reading bodies under the API's timeouts.
Raw sockets throughout: a client library would refuse to send most of this.

Admission (who runs, waits or is refused under load) is in test_admission.py."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack, closing

import httpx2
import orjson
import pytest
from django.conf import settings

from tests.api.conftest import EDGE_LIMITS, LiveServer
from tests.api.raw_http import closed_within, connect, error_code, head, read_answer

HEAD_TIMEOUT_S = float(EDGE_LIMITS["HTTP_HEAD_TIMEOUT_S"])
KEEPALIVE_S = float(EDGE_LIMITS["HTTP_KEEPALIVE_TIMEOUT_S"])
MAX_CONNECTIONS = int(EDGE_LIMITS["HTTP_MAX_CONNECTIONS"])
BODY_IDLE_S = float(EDGE_LIMITS["REQUEST_BODY_IDLE_TIMEOUT_S"])
WRITE_TIMEOUT_S = float(EDGE_LIMITS["HTTP_WRITE_TIMEOUT_S"])
# What a loaded 2-core machine may add to a timer firing and the close reaching the client.
LATE_S = 1.5


def health_is_served(server: LiveServer) -> None:
    assert httpx2.get(f"{server.base_url}/health", timeout=10).status_code == 200


# --- Heads: size and fields ------------------------------------------------------------------------


def padded_head(size: int) -> bytes:
    """GET /health whose head is exactly `size` bytes, padded by one header field."""
    bare = len(head("GET", "/health", "X-Pad: "))
    return head("GET", "/health", "X-Pad: " + "a" * (size - bare))


def test_a_head_at_the_limit_is_served_and_one_byte_more_is_431(edge_server):
    limit = settings.HTTP_MAX_HEAD_BYTES
    with closing(connect(edge_server)) as sock:
        sock.sendall(padded_head(limit))
        assert read_answer(sock)[0] == 200
    with closing(connect(edge_server)) as sock:
        sock.sendall(padded_head(limit + 1))
        status, headers, body = read_answer(sock)
        assert (status, error_code(body)) == (431, "request_head_too_large")
        assert str(limit) in orjson.loads(body)["error"]["message"]
        assert headers["connection"] == "close"
        assert closed_within(sock, 5)[0] == b""


def test_an_unfinished_head_is_431_as_soon_as_it_crosses_the_limit(edge_server):
    """No final CRLF: the server cannot wait for the end of the head to judge it."""
    with closing(connect(edge_server)) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * settings.HTTP_MAX_HEAD_BYTES
        )
        started = time.monotonic()
        status, _, body = read_answer(sock)
        assert (status, error_code(body)) == (431, "request_head_too_large")
        assert time.monotonic() - started < HEAD_TIMEOUT_S


def test_64_mb_headers_are_cut_off_while_other_clients_are_served(edge_server):
    """The attack of issue 29 (a 64 MB header took the event loop): connection after connection
    sends a 64 MB header; each is cut off after about the limit (plus what the kernel's socket
    buffers held), and another client's requests meanwhile take what they take alone."""
    alone = []
    for _ in range(5):
        started = time.monotonic()
        health_is_served(edge_server)
        alone.append(time.monotonic() - started)
    stop = threading.Event()
    outcomes: list[tuple[int, BaseException | None]] = []

    def send_huge_headers() -> None:
        while not stop.is_set():
            sent = 0
            with closing(connect(edge_server)) as sock:
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                    piece = b"a" * 65536
                    while sent < 64 * 1024 * 1024:
                        sock.sendall(piece)
                        sent += len(piece)
                    outcomes.append((sent, None))
                except OSError as error:
                    outcomes.append((sent, error))

    sender = threading.Thread(target=send_huge_headers)
    sender.start()
    during = []
    try:
        for _ in range(20):
            started = time.monotonic()
            health_is_served(edge_server)
            during.append(time.monotonic() - started)
    finally:
        stop.set()
        sender.join(60)
    assert outcomes and all(isinstance(error, ConnectionError) for _, error in outcomes), outcomes
    # The kernel takes a few MB into the socket buffers on loopback before the server reads any.
    assert max(sent for sent, _ in outcomes) < 16 * 1024 * 1024, outcomes
    assert max(during) < 10 * max(alone) + 0.5, (during, alone)


def test_more_header_fields_than_the_limit_is_431(edge_server):
    limit = settings.HTTP_MAX_HEADERS
    fields = [f"X-Field-{index}: {index}" for index in range(limit - 1)]  # Host makes `limit`
    with closing(connect(edge_server)) as sock:
        sock.sendall(head("GET", "/health", *fields))
        assert read_answer(sock)[0] == 200
    with closing(connect(edge_server)) as sock:
        sock.sendall(head("GET", "/health", *fields, "X-One-More: 1"))
        status, _, body = read_answer(sock)
        assert (status, error_code(body)) == (431, "too_many_headers")


# --- Slow and silent clients ----------------------------------------------------------------------


def test_half_a_request_line_is_408_and_closed_at_the_head_timeout(edge_server):
    with closing(connect(edge_server)) as sock:
        sock.sendall(b"GET /hea")
        received, after = closed_within(sock, HEAD_TIMEOUT_S + LATE_S + 5)
    assert HEAD_TIMEOUT_S - 0.1 <= after <= HEAD_TIMEOUT_S + LATE_S, after
    status_line = received.split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 408 Request Timeout", received[:200]
    assert error_code(received.partition(b"\r\n\r\n")[2]) == "request_timeout"


def test_a_trickled_head_is_cut_at_the_head_timeout_however_often_bytes_come(edge_server):
    request = head("GET", "/health")
    with closing(connect(edge_server)) as sock:
        started = time.monotonic()
        sent = 0
        try:
            while sent < len(request) - 1 and time.monotonic() - started < HEAD_TIMEOUT_S + LATE_S + 5:
                sock.sendall(request[sent : sent + 1])
                sent += 1
                time.sleep(0.2)
        except OSError:
            pass
        received, _ = closed_within(sock, HEAD_TIMEOUT_S + LATE_S + 5)
    took = time.monotonic() - started
    assert sent < len(request) - 1, "the whole head was sent before the server gave up"
    assert HEAD_TIMEOUT_S - 0.1 <= took <= HEAD_TIMEOUT_S + LATE_S + 0.2, took
    assert received.startswith(b"HTTP/1.1 408"), received[:100]


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(edge_server):
    with closing(connect(edge_server)) as sock:
        received, after = closed_within(sock, HEAD_TIMEOUT_S + LATE_S + 5)
    assert received == b""
    assert HEAD_TIMEOUT_S - 0.1 <= after <= HEAD_TIMEOUT_S + LATE_S, after


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(edge_server):
    with closing(connect(edge_server)) as sock:
        sock.sendall(head("GET", "/health"))
        status, headers, _ = read_answer(sock)
        assert status == 200 and headers.get("connection") != "close"
        received, after = closed_within(sock, KEEPALIVE_S + LATE_S + 5)
    assert received == b""
    assert KEEPALIVE_S - 0.1 <= after <= KEEPALIVE_S + LATE_S, after


def test_hundreds_of_half_requests_are_all_closed_and_the_server_serves_meanwhile(edge_server):
    """Issue 29's probe: 1,500 connections that sent half a request line were all still open after
    65 s. Here 300 of them (more than the 64 the server holds): the oldest make room for newer ones,
    every one is closed within the head timeout, and a normal request is served meanwhile."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(closing(connect(edge_server))) for _ in range(300)]
        for sock in sockets:
            sock.sendall(b"POST /v1/embe")
        started = time.monotonic()
        health_is_served(edge_server)
        for sock in sockets:
            closed_within(sock, max(0.1, started + HEAD_TIMEOUT_S + LATE_S + 1 - time.monotonic()))
    health_is_served(edge_server)


# --- The connection cap -----------------------------------------------------------------------------


def test_past_the_cap_the_longest_idle_connection_makes_room(edge_server):
    with ExitStack() as stack:
        idle = [stack.enter_context(closing(connect(edge_server))) for _ in range(MAX_CONNECTIONS)]
        time.sleep(0.2)  # all accepted
        newcomer = stack.enter_context(closing(connect(edge_server)))
        newcomer.sendall(head("GET", "/health"))
        assert read_answer(newcomer)[0] == 200
        # The oldest idle connection was closed for it, without an answer.
        assert closed_within(idle[0], 5)[0] == b""


def test_past_the_cap_with_every_connection_busy_a_newcomer_is_503_at_once(edge_server):
    """Busy: each has sent a head and is sending its body (Django's admin login here, which takes
    the API's body timeouts): none may be closed for a newcomer, which is answered 503 at once."""
    with ExitStack() as stack:
        busy = [stack.enter_context(closing(connect(edge_server))) for _ in range(MAX_CONNECTIONS)]
        for sock in busy:
            sock.sendall(
                head("POST", "/admin/login/", "Content-Type: text/plain", "Content-Length: 100") + b"x"
            )
        time.sleep(0.2)
        started = time.monotonic()
        newcomer = stack.enter_context(closing(connect(edge_server)))
        received, _ = closed_within(newcomer, 5)
        assert time.monotonic() - started < BODY_IDLE_S, "answered only once a busy connection ended"
        status_line, _, rest = received.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 503 Service Unavailable", received[:200]
        assert b"\r\nretry-after: 1\r\n" in rest
        assert error_code(rest.partition(b"\r\n\r\n")[2]) == "too_many_connections"
        # The busy ones end with the body timeout (408), and room comes back.
        assert read_answer(busy[0])[0] == 408
    health_is_served(edge_server)


# --- Bodies -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces", [[b"ffffffffffffffff\r\n"], [b"fffffff", b"fffffffff\r\n"]], ids=["whole", "split"]
)
def test_a_chunk_larger_than_the_body_limit_is_413_at_once(edge_server, pieces):
    """Issue 29: a chunk-size line of ffffffffffffffff waited for the body idle timeout (408)."""
    with closing(connect(edge_server)) as sock:
        sock.sendall(
            head(
                "POST", "/v1/embeddings", f"Authorization: Bearer {edge_server.api_key}",
                "Content-Type: application/json", "Transfer-Encoding: chunked",
            )
        )  # fmt: skip
        started = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.1)
        status, headers, body = read_answer(sock)
        assert (status, error_code(body)) == (413, "payload_too_large")
        assert time.monotonic() - started < BODY_IDLE_S
        assert headers["connection"] == "close"


def test_a_chunk_within_the_limit_is_read(edge_server):
    body = orjson.dumps({"model": "all-MiniLM-L6-v2", "input": "hello"})
    with closing(connect(edge_server)) as sock:
        sock.sendall(
            head(
                "POST", "/v1/embeddings", f"Authorization: Bearer {edge_server.api_key}",
                "Content-Type: application/json", "Transfer-Encoding: chunked",
            )
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        )  # fmt: skip
        assert read_answer(sock)[0] == 200


def test_the_admin_reads_a_stalled_body_under_the_api_timeout(edge_server):
    """Django's own handler waited forever for a body that never came."""
    with closing(connect(edge_server)) as sock:
        sock.sendall(head("POST", "/admin/login/", "Content-Type: text/plain", "Content-Length: 100"))
        started = time.monotonic()
        status, _, body = read_answer(sock)
        assert (status, error_code(body)) == (408, "request_timeout")
        assert BODY_IDLE_S - 0.1 <= time.monotonic() - started <= BODY_IDLE_S + LATE_S


# --- Responses a client does not read -----------------------------------------------------------------


def test_a_response_its_client_stopped_reading_is_cut_after_the_write_timeout(edge_server):
    """~8 MB of float vectors for a client that reads nothing: more than the kernel's socket buffers
    take (tcp_wmem's 4 MB), so the response's sender waits, until the server drops it and the
    connection once nothing has moved for the write timeout."""
    body = orjson.dumps({"model": "all-MiniLM-L6-v2", "input": [f"text {index}" for index in range(1024)]})
    with closing(connect(edge_server, receive_buffer=4096)) as sock:
        sock.sendall(
            head(
                "POST", "/v1/embeddings", f"Authorization: Bearer {edge_server.api_key}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
            )
            + body
        )  # fmt: skip
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        assert b"\r\ntransfer-encoding: chunked\r\n" in first  # streamed: the server holds the rest
        time.sleep(WRITE_TIMEOUT_S + LATE_S)  # reading nothing
        received, _ = closed_within(sock, 30)
    # Closed before the last chunk: ~6 MB of the ~8 MB were never sent.
    assert not received.endswith(b"\r\n0\r\n\r\n")
    assert len(first) + len(received) < 7 * 1024 * 1024, len(received)
    health_is_served(edge_server)
