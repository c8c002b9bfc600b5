"""`manage.py serve` (the web server as `make run` starts it: real Triton, Redis, a socket) stopped by
SIGTERM: under steady load no accepted request is lost, and a request still unfinished at
SHUTDOWN_TIMEOUT_S is cut then. The drain's signal handling alone is unit tested at the bottom."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from django.conf import settings

from embeddings import lifecycle
from embedsite.server import DrainingServer, ServerConfig
from tests import onnx_reference
from tests.api.conftest import LiveServer, live_uvicorn
from tests.processes import children_of

HANG_S = 120  # against hanging only: no assertion depends on it
CLIENTS = 8  # half of them keep their connection alive, half open one per request
BATCHES = [
    [f"client text {batch}.{row} about shutting down gently" for row in range(6)] for batch in range(12)
]


class NoAnswer(Exception):
    """The connection ended (closed or reset) after `received` bytes of an answer."""

    def __init__(self, received: int):
        super().__init__(f"connection ended after {received} bytes of the answer")
        self.received = received


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def http_request(method: str, path: str, *, api_key: str = "", body: bytes = b"", keep_alive: bool) -> bytes:
    headers = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        f"Content-Length: {len(body)}",
    ]
    if api_key:
        headers += [f"Authorization: Bearer {api_key}", "Content-Type: application/json"]
    return "\r\n".join(headers).encode() + b"\r\n\r\n" + body


def embeddings_body(batch: int) -> bytes:
    return json.dumps({"model": settings.DEFAULT_EMBEDDING_MODEL, "input": BATCHES[batch]}).encode()


def read_answer(sock: socket.socket) -> Answer:
    """One HTTP/1.1 response (Content-Length or chunked); NoAnswer if the connection ends before it is
    whole."""
    data = bytearray()

    def until(marker: bytes, start: int) -> int:
        """The index of `marker` in data from `start`, reading more until it arrives."""
        while (found := data.find(marker, start)) < 0:
            more()
        return found

    def more() -> None:
        try:
            piece = sock.recv(65536)
        except (ConnectionResetError, ConnectionAbortedError):
            piece = b""
        if not piece:
            raise NoAnswer(len(data))
        data.extend(piece)

    head_end = until(b"\r\n\r\n", 0)
    status_line, *lines = data[:head_end].decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    position, body = head_end + 4, b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_end = until(b"\r\n", position)
            size = int(data[position:size_end].split(b";")[0], 16)
            position = size_end + 2
            while len(data) < position + size + 2:
                more()
            body += data[position : position + size]
            position += size + 2
            if size == 0:
                break
    else:
        length = int(headers["content-length"])
        while len(data) < position + length:
            more()
        body = bytes(data[position : position + length])
    return Answer(int(status_line.split()[1]), headers, bytes(body))


@dataclass
class Attempt:
    """One request a client tried to make, with monotonic times."""

    path: str
    batch: int | None
    keep_alive: bool
    client: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    reused: bool = False  # sent on a connection that had already carried a request
    sent_at: float | None = None  # the whole request written
    answered_at: float | None = None
    answer: Answer | None = None
    refused: bool = False  # connect() refused: the server no longer listens
    ended_after: int | None = None  # the connection ended after this many bytes of an answer


@dataclass
class Load:
    """Clients sending embedding requests back to back, and one asking /ready, until refused."""

    address: tuple[str, int]
    api_key: str
    attempts: list[Attempt] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(CLIENTS):
            self.threads.append(
                threading.Thread(target=self.client, args=(index, index % 2 == 0), daemon=True)
            )
        self.threads.append(threading.Thread(target=self.readiness, daemon=True))
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(HANG_S)
            assert not thread.is_alive(), "a client hung"

    def snapshot(self) -> list[Attempt]:
        with self.lock:
            return list(self.attempts)

    def attempt(self, attempt: Attempt, sock: socket.socket | None, request: bytes) -> socket.socket | None:
        """Make `attempt` on `sock` (a new connection if None); the connection to use next, if any."""
        with self.lock:
            self.attempts.append(attempt)
        try:
            if sock is None:
                sock = socket.create_connection(self.address, timeout=HANG_S)
            else:
                attempt.reused = True
            sock.sendall(request)
            attempt.sent_at = time.monotonic()
            attempt.answer = read_answer(sock)
            attempt.answered_at = time.monotonic()
        except ConnectionRefusedError:
            attempt.refused = True
            return None
        except (NoAnswer, BrokenPipeError, ConnectionResetError) as ended:
            attempt.ended_after = getattr(ended, "received", 0)
            sock.close()
            return None
        if not attempt.keep_alive or attempt.answer.headers.get("connection", "").lower() == "close":
            sock.close()
            return None
        return sock

    def client(self, index: int, keep_alive: bool) -> None:
        sock, sent = None, 0
        while True:
            batch = (index + sent * CLIENTS) % len(BATCHES)
            attempt = Attempt("/v1/embeddings", batch, keep_alive, client=index)
            request = http_request(
                "POST", attempt.path, api_key=self.api_key, body=embeddings_body(batch), keep_alive=keep_alive
            )
            sock = self.attempt(attempt, sock, request)
            sent += 1
            if attempt.refused:
                return

    def readiness(self) -> None:
        while True:
            attempt = Attempt("/ready", None, keep_alive=False)
            self.attempt(attempt, None, http_request("GET", "/ready", keep_alive=False))
            if attempt.refused:
                return
            time.sleep(0.05)


def embeddings_correct(answer: Answer, batch: int, reference: list[np.ndarray]) -> bool:
    data = sorted(json.loads(answer.body)["data"], key=lambda item: item["index"])
    vectors = np.array([item["embedding"] for item in data])
    return len(vectors) == len(BATCHES[batch]) and bool(
        (onnx_reference.row_cosines(vectors, reference[batch]) >= 0.9999).all()
    )


def server_address(server: LiveServer) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def test_sigterm_under_steady_load_loses_no_accepted_request(triton_server, redis_server, tmp_path):
    """Two worker processes, 8 clients sending embedding requests back to back (half on kept-alive
    connections); SIGTERM to the server (as Kubernetes sends it) while requests are in flight."""
    drain_s = 2.0
    reference = [
        onnx_reference.vectors_for_ids([onnx_reference.token_ids(text) for text in texts])
        for texts in BATCHES
    ]
    with live_uvicorn(
        workdir=tmp_path,
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=2,
        env={"SHUTDOWN_DRAIN_S": str(drain_s), "SHUTDOWN_TIMEOUT_S": "60"},
        as_shipped=True,
    ) as server:
        load = Load(server_address(server), server.api_key)
        load.start()
        # Steady: every client has been answered three times; then a moment with requests in flight.
        deadline = time.monotonic() + HANG_S
        while True:
            assert time.monotonic() < deadline, "the load never got going"
            attempts = load.snapshot()
            answered = [a.client for a in attempts if a.batch is not None and a.answer is not None]
            in_flight = [
                a for a in attempts if a.sent_at is not None and a.answer is None and a.batch is not None
            ]
            if min(answered.count(client) for client in range(CLIENTS)) >= 3 and len(in_flight) >= 2:
                break
            time.sleep(0.001)
        # Each worker tokenises on one thread (embedsite/server.py tokenize_on_one_thread).
        worker_environs = [
            Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for pid, name in children_of(server.process.pid).items()
            if name.startswith("python")
        ]
        assert len(worker_environs) >= 2
        assert all(b"TOKENIZERS_PARALLELISM=false" in environ for environ in worker_environs)
        signalled_at = time.monotonic()
        os.kill(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=drain_s + HANG_S)
        exited_at = time.monotonic()
        load.join()
        log = server.log_path.read_text()

    attempts = load.snapshot()
    embeddings = [a for a in attempts if a.batch is not None]
    before = [a for a in embeddings if a.sent_at is not None and a.sent_at < signalled_at]
    after = [a for a in embeddings if a not in before]
    in_flight_at_signal = [a for a in before if a.answered_at is None or a.answered_at > signalled_at]
    # Every request sent before the signal: answered, 200, the right vectors.
    lost = [a for a in before if a.answer is None or a.answer.status != 200]
    assert lost == [], f"{len(lost)} accepted requests lost: {lost[:3]}\n{log[-3000:]}"
    assert all(embeddings_correct(a.answer, a.batch, reference) for a in before)
    assert in_flight_at_signal, "the signal found nothing in flight"
    # Every later one: answered the same way, or never accepted (refused, or the connection ended
    # before a single byte of an answer: nothing half done).
    answered_after = [a for a in after if a.answer is not None]
    assert all(
        a.answer.status == 200 and embeddings_correct(a.answer, a.batch, reference) for a in answered_after
    )
    unanswered_after = [a for a in after if a.answer is None]
    assert all(a.refused or a.ended_after == 0 for a in unanswered_after), unanswered_after
    # While draining, requests were still served, and /ready said 503 to take the process out.
    readiness = [a for a in attempts if a.path == "/ready" and a.answer is not None]
    shutting_down = [a for a in readiness if json.loads(a.answer.body).get("failed") == ["shutdown"]]
    # Answered after the signal (a poll sent just before it may be handled after it, under load).
    assert shutting_down and all(
        a.answer.status == 503 and a.answered_at > signalled_at for a in shutting_down
    )
    first_503_at = min(a.answered_at for a in shutting_down)
    assert any(a.sent_at > first_503_at for a in answered_after), "nothing was served while draining"
    # Every kept-alive connection was closed by an answer while draining, so its client reconnected.
    kept_alive = {a.client for a in embeddings if a.keep_alive}
    closed_by_answer = {
        a.client for a in answered_after if a.keep_alive and a.answer.headers.get("connection") == "close"
    }
    assert closed_by_answer == kept_alive
    # Refused, but only once the drain was over (never earlier: load can only delay it); both
    # workers drained.
    refused = [a for a in attempts if a.refused]
    assert len(refused) == CLIENTS + 1  # each client and the /ready poller end on a refusal
    first_refused_at = min(a.started_at for a in refused)
    assert first_refused_at - signalled_at >= drain_s
    last_answer_at = max(a.answered_at for a in attempts if a.answered_at is not None)
    assert log.count("Draining for") == 2, log[-3000:]
    assert "timeout graceful shutdown exceeded" not in log and "Exception in ASGI" not in log
    assert server.process.returncode == 0
    print(
        f"\nSIGTERM under load: {len(before)} requests sent before it, {len(in_flight_at_signal)} in flight "
        f"at the signal, all 200; {len(answered_after)} sent after it answered 200 (drain {drain_s:g} s), "
        f"{len(unanswered_after)} refused or never accepted "
        f"({sum(a.refused for a in unanswered_after)} refused); "
        f"first refusal {first_refused_at - signalled_at:.2f} s after the signal, last answer "
        f"{last_answer_at - signalled_at:.2f} s, exit {exited_at - signalled_at:.2f} s"
    )


def send_half(address: tuple[str, int], api_key: str, batch: int) -> tuple[socket.socket, bytes]:
    """A connection with an embeddings request whose body is half sent; the other half, to send."""
    request = http_request(
        "POST", "/v1/embeddings", api_key=api_key, body=embeddings_body(batch), keep_alive=False
    )
    sock = socket.create_connection(address, timeout=HANG_S)
    half = len(request) - len(embeddings_body(batch)) // 2
    sock.sendall(request[:half])
    return sock, request[half:]


def test_requests_in_flight_finish_after_sigterm_until_the_timeout(triton_server, redis_server, tmp_path):
    """One worker process, no drain, SHUTDOWN_TIMEOUT_S=3: of two requests whose bodies are half sent at
    SIGTERM, the one completed afterwards is answered; the other is cut at the timeout, and then the
    process exits."""
    timeout_s = 3.0
    reference = onnx_reference.vectors_for_ids([onnx_reference.token_ids(text) for text in BATCHES[0]])
    with live_uvicorn(
        workdir=tmp_path,
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env={
            "SHUTDOWN_DRAIN_S": "0",
            "SHUTDOWN_TIMEOUT_S": str(timeout_s),
            # The body timeouts must not end the stalled request before shutdown does.
            "REQUEST_BODY_IDLE_TIMEOUT_S": "600",
            "REQUEST_BODY_TIMEOUT_S": "600",
            "REQUEST_BODY_MIN_BYTES_PER_S": "1",
        },
        as_shipped=True,
    ) as server:
        address = server_address(server)
        finishing, rest = send_half(address, server.api_key, 0)
        stalled, _ = send_half(address, server.api_key, 1)
        # Both have reached the application: it waits for their bodies (the log says nothing yet).
        with contextlib.closing(socket.create_connection(address, timeout=HANG_S)) as probe:
            probe.sendall(http_request("GET", "/health", keep_alive=False))
            assert read_answer(probe).status == 200
        signalled_at = time.monotonic()
        os.kill(server.process.pid, signal.SIGTERM)
        # Stopped accepting: new connections are refused (wait for it: the server notices within a tick).
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                socket.create_connection(address, timeout=HANG_S).close()
            except ConnectionRefusedError:
                refused_at = time.monotonic()
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        finishing.sendall(rest)
        answer = read_answer(finishing)
        assert answer.status == 200 and answer.headers["connection"] == "close"
        assert embeddings_correct(answer, 0, [reference])
        answered_at = time.monotonic()
        cut = read_answer(stalled)
        cut_at = time.monotonic()
        server.process.wait(timeout=HANG_S)
        exited_at = time.monotonic()
        log = server.log_path.read_text()
    assert cut.status == 503, (cut, log[-2000:])
    assert json.loads(cut.body)["error"]["code"] == "shutting_down"
    assert cut_at - signalled_at >= timeout_s
    assert "timeout graceful shutdown exceeded" in log
    # uvicorn stops a single process by re-raising the signal once it has shut down.
    assert server.process.returncode == -signal.SIGTERM
    print(
        f"\nSIGTERM with two requests in flight: new connections refused after "
        f"{refused_at - signalled_at:.2f} s, the finishing one answered after "
        f"{answered_at - signalled_at:.2f} s, "
        f"the stalled one cut after {cut_at - signalled_at:.2f} s (timeout {timeout_s:g} s), "
        f"exit after {exited_at - signalled_at:.2f} s"
    )


# --- The drain's signal handling, alone ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def draining_server(monkeypatch) -> tuple[DrainingServer, Clock]:
    clock = Clock()
    monkeypatch.setattr(DrainingServer, "clock", clock, raising=True)
    config = ServerConfig(host="127.0.0.1", port=1, workers=1, drain_s=5, timeout_s=1)
    yield DrainingServer(config), clock
    lifecycle.shutdown_reset()


@pytest.mark.unit
async def test_the_drain_holds_uvicorns_exit_until_it_is_over(draining_server):
    server, clock = draining_server
    server.handle_exit(signal.SIGTERM, None)
    assert lifecycle.shutting_down() and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)  # delivered again (a process-group kill): nothing changes
    clock.now += 4.9
    assert await server.on_tick(1) is False and not server.should_exit
    clock.now += 0.2
    assert await server.on_tick(2) is True and server.should_exit and not server.force_exit


@pytest.mark.unit
async def test_ctrl_c_during_the_drain_stops_at_once(draining_server):
    server, _ = draining_server
    server.handle_exit(signal.SIGINT, None)
    assert not server.should_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit


@pytest.mark.unit
def test_without_a_drain_the_first_signal_is_uvicorns(monkeypatch):
    config = ServerConfig(host="127.0.0.1", port=1, workers=1, drain_s=0, timeout_s=1)
    server = DrainingServer(config)
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit and lifecycle.shutting_down()
    finally:
        lifecycle.shutdown_reset()
