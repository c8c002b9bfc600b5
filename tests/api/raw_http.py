"""Speaking HTTP below a client library, for requests a client library would repair (add a
Content-Length, refuse to send a short body, stop at an early answer): the ASGI application called
as a server calls it, and HTTP/1.1 on a plain socket."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from tests.api.conftest import LiveServer


def upload_parts(*parts: tuple[str, str | None, bytes, str | None]) -> tuple[bytes, str]:
    """A multipart body from (name, filename, content, content type) parts, as a raw client sends it."""
    boundary = "edge-boundary-1234"
    body = b""
    for name, filename, content, content_type in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if content_type:
            body += f"Content-Type: {content_type}\r\n".encode()
        body += b"\r\n" + content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class AsgiAnswer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, pieces_read: int):
        self.status, self.headers, self.body, self.pieces_read = status, headers, body, pieces_read

    def error(self) -> dict:
        return json.loads(self.body)["error"]


async def asgi_request(
    method: str,
    path: str,
    *,
    headers: dict[str, str],
    pieces: list[bytes] = (),
    stall: bool = False,
    query: bytes = b"",
) -> AsgiAnswer:
    """Drive the ASGI application as a server would: the body in `pieces` (no Content-Length unless
    `headers` has one, as a chunked body arrives), then, with `stall`, a client that stops sending."""
    from embedsite.asgi import application

    all_headers = {"host": "testserver", **headers}
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
        "headers": [(name.lower().encode(), value.encode()) for name, value in all_headers.items()],
    }  # fmt: skip
    remaining = list(pieces)
    read = 0
    messages: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        if remaining:
            read += 1
            piece = remaining.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(remaining) or stall}
        await asyncio.Event().wait()  # the client sends nothing more and stays connected

    async def send(message: dict) -> None:
        messages.append(message)

    await asyncio.wait_for(application(scope, receive, send), timeout=60)
    start = messages[0]
    body = b"".join(message.get("body", b"") for message in messages[1:])
    answer_headers = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    return AsgiAnswer(start["status"], answer_headers, body, read)


def json_pieces(body: object, size: int) -> list[bytes]:
    raw = json.dumps(body).encode()
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def dechunked(data: bytes) -> bytes:
    body = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, data = body + data[:size], data[size + 2 :]
    return body


class RawHttp:
    """One HTTP/1.1 connection on a plain socket."""

    def __init__(self, server: LiveServer):
        address = urlsplit(server.base_url)
        self.sock = socket.create_connection((address.hostname, address.port), timeout=30)
        self.key = server.api_key

    def __enter__(self) -> RawHttp:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def head(self, method: str, path: str, headers: dict[str, str], *, host: str = "127.0.0.1") -> None:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {self.key}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def chunk(self, data: bytes) -> None:
        self.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def end_chunks(self) -> None:
        self.sock.sendall(b"0\r\n\r\n")

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of the response (read to its Content-Length, or to the close)."""
        data = b""
        while b"\r\n\r\n" not in data:
            piece = self.sock.recv(65536)
            if not piece:
                raise ConnectionError(f"closed before an answer: {data!r}")
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        chunked = headers.get("transfer-encoding") == "chunked"
        length = 0 if status in (204, 304) else int(headers.get("content-length", -1))
        while not (body.endswith(b"0\r\n\r\n") if chunked else 0 <= length <= len(body)):
            piece = self.sock.recv(65536)
            if not piece:
                break
            body += piece
        return status, headers, dechunked(body) if chunked else body

    def closed_by_server(self) -> bool:
        self.sock.settimeout(10)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


# --- Plain sockets, one request at a time ----------------------------------------------------------


def connect(server: LiveServer, *, receive_buffer: int | None = None) -> socket.socket:
    address = urlsplit(server.base_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect((address.hostname, address.port))
    return sock


def head(method: str, path: str, *fields: str) -> bytes:
    """A request head as a careful client writes it: `Name: value` lines, CRLFs, Host first."""
    return "".join(
        f"{line}\r\n" for line in (f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *fields)
    ).encode() + (b"\r\n")


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, headers, body read to its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += piece
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    chunked = headers.get("transfer-encoding") == "chunked"
    length = int(headers.get("content-length", 0))
    while not body.endswith(b"0\r\n\r\n") if chunked else len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return int(status_line.split()[1]), headers, dechunked(body) if chunked else body


def closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was (from now)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    received = b""
    try:
        while piece := sock.recv(65536):
            received += piece
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s; received {received[:200]!r}") from None
    return received, time.monotonic() - started


def error_code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]
