"""No API key in any log line, through the real server (`manage.py serve`, as runstack starts it) on a
real socket, in both log formats: a real key sent in every place a client might put one, refused or
not, and then every line the server wrote searched for it."""

from __future__ import annotations

import base64
import contextlib
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from embeddings.consumers import CLOSE_NOT_FOUND, CLOSE_UNAUTHORIZED, SUBPROTOCOL
from embeddings.services.accounts.api_keys import parse_api_key
from tests.api.conftest import LiveServer, live_uvicorn

# Against hanging only: how long the server may take to write the lines of requests it answered.
LOG_DEADLINE_S = 20


@pytest.fixture(scope="module")
def json_server(triton_server, redis_server, tmp_path_factory) -> Iterator[LiveServer]:
    """One worker writing JSON lines, DEBUG included: what libraries log below INFO counts too."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("json_log_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env={"LOG_FORMAT": "json", "LOG_LEVEL": "DEBUG"},
    ) as server:
        yield server


@pytest.fixture(params=["text", "json"])
def server(request) -> LiveServer:
    """The session's text-logging server (`uvicorn_server`, two workers) or the JSON one."""
    return request.getfixturevalue("uvicorn_server" if request.param == "text" else "json_server")


def every_way_to_send(key: str) -> list[tuple[str, str, dict[str, str], bytes | None]]:
    """(method, path, headers, body): the key in each place a client might put it. Only the first
    is how our API takes it; every other one is refused (401, 404, 400) and must not be logged
    either."""
    bearer = {"Authorization": f"Bearer {key}"}
    # Every character of the key percent-encoded: decoded, the path is the key again.
    encoded = "".join(f"%{byte:02X}" for byte in key.encode())
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    return [
        ("GET", "/v1/models", bearer, None),
        ("GET", f"/v1/models?api_key={key}", {}, None),
        ("GET", f"/v1/models?limit=1&key={key}", {}, None),
        ("GET", f"/v1/models?token={key}", {}, None),
        ("GET", f"/v1/models?access_token={key}", {}, None),
        ("GET", f"/v1/models?Authorization=Bearer%20{key}", {}, None),
        ("GET", f"/v1/models?API%5FKEY={key}", {}, None),  # a percent-encoded name
        ("GET", f"/v1/models?q={key}", {}, None),  # a name we know nothing of: the key's shape tells
        ("GET", f"/v1/jobs/{key}", bearer, None),
        ("GET", f"/v1/jobs/{key}", {}, None),
        ("GET", f"/v1/models/{key}", bearer, None),
        ("GET", f"/v1/jobs/{encoded}", bearer, None),
        ("GET", f"/{key}", {}, None),
        ("GET", "/v1/models", {"Authorization": f"Basic {basic}"}, None),
        ("GET", "/v1/models", {"Authorization": key}, None),
        ("GET", "/v1/models", {"X-Api-Key": key, "Api-Key": key}, None),
        ("GET", "/v1/models", {"Cookie": f"api_key={key}; session={key}"}, None),
        ("GET", "/v1/models", {"Host": key}, None),
        (
            "POST",
            "/v1/embeddings",
            {**bearer, "Content-Type": "application/json"},
            f'{{"input": "{key}'.encode(),
        ),
        ("POST", "/v1/embeddings", {"Content-Type": "application/json"}, f'{{"input": "{key}"}}'.encode()),
    ]


