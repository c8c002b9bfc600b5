"""API requests borrow their thread-sensitive thread from a pool (embeddings/api/handler.py) rather
than starting and joining one each; their sync work runs there, one request per thread at a time,
between Django's request signals, and a request with no sync work uses no thread at all."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.core import signals

from embeddings.api.handler import RequestThread, RequestThreads
from embeddings.services.accounts.api_keys import api_key_create

SCOPE = {"type": "http", "path": "/v1/models"}


def test_lent_threads_are_distinct_and_reused():
    threads = RequestThreads(keep_idle=2)
    first, second = threads.lend(SCOPE), threads.lend(SCOPE)
    assert first is not second
    threads.give_back(first)
    assert threads.lend(SCOPE) is first
    for executor in (first, second):
        executor.shutdown()


def test_threads_beyond_keep_idle_are_let_go():
    threads = RequestThreads(keep_idle=1)
    first, second = threads.lend(SCOPE), threads.lend(SCOPE)
    first.submit(lambda: None).result()
    second.submit(lambda: None).result()
    threads.give_back(first)
    threads.give_back(second)
    assert threads.idle == [first]
    with pytest.raises(RuntimeError):  # shut down
        second.submit(lambda: None)
    first.shutdown()


@pytest.fixture
def signal_threads():
    """(signal, thread name, thread ident) for each request signal sent, in order."""
    seen: list[tuple[str, str, int]] = []

    def recorder(name):
        def record(**kwargs):
            seen.append((name, threading.current_thread().name, threading.get_ident()))

        return record

    started, finished = recorder("started"), recorder("finished")
    signals.request_started.connect(started, weak=False)
    signals.request_finished.connect(finished, weak=False)
    yield seen
    signals.request_started.disconnect(started)
    signals.request_finished.disconnect(finished)


def forget_keys():
    """The next request looks its key up in the database: sync work, in the request's thread."""
    from embeddings.api.authentication import caller_cache

    caller_cache.clear()


async def test_sync_work_runs_in_a_pooled_thread_between_the_request_signals(client, alpha, signal_threads):
    for _ in range(3):
        forget_keys()
        response = await client.get("/v1/models", headers=alpha.headers)
        assert response.status_code == 200
    assert [name for name, _, _ in signal_threads] == ["started", "finished"] * 3
    assert all(thread.startswith("api-request") for _, thread, _ in signal_threads), signal_threads
    # One thread, lent to each request in turn: not one started and joined per request.
    assert len({ident for _, _, ident in signal_threads}) == 1


async def test_a_request_without_sync_work_uses_no_thread(client, alpha, signal_threads):
    assert (await client.get("/v1/models", headers=alpha.headers)).status_code == 200  # fills caches
    signal_threads.clear()
    assert (await client.get("/v1/models", headers=alpha.headers)).status_code == 200
    # Nothing ran in a request thread, so there is nothing there to tidy: the request ends on the loop.
    assert signal_threads == [("finished", threading.current_thread().name, threading.get_ident())]


async def test_concurrent_requests_never_share_a_thread(client, alpha, signal_threads):
    """Four keys: requests that need one key's lookup at once share it (embeddings/single_flight.py),
    so each of these four looks its own up, in its own thread."""
    secrets = [alpha.secret]
    for number in range(3):
        _, secret = await sync_to_async(api_key_create)(tenant=alpha.tenant, name=f"thread test {number}")
        secrets.append(secret)

    def linger(**kwargs):
        time.sleep(0.3)  # holds each request in its thread: all four are in flight at once

    signals.request_started.connect(linger, weak=False)
    try:
        forget_keys()
        responses = await asyncio.gather(
            *(client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"}) for secret in secrets)
        )
    finally:
        signals.request_started.disconnect(linger)
    assert [response.status_code for response in responses] == [200] * 4
    started = [ident for name, _, ident in signal_threads if name == "started"]
    assert len(started) == 4 and len(set(started)) == 4


async def test_a_failed_request_does_not_give_its_thread_back(api_setup):
    from embedsite.asgi import api_asgi_app

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/health",
        "raw_path": b"/health",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)

    async def send(message):
        raise OSError("the connection broke")

    # The thread the request will borrow: the pool lends its most recently returned one.
    lent = RequestThread()
    api_asgi_app.request_threads.idle.append(lent)
    with pytest.raises(OSError):
        await api_asgi_app(scope, receive, send)
    assert lent not in api_asgi_app.request_threads.idle
    with pytest.raises(RuntimeError):  # shut down, not kept
        lent.submit(lambda: None)
