"""Callbacks: signatures verifiable by the receiver (refused when tampered with, stale or malformed),
and delivery to a real local HTTP server: retried when transient, given up when refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from embeddings.models import EmbeddingJob, EmbeddingModel
from embeddings.services import job_callbacks
from embeddings.services.job_callbacks import (
    SIGNATURE_HEADER,
    CallbackRetry,
    callback_signature,
    callback_signature_valid,
    job_callback_deliver,
)
from embeddings.services.jobs import job_object
from embeddings.services.tenants import tenant_create

SECRET = "callback-secret"
BODY = b'{"id": "job_1", "status": "completed"}'


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body():
    header = callback_signature(BODY, secret=SECRET, timestamp=1_700_000_000)
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_a_fresh_signature_verifies():
    header = callback_signature(BODY, secret=SECRET)
    assert callback_signature_valid(BODY, header, secret=SECRET)


@pytest.mark.parametrize(
    ("body", "secret", "now_offset"),
    [
        (BODY + b" ", SECRET, 0),  # body changed
        (BODY, "another-secret", 0),  # wrong secret
        (BODY, SECRET, 301),  # too old: a replay
        (BODY, SECRET, -301),  # from the future
    ],
)
def test_tampered_or_stale_signatures_fail(body, secret, now_offset):
    header = callback_signature(BODY, secret=SECRET, timestamp=1_700_000_000)
    assert not callback_signature_valid(body, header, secret=secret, now=1_700_000_000 + now_offset)


@pytest.mark.parametrize("header", ["", "garbage", "t=abc,v1=00", "v1=00", "t=1700000000"])
def test_malformed_headers_fail(header):
    assert not callback_signature_valid(BODY, header, secret=SECRET, now=1_700_000_000)


# --- Delivery to a real HTTP server --------------------------------------------------------------


@dataclass
class Receiver:
    """A local HTTP server answering each callback POST with the next of `statuses` (then 200)."""

    url: str
    statuses: list[int] = field(default_factory=list)
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    delay_s: float = 0.0
    redirect_to: str = ""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.received.append((self.path, dict(self.headers), body))
            if state.delay_s:
                time.sleep(state.delay_s)
            status = state.statuses.pop(0) if state.statuses else 200
            self.send_response(status)
            if 300 <= status < 400:
                self.send_header("Location", state.redirect_to)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def finished_job(db, settings) -> EmbeddingJob:
    settings.JOB_CALLBACK_SECRET = SECRET
    tenant = tenant_create(name="Callbacks")
    model = EmbeddingModel.objects.create(name="cb-model", triton_model="cb", dimensions=4, max_tokens=16)
    return EmbeddingJob.objects.create(
        public_id="job_callbacktest",
        tenant=tenant,
        model=model,
        status=EmbeddingJob.Status.COMPLETED,
        total=3,
        completed=3,
        finished_at=timezone.now(),
    )


def _point(job: EmbeddingJob, url: str) -> None:
    job.callback_url = url
    job.save(update_fields=["callback_url"])


def test_delivery_posts_the_job_object_signed(finished_job, receiver):
    _point(finished_job, receiver.url)
    job_callback_deliver(job_id=finished_job.pk)

    [(path, headers, body)] = receiver.received
    assert path == "/hook"
    assert headers["Content-Type"] == "application/json"
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=SECRET)
    sent = json.loads(body)
    assert sent == json.loads(json.dumps(job_object(finished_job), default=str))
    assert sent["id"] == "job_callbacktest" and sent["status"] == "completed"
    finished_job.refresh_from_db()
    assert finished_job.callback_attempts == 1
    assert finished_job.callback_delivered_at is not None


def test_a_delivered_callback_is_not_sent_again(finished_job, receiver):
    _point(finished_job, receiver.url)
    job_callback_deliver(job_id=finished_job.pk)
    job_callback_deliver(job_id=finished_job.pk)
    assert len(receiver.received) == 1


@pytest.mark.parametrize("status", [500, 502, 503, 429, 408])
def test_server_errors_and_throttling_are_retried(finished_job, receiver, status):
    _point(finished_job, receiver.url)
    receiver.statuses = [status]
    with pytest.raises(CallbackRetry):
        job_callback_deliver(job_id=finished_job.pk)
    finished_job.refresh_from_db()
    assert (finished_job.callback_attempts, finished_job.callback_delivered_at) == (1, None)

    job_callback_deliver(job_id=finished_job.pk)  # the retry gets 200
    finished_job.refresh_from_db()
    assert finished_job.callback_attempts == 2
    assert finished_job.callback_delivered_at is not None


@pytest.mark.parametrize("status", [400, 401, 404, 410])
def test_other_client_errors_are_given_up(finished_job, receiver, status):
    _point(finished_job, receiver.url)
    receiver.statuses = [status]
    job_callback_deliver(job_id=finished_job.pk)  # no exception: no retry
    finished_job.refresh_from_db()
    assert (finished_job.callback_attempts, finished_job.callback_delivered_at) == (1, None)


def test_a_refused_connection_is_retried(finished_job):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    _point(finished_job, f"http://127.0.0.1:{port}/hook")  # nothing listens there
    with pytest.raises(CallbackRetry):
        job_callback_deliver(job_id=finished_job.pk)


def test_a_slow_receiver_times_out_and_is_retried(finished_job, receiver, monkeypatch):
    monkeypatch.setattr(job_callbacks, "CALLBACK_TIMEOUT_S", 0.2)
    receiver.delay_s = 1.0
    _point(finished_job, receiver.url)
    started = time.monotonic()
    with pytest.raises(CallbackRetry):
        job_callback_deliver(job_id=finished_job.pk)
    assert time.monotonic() - started < 1.0


def test_redirects_are_not_followed(finished_job, receiver):
    receiver.statuses = [307]
    receiver.redirect_to = receiver.url.replace("/hook", "/elsewhere")
    _point(finished_job, receiver.url)
    job_callback_deliver(job_id=finished_job.pk)
    assert [path for path, _, _ in receiver.received] == ["/hook"]
    finished_job.refresh_from_db()
    assert finished_job.callback_delivered_at is None


def test_only_http_and_https_urls_are_called(finished_job):
    _point(finished_job, "ftp://127.0.0.1/hook")
    job_callback_deliver(job_id=finished_job.pk)
    finished_job.refresh_from_db()
    assert finished_job.callback_attempts == 0
