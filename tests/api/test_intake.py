"""Request bodies (embeddings/api/intake.py): read whole however they are framed, refused as they
cross their limit, timed out when they stall or crawl; in process (the ASGI application driven
directly) and through a real uvicorn on a socket (`edge_server`: 64 KiB bodies, 256 KiB uploads,
1 s idle, 3 s in all)."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from embeddings.api import intake
from tests.api.conftest import EDGE_LIMITS
from tests.api.raw_http import asgi_request, json_pieces, upload_parts
from tests.api.test_embeddings import assert_error

MODEL = "all-MiniLM-L6-v2"
MODEL_PART = ("model", None, MODEL.encode(), None)


# --- In process -----------------------------------------------------------------------------------


async def test_a_body_without_content_length_is_read_in_process(alpha):
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json"},
        pieces=json_pieces({"model": MODEL, "input": ["one", "two"]}, 7),
    )
    assert answer.status == 200, answer.body
    assert len(json.loads(answer.body)["data"]) == 2


async def test_a_declared_length_over_the_limit_is_413_before_reading(alpha, settings):
    settings.MAX_REQUEST_BODY_BYTES = 2048
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json", "Content-Length": "2049"},
        pieces=[b"x" * 2049],
    )
    assert answer.status == 413 and answer.error()["code"] == "payload_too_large"
    assert answer.pieces_read == 0
    assert answer.headers["connection"] == "close" and answer.headers["x-content-type-options"] == "nosniff"


async def test_an_oversized_body_is_refused_as_it_crosses_the_limit(alpha, settings):
    settings.MAX_REQUEST_BODY_BYTES = 4096
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json"},
        pieces=[b"x" * 1024] * 100,
    )
    assert answer.status == 413, answer.body
    # 4 pieces fit; the fifth crosses the limit; the other 95 are never read.
    assert answer.pieces_read == 5


async def test_an_upload_has_its_own_limit(alpha, settings):
    settings.MAX_REQUEST_BODY_BYTES = 4096
    settings.JOB_MAX_UPLOAD_BYTES = 64 * 1024
    body, content_type = upload_parts(("file", "t.txt", b"a line\n" * 4000, "text/plain"), MODEL_PART)
    headers = {**alpha.headers, "Content-Type": content_type}
    answer = await asgi_request("POST", "/v1/jobs", headers=headers, pieces=[body[:9000], body[9000:]])
    assert answer.status == 202, answer.body
    assert json.loads(answer.body)["counts"]["total"] == 4000
    too_big = b"x" * (64 * 1024 + intake.MULTIPART_ENVELOPE_BYTES + 1)
    answer = await asgi_request(
        "POST", "/v1/jobs", headers={**headers, "Content-Length": str(len(too_big))}, pieces=[too_big]
    )
    assert answer.status == 413 and answer.error()["param"] == "file" and answer.pieces_read == 0


async def test_a_stalled_body_is_408(alpha, settings):
    settings.REQUEST_BODY_IDLE_TIMEOUT_S = 0.3
    started = time.monotonic()
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json", "Content-Length": "100"},
        pieces=[b'{"model": '],
        stall=True,
    )
    assert time.monotonic() - started >= 0.3
    assert answer.status == 408 and answer.error()["code"] == "request_timeout", answer.body
    assert "no data for 0.3 s" in answer.error()["message"]
    assert answer.headers["connection"] == "close"


async def test_the_total_deadline_grows_with_the_size(settings):
    settings.REQUEST_BODY_TIMEOUT_S = 60
    settings.REQUEST_BODY_MIN_BYTES_PER_S = 256 * 1024
    limits = intake.body_limits({"method": "POST", "path": "/v1/embeddings", "headers": []})
    assert limits.allowed_seconds(0) == 60
    assert limits.allowed_seconds(16 * 1024 * 1024) == 60 + 64


async def test_a_large_body_is_spooled_to_disk(settings):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024
    pieces = [b"y" * 32 * 1024] * 8
    messages = iter(
        [
            {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
            for i, piece in enumerate(pieces)
        ]
    )

    async def receive():
        return next(messages)

    limits = intake.body_limits({"method": "POST", "path": "/v1/embeddings", "headers": []})
    body = await intake.read_request_body(receive, limits, None)
    try:
        assert body._rolled  # on disk, not in memory
        assert intake.body_length(body) == 256 * 1024 and body.read(4) == b"yyyy"
    finally:
        body.close()


@pytest.mark.parametrize("length", ["12a", "-1", "1, 2"])
async def test_a_malformed_content_length_is_400(alpha, length):
    answer = await asgi_request(
        "POST", "/v1/embeddings", headers={**alpha.headers, "Content-Length": length}, pieces=[b"{}"]
    )
    assert answer.status == 400 and answer.pieces_read == 0


async def test_a_query_string_that_is_not_utf8_is_400(client, alpha):
    response = await client.get("/v1/usage?start=%ff%fe", headers=alpha.headers)
    assert_error(response, 422, param="start")  # percent-escapes decode leniently: a bad date
    transport_scope_response = await asgi_request(
        "GET", "/v1/usage", headers=alpha.headers, query=b"start=\xff"
    )
    assert transport_scope_response.status == 400, transport_scope_response.body
    assert json.loads(transport_scope_response.body)["error"]["message"].startswith("The query string")


@pytest.mark.parametrize(
    ("encoding", "named"),
    [("gzip", "gzip"), ("br", "br"), ("identity, gzip", "gzip"), ("x-gzip, deflate", "x-gzip, deflate")],
)
async def test_a_compressed_body_is_415_before_reading(alpha, encoding, named):
    body = gzip.compress(json.dumps({"model": MODEL, "input": "x"}).encode())
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json", "Content-Encoding": encoding},
        pieces=[body],
    )
    assert answer.status == 415, answer.body
    error = answer.error()
    assert (
        error["code"] == "unsupported_content_encoding" and f"Content-Encoding {named} " in error["message"]
    )
    assert answer.pieces_read == 0 and answer.headers["connection"] == "close"


async def test_identity_is_no_encoding(alpha):
    answer = await asgi_request(
        "POST",
        "/v1/embeddings",
        headers={**alpha.headers, "Content-Type": "application/json", "Content-Encoding": "identity"},
        pieces=json_pieces({"model": MODEL, "input": "x"}, 1000),
    )
    assert answer.status == 200, answer.body


# --- Through a real uvicorn --------------------------------------------------------------------------


def test_a_gzip_body_is_415_naming_it_through_uvicorn(raw):
    """It was read as text: a 400 about surrogates. No client of ours compresses a request."""
    body = gzip.compress(json.dumps({"model": MODEL, "input": "compressed"}).encode())
    raw.head(
        "POST",
        "/v1/embeddings",
        {"Content-Type": "application/json", "Content-Encoding": "gzip", "Content-Length": str(len(body))},
    )
    raw.sock.sendall(body)
    status, headers, answer = raw.answer()
    assert status == 415, answer
    error = json.loads(answer)["error"]
    assert error["code"] == "unsupported_content_encoding" and "gzip" in error["message"]
    assert headers["connection"] == "close" and raw.closed_by_server()


def test_chunked_json_is_read_through_uvicorn(raw):
    raw.head("POST", "/v1/embeddings", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    for piece in json_pieces({"model": MODEL, "input": ["chunked", "body"]}, 5):
        raw.chunk(piece)
    raw.end_chunks()
    status, _, body = raw.answer()
    assert status == 200, body
    assert len(json.loads(body)["data"]) == 2


def test_chunked_upload_is_read_through_uvicorn(raw):
    body, content_type = upload_parts(("file", "t.txt", b"a line\n" * 3000, "text/plain"), MODEL_PART)
    raw.head("POST", "/v1/jobs", {"Content-Type": content_type, "Transfer-Encoding": "chunked"})
    for start in range(0, len(body), 4096):
        raw.chunk(body[start : start + 4096])
    raw.end_chunks()
    status, _, answer = raw.answer()
    assert status == 202, answer
    assert json.loads(answer)["counts"]["total"] == 3000


def test_chunked_json_over_the_limit_is_413(raw):
    raw.head("POST", "/v1/embeddings", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    limit = int(EDGE_LIMITS["MAX_REQUEST_BODY_BYTES"])
    raw.chunk(b"x" * (limit + 1))
    status, headers, body = raw.answer()
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == "payload_too_large"
    assert headers["connection"] == "close" and raw.closed_by_server()


def test_an_oversized_chunked_upload_is_cut_off_early(raw):
    """The 413 arrives while the client is still sending a body 256 times the limit: the server stops
    reading at the limit, answers and closes."""
    raw.head(
        "POST",
        "/v1/jobs",
        {"Content-Type": "multipart/form-data; boundary=x", "Transfer-Encoding": "chunked"},
    )
    intended = 256 * int(EDGE_LIMITS["JOB_MAX_UPLOAD_BYTES"])
    piece = b"y" * 16384
    sent = 0
    raw.sock.settimeout(10)
    try:
        while sent < intended:
            raw.chunk(piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    status, _, body = raw.answer()
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["param"] == "file" and error["code"] == "payload_too_large"
    assert sent < intended, "the whole body was accepted before the answer"


def test_a_declared_length_over_the_limit_is_413_before_the_body(raw):
    raw.head("POST", "/v1/embeddings", {"Content-Type": "application/json", "Content-Length": str(10**9)})
    status, headers, body = raw.answer()  # nothing of the body was sent
    assert status == 413, body
    assert headers["connection"] == "close" and raw.closed_by_server()


def test_a_short_body_times_out_with_408(raw):
    idle = float(EDGE_LIMITS["REQUEST_BODY_IDLE_TIMEOUT_S"])
    raw.head("POST", "/v1/embeddings", {"Content-Type": "application/json", "Content-Length": "100"})
    raw.sock.sendall(b'{"model": "all-MiniLM')
    started = time.monotonic()
    status, headers, body = raw.answer()
    assert time.monotonic() - started >= idle * 0.9
    assert status == 408, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == headers["x-request-id"]
    assert headers["connection"] == "close" and raw.closed_by_server()


def test_a_trickled_body_hits_the_total_deadline(raw):
    """One byte at a time, each within the idle timeout: the total deadline ends it."""
    idle = float(EDGE_LIMITS["REQUEST_BODY_IDLE_TIMEOUT_S"])
    total = float(EDGE_LIMITS["REQUEST_BODY_TIMEOUT_S"])
    raw.head("POST", "/v1/embeddings", {"Content-Type": "application/json", "Content-Length": "1000"})
    raw.sock.settimeout(idle / 3)
    started = time.monotonic()
    answer = b""
    while not answer:
        try:
            raw.sock.sendall(b" ")
            answer = raw.sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    raw.sock.settimeout(30)
    elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert elapsed >= total * 0.9
    assert b"took longer than" in answer or b"took longer than" in raw.sock.recv(65536)
