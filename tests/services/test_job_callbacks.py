"""Callbacks: signatures verifiable by the receiver (refused when tampered with, stale, malformed or
made with another tenant's secret; either secret verifying during a rotation's overlap), and
delivery to real local HTTP(S) servers on 127.0.0.1: refused by default, delivered when the
allow-setting names loopback, connected to the vetted address (no rebinding), with the URL's name in
Host, SNI and the certificate check; retried when transient, given up when refused."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.utils import timezone

from embeddings.api.jobs import JobOptions
from embeddings.models import EmbeddingJob, EmbeddingModel, Tenant
from embeddings.services.accounts.tenants import tenant_create, tenant_webhook_secret_rotate
from embeddings.services.jobs import callbacks as job_callbacks
from embeddings.services.jobs.callbacks import (
    SIGNATURE_HEADER,
    CallbackRetry,
    callback_signature,
    callback_signature_valid,
    job_callback_deliver,
)
from embeddings.services.jobs.reads import job_object

SECRET = "whsec_callback-secret"
BODY = b'{"id": "job_1", "status": "completed"}'
LOOPBACK = ("127.0.0.1/32",)


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body():
    header = callback_signature(BODY, signing_secrets=[SECRET], timestamp=1_700_000_000)
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_a_fresh_signature_verifies():
    header = callback_signature(BODY, signing_secrets=[SECRET])
    assert callback_signature_valid(BODY, header, secret=SECRET)


def test_two_secrets_give_two_v1_values_and_either_verifies():
    header = callback_signature(BODY, signing_secrets=["whsec_new", "whsec_old"], timestamp=1_700_000_000)
    assert header.count("v1=") == 2
    for secret in ("whsec_new", "whsec_old"):
        assert callback_signature_valid(BODY, header, secret=secret, now=1_700_000_000)
    assert not callback_signature_valid(BODY, header, secret="whsec_other", now=1_700_000_000)


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
    header = callback_signature(BODY, signing_secrets=[SECRET], timestamp=1_700_000_000)
    assert not callback_signature_valid(body, header, secret=secret, now=1_700_000_000 + now_offset)


@pytest.mark.parametrize(
    "header",
    ["", "garbage", "t=abc,v1=00", "v1=00", "t=1700000000", "t=1700000000,t=1700000000,v1=00", "t=1,x"],
)
def test_malformed_headers_fail(header):
    assert not callback_signature_valid(BODY, header, secret=SECRET, now=1_700_000_000)


def test_a_second_timestamp_cannot_smuggle_a_signature():
    header = callback_signature(BODY, signing_secrets=[SECRET], timestamp=1_700_000_000)
    assert not callback_signature_valid(BODY, header + ",t=1700000100", secret=SECRET, now=1_700_000_000)


# --- Real receivers on 127.0.0.1 ------------------------------------------------------------------


@dataclass
class Receiver:
    """A local HTTP(S) server answering each callback POST with the next of `statuses` (then 200)."""

    port: int = 0
    statuses: list[int] = field(default_factory=list)
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    server_names: list[str | None] = field(default_factory=list)  # SNI of each TLS handshake
    # Set: each POST is read, then answered only once this event is set (a receiver that hangs).
    answer_when: threading.Event | None = None
    redirect_to: str = ""

    def url(self, host: str = "127.0.0.1", path: str = "/hook", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def serve(state: Receiver, tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.received.append((self.path, dict(self.headers), body))
            if state.answer_when is not None:
                state.answer_when.wait(timeout=60)  # bounded, so that the server can always stop
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
    if tls is not None:
        tls.sni_callback = lambda connection, name, context: state.server_names.append(name)
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from serve(Receiver())


@pytest.fixture
def alpha(db) -> Tenant:
    return tenant_create(name="Alpha callbacks")


@pytest.fixture
def alpha_secret(alpha) -> str:
    return tenant_webhook_secret_rotate(tenant=alpha)


@pytest.fixture
def beta_secret(db) -> str:
    return tenant_webhook_secret_rotate(tenant=tenant_create(name="Beta callbacks"))


@pytest.fixture
def allow_loopback(settings) -> None:
    settings.JOB_CALLBACK_ALLOWED_NETWORKS = LOOPBACK


_jobs = iter(range(1, 1_000_000))


def finished_job(tenant: Tenant, url: str) -> EmbeddingJob:
    model, _ = EmbeddingModel.objects.get_or_create(
        name="cb-model", defaults={"triton_model": "cb", "dimensions": 4, "max_tokens": 16}
    )
    return EmbeddingJob.objects.create(
        public_id=f"job_callbacktest{next(_jobs)}",
        tenant=tenant,
        model=model,
        status=EmbeddingJob.Status.COMPLETED,
        total=3,
        completed=3,
        finished_at=timezone.now(),
        callback_url=url,
    )


def delivered(job: EmbeddingJob) -> EmbeddingJob:
    job.refresh_from_db()
    return job


def test_loopback_is_refused_by_default_and_the_receiver_sees_nothing(alpha, receiver):
    job = finished_job(alpha, receiver.url())
    job_callback_deliver(job_id=job.pk)  # no exception: given up, never retried
    assert receiver.received == []
    job = delivered(job)
    assert (job.callback_attempts, job.callback_delivered_at) == (0, None)
    assert job.callback_error.startswith("refused: 127.0.0.1 is not a public address (loopback)")


def test_a_name_resolving_to_loopback_is_refused_too(alpha, receiver):
    job = finished_job(alpha, receiver.url("localhost"))
    job_callback_deliver(job_id=job.pk)
    assert receiver.received == []
    assert "localhost resolves to 127.0.0.1" in delivered(job).callback_error


def test_delivered_when_loopback_is_allowed_signed_with_the_tenants_secret(
    alpha, alpha_secret, beta_secret, receiver, allow_loopback
):
    job = finished_job(alpha, receiver.url())
    job_callback_deliver(job_id=job.pk)

    [(path, headers, body)] = receiver.received
    assert path == "/hook"
    assert headers["Content-Type"] == "application/json"
    assert headers["Host"] == f"127.0.0.1:{receiver.port}"
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)
    # Another tenant's receiver cannot verify it (and so could not have forged it).
    assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=beta_secret)
    assert headers[SIGNATURE_HEADER].count("v1=") == 1
    sent = json.loads(body)
    assert sent == json.loads(json.dumps(job_object(job), default=str))
    assert sent["id"] == job.public_id and sent["status"] == "completed"
    job = delivered(job)
    assert job.callback_attempts == 1 and job.callback_delivered_at is not None
    assert job.callback_error == ""


def test_each_tenant_signs_with_its_own_secret(alpha_secret, beta_secret, receiver, allow_loopback):
    beta = Tenant.objects.get(name="Beta callbacks")
    job = finished_job(beta, receiver.url())
    job_callback_deliver(job_id=job.pk)
    [(_, headers, body)] = receiver.received
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=beta_secret)
    assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)


def test_a_tenant_without_a_secret_gets_one_at_its_first_callback(alpha, receiver, allow_loopback):
    assert alpha.webhook_secret_encrypted == ""
    job_callback_deliver(job_id=finished_job(alpha, receiver.url()).pk)
    alpha.refresh_from_db()
    assert alpha.webhook_secret_encrypted and alpha.webhook_secret_created_at is not None
    [(_, headers, body)] = receiver.received
    # Nobody knows it until an operator rotates: the new secret (shown once) verifies from then on.
    new_secret = tenant_webhook_secret_rotate(tenant=alpha)
    assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=new_secret)
    job_callback_deliver(job_id=finished_job(alpha, receiver.url()).pk)
    _, headers, body = receiver.received[-1]
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=new_secret)


def test_during_a_rotation_overlap_both_secrets_verify_and_after_it_only_the_new(
    alpha, alpha_secret, receiver, allow_loopback
):
    new_secret = tenant_webhook_secret_rotate(tenant=alpha, overlap=timedelta(hours=24))
    job_callback_deliver(job_id=finished_job(alpha, receiver.url()).pk)
    _, headers, body = receiver.received[-1]
    assert headers[SIGNATURE_HEADER].count("v1=") == 2
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=new_secret)
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)

    # The window ends.
    Tenant.objects.filter(pk=alpha.pk).update(
        webhook_previous_secret_expires_at=timezone.now() - timedelta(seconds=1)
    )
    job_callback_deliver(job_id=finished_job(alpha, receiver.url()).pk)
    _, headers, body = receiver.received[-1]
    assert headers[SIGNATURE_HEADER].count("v1=") == 1
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=new_secret)
    assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)


def test_a_rotation_without_overlap_stops_the_old_secret_at_once(
    alpha, alpha_secret, receiver, allow_loopback
):
    new_secret = tenant_webhook_secret_rotate(tenant=alpha)
    job_callback_deliver(job_id=finished_job(alpha, receiver.url()).pk)
    [(_, headers, body)] = receiver.received
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=new_secret)
    assert not callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)


def test_a_rebinding_name_is_refused_at_delivery(alpha, alpha_secret, receiver, fake_dns):
    """Public when the job is submitted, loopback when it is delivered: the second answer is vetted
    and refused, so the receiver listening on loopback never sees the POST."""
    fake_dns.set("rebind.test", ["93.184.215.14"], ["127.0.0.1"])
    url = receiver.url("rebind.test")
    submission = JobOptions(data={"model": "m", "callback_url": url})
    assert submission.is_valid(), submission.errors  # checked then (and never connected to)
    job = finished_job(alpha, url)
    job_callback_deliver(job_id=job.pk)
    assert receiver.received == []
    assert fake_dns.lookups == ["rebind.test", "rebind.test"]
    job = delivered(job)
    assert job.callback_attempts == 0 and job.callback_delivered_at is None
    assert "rebind.test resolves to 127.0.0.1, which is not a public address (loopback)" in job.callback_error


def test_the_post_goes_to_the_vetted_address_with_the_urls_host(alpha, receiver, allow_loopback, fake_dns):
    """`hooks.test` exists only in the test resolver: delivery can reach it only by connecting to
    the address it vetted, with the name in the Host header."""
    fake_dns.set("hooks.test", ["127.0.0.1"])
    job_callback_deliver(job_id=finished_job(alpha, receiver.url("hooks.test", "/in?tenant=alpha")).pk)
    [(path, headers, _)] = receiver.received
    assert path == "/in?tenant=alpha"
    assert headers["Host"] == f"hooks.test:{receiver.port}"
    assert fake_dns.lookups == ["hooks.test"]


def test_a_name_with_any_refused_address_is_refused(alpha, receiver, allow_loopback, fake_dns):
    fake_dns.set("split.test", ["127.0.0.1", "10.0.0.9"])  # 10.0.0.9 is never connected to
    job = finished_job(alpha, receiver.url("split.test"))
    job_callback_deliver(job_id=job.pk)
    assert receiver.received == []
    assert "10.0.0.9, which is not a public address (private, RFC 1918)" in delivered(job).callback_error


def test_a_host_that_does_not_resolve_now_is_retried(alpha, allow_loopback):
    job = finished_job(alpha, "http://gone.test/hook")
    with pytest.raises(CallbackRetry, match="does not resolve"):
        job_callback_deliver(job_id=job.pk)
    assert "gone.test does not resolve" in delivered(job).callback_error


def test_a_delivered_callback_is_not_sent_again(alpha, receiver, allow_loopback):
    job = finished_job(alpha, receiver.url())
    job_callback_deliver(job_id=job.pk)
    job_callback_deliver(job_id=job.pk)
    assert len(receiver.received) == 1


@pytest.mark.parametrize("status", [500, 502, 503, 429, 408])
def test_server_errors_and_throttling_are_retried(alpha, receiver, allow_loopback, status):
    job = finished_job(alpha, receiver.url())
    receiver.statuses = [status]
    with pytest.raises(CallbackRetry):
        job_callback_deliver(job_id=job.pk)
    job = delivered(job)
    assert (job.callback_attempts, job.callback_delivered_at) == (1, None)
    assert job.callback_error == f"the receiver answered {status}"

    job_callback_deliver(job_id=job.pk)  # the retry gets 200
    job = delivered(job)
    assert job.callback_attempts == 2 and job.callback_delivered_at is not None
    assert job.callback_error == ""


@pytest.mark.parametrize("status", [400, 401, 404, 410])
def test_other_client_errors_are_given_up(alpha, receiver, allow_loopback, status):
    job = finished_job(alpha, receiver.url())
    receiver.statuses = [status]
    job_callback_deliver(job_id=job.pk)  # no exception: no retry
    job = delivered(job)
    assert (job.callback_attempts, job.callback_delivered_at) == (1, None)


def test_a_refused_connection_is_retried(alpha, allow_loopback):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    job = finished_job(alpha, f"http://127.0.0.1:{port}/hook")  # nothing listens there
    with pytest.raises(CallbackRetry):
        job_callback_deliver(job_id=job.pk)
    assert delivered(job).callback_error.startswith("callback to")


def test_a_slow_receiver_times_out_and_is_retried(alpha, receiver, allow_loopback, monkeypatch):
    """The receiver takes the POST and does not answer until the delivery has given up, so nothing
    but the read timeout can have ended it (no wall-clock bound needed)."""
    monkeypatch.setattr(job_callbacks, "CALLBACK_TIMEOUT_S", 0.5)
    receiver.answer_when = threading.Event()
    job = finished_job(alpha, receiver.url())
    try:
        with pytest.raises(CallbackRetry, match="Read timed out"):
            job_callback_deliver(job_id=job.pk)
    finally:
        receiver.answer_when.set()
    job = delivered(job)
    assert job.callback_delivered_at is None and "Read timed out" in job.callback_error
    assert job.callback_attempts == 1


def test_redirects_are_not_followed(alpha, receiver, allow_loopback):
    receiver.statuses = [307]
    receiver.redirect_to = receiver.url(path="/elsewhere")
    job = finished_job(alpha, receiver.url())
    job_callback_deliver(job_id=job.pk)
    assert [path for path, _, _ in receiver.received] == ["/hook"]
    job = delivered(job)
    assert job.callback_delivered_at is None and job.callback_error == "the receiver answered 307"


def test_only_http_and_https_urls_are_called(alpha, allow_loopback):
    job = finished_job(alpha, "ftp://127.0.0.1/hook")
    job_callback_deliver(job_id=job.pk)
    job = delivered(job)
    assert job.callback_attempts == 0 and "scheme must be http or https" in job.callback_error


# --- https: the certificate checked against the URL's name, the TCP connection to the vetted IP ---


CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


@dataclass
class Certificates:
    ca_file: Path  # what the client trusts (JOB_CALLBACK_CA_FILE)
    server: ssl.SSLContext  # serves a certificate for `hooks.test`, issued by that CA


def _certificates(directory: Path, hostname: str) -> Certificates:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "embedsite test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / f"{hostname}.pem"
    chain.write_bytes(
        leaf.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(chain)
    return Certificates(ca_file, server)


@pytest.fixture
def tls_receiver(tmp_path, settings, fake_dns, allow_loopback) -> Iterator[Receiver]:
    """An HTTPS receiver on 127.0.0.1 whose certificate names `hooks.test` (a name only the test
    resolver knows, as 127.0.0.1), trusted through JOB_CALLBACK_CA_FILE."""
    certificates = _certificates(tmp_path, "hooks.test")
    settings.JOB_CALLBACK_CA_FILE = str(certificates.ca_file)
    fake_dns.set("hooks.test", ["127.0.0.1"])
    fake_dns.set("other-name.test", ["127.0.0.1"])
    yield from serve(Receiver(), tls=certificates.server)


def test_https_checks_the_certificate_against_the_name_while_connecting_to_the_vetted_ip(
    alpha, alpha_secret, tls_receiver
):
    job = finished_job(alpha, tls_receiver.url("hooks.test", scheme="https"))
    job_callback_deliver(job_id=job.pk)
    [(path, headers, body)] = tls_receiver.received
    assert path == "/hook" and headers["Host"] == f"hooks.test:{tls_receiver.port}"
    assert tls_receiver.server_names == ["hooks.test"]  # SNI
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=alpha_secret)
    assert delivered(job).callback_delivered_at is not None


def test_https_to_a_name_the_certificate_does_not_carry_is_not_sent(alpha, tls_receiver):
    """Same address, same certificate, another name: the handshake fails, nothing is sent."""
    job = finished_job(alpha, tls_receiver.url("other-name.test", scheme="https"))
    with pytest.raises(CallbackRetry, match="certificate"):
        job_callback_deliver(job_id=job.pk)
    assert tls_receiver.received == []
    assert tls_receiver.server_names == ["other-name.test"]


def test_https_with_a_certificate_the_system_does_not_trust_is_not_sent(alpha, tls_receiver, settings):
    settings.JOB_CALLBACK_CA_FILE = ""
    job = finished_job(alpha, tls_receiver.url("hooks.test", scheme="https"))
    with pytest.raises(CallbackRetry, match="certificate"):
        job_callback_deliver(job_id=job.pk)
    assert tls_receiver.received == []
