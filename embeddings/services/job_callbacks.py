"""Signed job callbacks: the body a finished job POSTs to its `callback_url`, and how receivers verify it.

Header `Embedsite-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`, keyed with
JOB_CALLBACK_SECRET. Receivers recompute it, compare in constant time and refuse old timestamps
(replays).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import time
import urllib.error
import urllib.parse
import urllib.request

import orjson
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from embeddings.models import EmbeddingJob

SIGNATURE_HEADER = "Embedsite-Signature"

logger = logging.getLogger(__name__)


def callback_signature(body: bytes, *, secret: str, timestamp: int | None = None) -> str:
    """The header value for `body` (now, unless a timestamp is given)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def callback_signature_valid(
    body: bytes, header: str, *, secret: str, tolerance_s: int = 300, now: float | None = None
) -> bool:
    """Whether `header` signs `body` with `secret`, made within tolerance_s of now."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        timestamp = int(parts["t"])
        signature = parts["v1"]
    except (KeyError, ValueError):
        return False
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = callback_signature(body, secret=secret, timestamp=timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, signature)


CALLBACK_TIMEOUT_S = 10.0  # per socket operation: the connect, then each read
# Responses worth another try: the receiver is down, overloaded or asked us to slow down.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class CallbackRetry(Exception):
    """A transient delivery failure (connection, timeout, 5xx, 429): the Celery task retries it
    with backoff, up to JOB_CALLBACK_RETRIES."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as the 3xx it is: a signed body is never re-sent elsewhere (another
    host could read it) nor downgraded to a GET without it, as urllib would do for a POST."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirects)


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    """POST and return the status; HTTP errors are statuses too, network failures raise OSError."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _opener.open(request, timeout=CALLBACK_TIMEOUT_S) as response:
            response.read(64 * 1024)  # the answer is not used; read a little so the peer sees it taken
            return response.status
    except urllib.error.HTTPError as error:
        error.close()
        return error.code


def job_callback_deliver(*, job_id: int) -> None:
    """POST a job's API object to its callback_url, signed; once delivered, never again.

    Raises CallbackRetry on a failure worth retrying; other refusals (4xx, 3xx, a URL that is not
    http/https) are logged and given up. Each try counts in job.callback_attempts.
    """
    from embeddings.services.jobs import job_object  # here: jobs.py enqueues the callback task

    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None or not job.callback_url or job.callback_delivered_at is not None:
        return
    url = job.callback_url
    if urllib.parse.urlsplit(url).scheme not in {"http", "https"}:
        logger.warning("job %s: callback URL %r is not http(s); not delivered", job.public_id, url)
        return
    body = orjson.dumps(job_object(job))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "embedsite-callback/1",
        SIGNATURE_HEADER: callback_signature(body, secret=settings.JOB_CALLBACK_SECRET),
    }
    EmbeddingJob.objects.filter(pk=job.pk).update(callback_attempts=F("callback_attempts") + 1)
    try:
        status = _post(url, body, headers)
    except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, resets, bad replies
        raise CallbackRetry(f"callback to {url} failed: {error}") from error
    if 200 <= status < 300:
        EmbeddingJob.objects.filter(pk=job.pk).update(callback_delivered_at=timezone.now())
        return
    if status in RETRYABLE_STATUSES or status >= 500:
        raise CallbackRetry(f"callback to {url} answered {status}")
    logger.warning("job %s: callback to %s refused with %s; given up", job.public_id, url, status)
