"""WS /ws/v1/jobs/<id> through uvicorn as shipped (`--ws websockets-sansio`) on a real socket, with a
real WebSocket client: both ways to send the key, every refusal's close code, and the progress of a
job that a real Celery worker runs (the worker publishes every event; this test publishes none)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx2
import orjson
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from embeddings.consumers import CLOSE_NORMAL, CLOSE_NOT_FOUND, CLOSE_UNAUTHORIZED, SUBPROTOCOL
from tests.job_stack import JobStack, job_stack_running
from tests.processes import manage_commands, process_group_paused

MODEL = "all-MiniLM-L6-v2"
CHUNK_SIZE = 4
# Ten chunks: the worker publishes after the first (its events are throttled to one per 0.5 s per
# job after that) and at the end, so a watcher sees counts strictly between 0 and the total.
TEXTS = [f"watched text {i}: {'words about vectors ' * (i % 5)}" for i in range(10 * CHUNK_SIZE)]
# Deadlines against hanging only (never timings): generous for a loaded machine.
RECEIVE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("websocket_stack"),
        chunk_size=CHUNK_SIZE,
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def other_tenant_key(job_stack) -> str:
    _, key = manage_commands(
        job_stack.env,
        ("create_tenant", "--name", "Other", "--slug", "other"),
        ("create_api_key", "--tenant", "other"),
    )
    return key


def ws_url(stack: JobStack, job_id: str) -> str:
    return f"{stack.base_url.replace('http://', 'ws://')}/ws/v1/jobs/{job_id}"


def submit(stack: JobStack, texts: list[str]) -> str:
    response = httpx2.post(
        f"{stack.base_url}/v1/jobs", json={"model": MODEL, "input": texts}, headers=stack.headers, timeout=60
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def messages_until_closed(websocket: ClientConnection) -> tuple[list[dict], int | None]:
    """Every message the server sends, then the close code it sent."""
    messages = []
    with contextlib.suppress(ConnectionClosed):
        while True:
            messages.append(orjson.loads(websocket.recv(timeout=RECEIVE_TIMEOUT_S)))
    return messages, websocket.close_code


def test_a_watcher_sees_the_worker_progress_then_a_normal_close(job_stack):
    """Connected (by header) before the worker starts the job: the queued state at once, then the
    worker's own events with counts going up, the finished job last, then close 1000."""
    with contextlib.ExitStack() as cleanup:
        with process_group_paused(job_stack.worker):
            job_id = submit(job_stack, TEXTS)
            websocket = cleanup.enter_context(
                connect(ws_url(job_stack, job_id), additional_headers=job_stack.headers)
            )
            first = orjson.loads(websocket.recv(timeout=RECEIVE_TIMEOUT_S))
            assert first["type"] == "job.progress"
            assert first["job"]["id"] == job_id
            assert first["job"]["status"] == "queued"
            assert first["job"]["counts"] == {"total": len(TEXTS), "completed": 0, "failed": 0}
        messages, close_code = messages_until_closed(websocket)
    assert close_code == CLOSE_NORMAL, job_stack.logs_tail()
    assert all(message["type"] == "job.progress" for message in messages)
    completed = [message["job"]["counts"]["completed"] for message in messages]
    assert completed == sorted(completed), completed
    assert any(0 < count < len(TEXTS) for count in completed), f"no progress between: {completed}"
    assert messages[-1]["job"]["status"] == "completed"
    assert completed[-1] == len(TEXTS)


def test_the_browser_subprotocol_authenticates_and_is_echoed(job_stack):
    job_id = submit(job_stack, TEXTS[:2])
    with connect(
        ws_url(job_stack, job_id), subprotocols=[SUBPROTOCOL, f"bearer.{job_stack.api_key}"]
    ) as websocket:
        assert websocket.subprotocol == SUBPROTOCOL
        messages, close_code = messages_until_closed(websocket)
    assert messages and messages[0]["job"]["id"] == job_id
    assert messages[-1]["job"]["status"] == "completed"
    assert close_code == CLOSE_NORMAL


@pytest.mark.parametrize(
    "credentials",
    [
        {"additional_headers": {"Authorization": "Bearer emb_nope_notakey"}},
        {"subprotocols": [SUBPROTOCOL, "bearer.emb_nope_notakey"]},
        {"subprotocols": [SUBPROTOCOL]},  # no key at all
    ],
    ids=["bad-header", "bad-subprotocol", "no-key"],
)
def test_a_bad_or_missing_key_closes_with_4401(job_stack, credentials):
    job_id = submit(job_stack, TEXTS[:1])
    with connect(ws_url(job_stack, job_id), **credentials) as websocket:
        messages, close_code = messages_until_closed(websocket)
    assert (messages, close_code) == ([], CLOSE_UNAUTHORIZED)


def test_another_tenants_job_and_an_unknown_job_close_with_4404(job_stack, other_tenant_key):
    job_id = submit(job_stack, TEXTS[:1])
    for url, key in [
        (ws_url(job_stack, job_id), other_tenant_key),
        (ws_url(job_stack, "job_doesnotexist"), job_stack.api_key),
    ]:
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as websocket:
            messages, close_code = messages_until_closed(websocket)
        assert (messages, close_code) == ([], CLOSE_NOT_FOUND), url


def test_a_path_outside_the_websocket_routes_is_refused_at_the_handshake(job_stack):
    """An unknown path is refused before the handshake completes (403), not a routing error (500)."""
    with pytest.raises(InvalidStatus) as refused, connect(f"{ws_url(job_stack, 'x')}/extra"):
        pass
    assert refused.value.response.status_code == 403
