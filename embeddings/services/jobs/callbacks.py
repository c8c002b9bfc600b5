"""Signed job callbacks: the body a finished job POSTs to its `callback_url`, where it may go, and
how receivers verify it.

Header `Embedsite-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`, keyed with the
tenant's webhook secret; while a rotated-out secret is still in its overlap window a second `v1`
(signed with it) follows, so a receiver holding either secret accepts the callback. Receivers
recompute, compare in constant time and refuse old timestamps (replays).

Delivery resolves the URL's host again, vets every address (services/jobs/callback_targets.py) and
connects to a vetted address itself, so a name that answers differently now (DNS rebinding) cannot
redirect the POST; the URL's name still goes in the Host header, in SNI and in the certificate
check. This module is the one place that talks HTTP to receivers.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import ssl
import time
from collections.abc import Sequence

import orjson
import urllib3
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from embeddings.errors import EmbedsiteError
from embeddings.models import EmbeddingJob
from embeddings.services.accounts.encryption import SecretUndecryptable
from embeddings.services.accounts.tenants import tenant_webhook_signing_secrets
from embeddings.services.jobs.callback_targets import (
    CallbackHostUnresolved,
    CallbackTarget,
    CallbackTargetError,
    Resolver,
    callback_target_resolve,
    resolve_host,
)

SIGNATURE_HEADER = "Embedsite-Signature"

logger = logging.getLogger(__name__)

# Every callback host is looked up through this (tests put a fake here: no lookup leaves the machine).
callback_resolver: Resolver = resolve_host


def callback_target_check(*, url: str) -> CallbackTarget:
    """`url` vetted against the address policy and JOB_CALLBACK_ALLOWED_NETWORKS, its host resolved
    now; raises a CallbackTargetError saying why not."""
    return callback_target_resolve(
        url,
        allowed_networks=settings.JOB_CALLBACK_ALLOWED_NETWORKS,
        resolver=callback_resolver,
        timeout_s=settings.JOB_CALLBACK_RESOLVE_TIMEOUT_S,
    )


def _hmac_hex(body: bytes, *, secret: str, timestamp: int) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def callback_signature(body: bytes, *, signing_secrets: Sequence[str], timestamp: int | None = None) -> str:
    """The header value for `body`, one `v1` per secret in order (now, unless a timestamp is given)."""
    if not signing_secrets:
        raise ValueError("at least one secret signs a callback")
    timestamp = int(time.time()) if timestamp is None else timestamp
    signatures = ",".join(
        f"v1={_hmac_hex(body, secret=secret, timestamp=timestamp)}" for secret in signing_secrets
    )
    return f"t={timestamp},{signatures}"


def callback_signature_valid(
    body: bytes, header: str, *, secret: str, tolerance_s: int = 300, now: float | None = None
) -> bool:
    """Whether any `v1` in `header` signs `body` with `secret`, made within tolerance_s of now."""
    timestamps: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        name, separator, value = item.strip().partition("=")
        if not separator:
            return False
        if name == "t":
            timestamps.append(value)
        elif name == "v1":
            signatures.append(value)
    if len(timestamps) != 1 or not signatures:
        return False
    try:
        timestamp = int(timestamps[0])
    except ValueError:
        return False
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = _hmac_hex(body, secret=secret, timestamp=timestamp)
    # Every candidate is compared (no early exit): the time taken does not say which one matched.
    matches = [hmac.compare_digest(expected, signature) for signature in signatures]
    return any(matches)


CALLBACK_TIMEOUT_S = 10.0  # per socket operation: the connect, then each read
# Responses worth another try: the receiver is down, overloaded or asked us to slow down.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# A name may resolve to many addresses: connecting tries at most this many before a retry.
MAX_ADDRESSES_TRIED = 3


class CallbackRetry(EmbedsiteError):
    """A transient delivery failure (connection, timeout, 5xx, 429, a lookup that failed): the Celery
    task retries it with backoff, up to JOB_CALLBACK_RETRIES."""


@functools.lru_cache(maxsize=4)
def _tls_context(ca_file: str) -> ssl.SSLContext:
    """Certificates checked against the system's CAs, or only those in JOB_CALLBACK_CA_FILE."""
    context = ssl.create_default_context(cafile=ca_file or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _post(target: CallbackTarget, body: bytes, headers: dict[str, str]) -> int:
    """POST to the first vetted address that accepts a connection; the status (HTTP errors and 3xx
    included: redirects are never followed). Network failures raise CallbackRetry.

    urllib3 is given the address as the host, so it makes no lookup of its own; `server_hostname`
    is its documented way to send the URL's name in SNI and check the certificate against it.
    Connection pools ignore proxy environment variables (a proxy would resolve the name again).
    """
    timeout = urllib3.Timeout(connect=CALLBACK_TIMEOUT_S, read=CALLBACK_TIMEOUT_S)
    last_error: Exception | None = None
    for address in target.addresses[:MAX_ADDRESSES_TRIED]:
        if target.scheme == "https":
            pool: urllib3.HTTPConnectionPool = urllib3.HTTPSConnectionPool(
                str(address),
                target.port,
                timeout=timeout,
                retries=False,
                maxsize=1,
                server_hostname=target.hostname,
                ssl_context=_tls_context(settings.JOB_CALLBACK_CA_FILE),
            )
        else:
            pool = urllib3.HTTPConnectionPool(
                str(address), target.port, timeout=timeout, retries=False, maxsize=1
            )
        with pool:
            try:
                response = pool.urlopen(
                    "POST",
                    target.request_target,
                    body=body,
                    headers={**headers, "Host": target.host_header},
                    redirect=False,
                    retries=False,
                    preload_content=False,
                    assert_same_host=False,
                )
            except (
                urllib3.exceptions.ConnectTimeoutError
            ) as error:  # nothing sent (refused, unreachable, timed out): next address
                last_error = error
                continue
            except (urllib3.exceptions.HTTPError, OSError) as error:  # TLS, timeouts, resets, bad replies
                raise CallbackRetry(f"callback to {target.url} ({address}) failed: {error}") from error
            try:
                response.read(64 * 1024)  # not used; read a little so the peer sees it taken
            except (urllib3.exceptions.HTTPError, OSError):
                pass  # the status is what counts
            finally:
                response.release_conn()
            return response.status
    raise CallbackRetry(f"callback to {target.url} failed: {last_error}") from last_error


def _record(job: EmbeddingJob, error: str) -> None:
    EmbeddingJob.objects.filter(pk=job.pk).update(callback_error=error[:500])


def job_callback_deliver(*, job_id: int) -> None:
    """POST a job's API object to its callback_url, signed with its tenant's secret; once
    delivered, never again.

    Raises CallbackRetry on a failure worth retrying (network, 5xx, 408/425/429, a host that does
    not resolve now); a target the address policy refuses, other answers (3xx, 4xx) and a secret
    that cannot be decrypted are logged, recorded in job.callback_error and given up. Each POST
    counts in job.callback_attempts.
    """
    from embeddings.services.jobs.reads import job_object  # here: jobs.py enqueues the callback task

    job = EmbeddingJob.objects.select_related("model", "tenant").filter(pk=job_id).first()
    if job is None or not job.callback_url or job.callback_delivered_at is not None:
        return
    try:
        target = callback_target_check(url=job.callback_url)
    except CallbackHostUnresolved as error:
        _record(job, f"not delivered: {error.reason}")
        raise CallbackRetry(f"callback host of job {job.public_id}: {error.reason}") from error
    except CallbackTargetError as error:
        logger.warning("job %s: callback refused, not sent: %s", job.public_id, error.reason)
        _record(job, f"refused: {error.reason}")
        return
    try:
        signing_secrets = tenant_webhook_signing_secrets(tenant=job.tenant)
    except SecretUndecryptable as error:
        logger.error("job %s: callback not sent: tenant %s: %s", job.public_id, job.tenant.slug, error)
        _record(job, "not sent: the tenant's webhook secret cannot be decrypted; rotate it")
        return
    body = orjson.dumps(job_object(job))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "embedsite-callback/1",
        SIGNATURE_HEADER: callback_signature(body, signing_secrets=signing_secrets),
    }
    EmbeddingJob.objects.filter(pk=job.pk).update(callback_attempts=F("callback_attempts") + 1)
    try:
        status = _post(target, body, headers)
    except CallbackRetry as error:
        _record(job, str(error))
        raise
    if 200 <= status < 300:
        EmbeddingJob.objects.filter(pk=job.pk).update(callback_delivered_at=timezone.now(), callback_error="")
        return
    _record(job, f"the receiver answered {status}")
    if status in RETRYABLE_STATUSES or status >= 500:
        raise CallbackRetry(f"callback to {target.url} answered {status}")
    logger.warning("job %s: callback to %s refused with %s; given up", job.public_id, target.url, status)