def websocket_attempts(key: str) -> list[tuple[str, dict]]:
    """(path, connect() options): the job WebSocket with the key as a query parameter (never
    accepted: refused with 4401), as the browser's subprotocol and in the header (both accepted; the
    job does not exist: 4404), as Basic credentials and a cookie (refused: 4401), and in a path outside
    the routes (refused at the handshake). uvicorn logs the handshake's path with its query string
    and, at DEBUG, every header."""
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    return [
        (f"/ws/v1/jobs/job_nosuchjob?api_key={key}", {}),
        (f"/ws/v1/jobs/job_nosuchjob?token={key}&x=1", {}),
        ("/ws/v1/jobs/job_nosuchjob", {"subprotocols": [SUBPROTOCOL, f"bearer.{key}"]}),
        ("/ws/v1/jobs/job_nosuchjob", {"additional_headers": {"Authorization": f"Bearer {key}"}}),
        (
            "/ws/v1/jobs/job_nosuchjob",
            {"additional_headers": {"Authorization": f"Basic {basic}", "Cookie": f"api_key={key}"}},
        ),
        (f"/ws/{key}", {}),
    ]


def _websocket(server: LiveServer, path: str, options: dict, request_id: str) -> int | None:
    """The close code the server sent, or None when it refused the handshake."""
    url = server.base_url.replace("http://", "ws://") + path
    headers = {**options.get("additional_headers", {}), "X-Request-Id": request_id}
    try:
        with connect(url, **{**options, "additional_headers": headers}) as websocket:
            with contextlib.suppress(ConnectionClosed):
                websocket.recv(timeout=30)
            return websocket.close_code
    except InvalidStatus:
        return None


def _wait_for_lines(log_path: Path, request_ids: list[str]) -> str:
    """The log once it names every request id (each request's access line is written after its
    response: a moment after the client has it)."""
    deadline = time.monotonic() + LOG_DEADLINE_S
    while True:
        text = log_path.read_text(errors="replace")
        missing = [request_id for request_id in request_ids if request_id not in text]
        if not missing:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"no access line for {missing}")
        time.sleep(0.1)


def test_a_key_sent_anywhere_is_in_no_log_line(server: LiveServer):
    key = server.api_key
    public_id, secret = parse_api_key(key)
    run = uuid.uuid4().hex[:8]
    request_ids = []
    answers = []
    for number, (method, path, headers, body) in enumerate(every_way_to_send(key)):
        request_id = f"leak-{run}-{number}"
        request_ids.append(request_id)
        answer = httpx2.request(
            method,
            server.base_url + path,
            headers={"X-Request-Id": request_id, **headers},
            content=body,
            timeout=30,
        )
        answers.append((path, answer.status_code))
    # Only the bearer header authenticates; everything else is refused, and the refusals are logged.
    assert answers[0][1] == 200
    assert {status for _, status in answers[1:]} <= {400, 401, 404}, answers
    # A key sent as the request id is not kept: a fresh id replaces it (as for any insane id).
    answer = httpx2.get(f"{server.base_url}/v1/models", headers={"X-Request-Id": key}, timeout=30)
    assert answer.headers["x-request-id"] != key
    assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"])
    request_ids.append(answer.headers["x-request-id"])
    closes = []
    for number, (path, options) in enumerate(websocket_attempts(key)):
        request_id = f"leak-{run}-ws-{number}"
        request_ids.append(request_id)
        closes.append(_websocket(server, path, options, request_id))
    # A key in the query string is never taken (only the header and the subprotocol are): 4401.
    assert closes == [CLOSE_UNAUTHORIZED] * 2 + [CLOSE_NOT_FOUND] * 2 + [CLOSE_UNAUTHORIZED, None]

    text = _wait_for_lines(server.log_path, request_ids)
    # The authenticated request's lines name the key by its public id, as they should.
    assert f"key_id={public_id}" in text or f'"key_id": "{public_id}"' in text
    found = {
        "the key": key,
        "public id and secret": f"{public_id}_{secret}",
        "the secret": secret,
        # Any long piece of the secret, in case a line cut or encoded it at its "_" or "-".
        **{
            f"a piece of the secret ({piece})": piece for piece in re.split("[_-]", secret) if len(piece) >= 8
        },
        "the Basic credentials": base64.b64encode(f"user:{key}".encode()).decode(),
    }
    leaks = {
        what: [line for line in text.splitlines() if value in line][:3]
        for what, value in found.items()
        if value in text
    }
    assert leaks == {}
