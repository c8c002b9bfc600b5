"""Callback signatures: verifiable by the receiver, refused when tampered with, stale or malformed."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from embeddings.services.job_callbacks import callback_signature, callback_signature_valid

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
