"""Credentials out of log lines: our keys anywhere, credential parameters and echoed headers, encoded
or not; the formatters redact the whole finished line."""

from __future__ import annotations

import json
import re

import pytest
from django.utils.module_loading import import_string
from hypothesis import given
from hypothesis import strategies as st

from embeddings.observability import logs
from embeddings.observability.redaction import redact_credentials
from embeddings.services.accounts.api_keys import KEY_PATTERN
from tests.observability.test_logs import logged

KEY = "emb_abcdefghij12_" + "S3cr3t-Value_" * 3 + "x"
PUBLIC_ID, SECRET = KEY[4:16], KEY[17:]
assert KEY_PATTERN.fullmatch(KEY)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"Not Found: /v1/jobs/{KEY}", "Not Found: /v1/jobs/emb_abcdefghij12_***"),
        (f"<ASGIRequest: GET '/v1/x?q={KEY}'>", "<ASGIRequest: GET '/v1/x?q=emb_abcdefghij12_***'>"),
        (f"Invalid HTTP_HOST header: '{KEY}'.", "Invalid HTTP_HOST header: 'emb_abcdefghij12_***'."),
        # Credential parameters by name, whatever their value, in any case and encoding of the name.
        (
            '"WebSocket /ws/v1/jobs/j?api_key=abc&x=1" [accepted]',
            '"WebSocket /ws/v1/jobs/j?api_key=***&x=1" [accepted]',
        ),
        ("/cb?limit=2&token=t0k;sig=zz", "/cb?limit=2&token=***;sig=***"),
        (
            "/a?access_token=1&Authorization=Bearer%20x&X-Api-Key=2",
            "/a?access_token=***&Authorization=***&X-Api-Key=***",
        ),
        (
            "/a?API%5FKEY=abc&ApiKey=d&client_secret=e&password=f",
            "/a?API%5FKEY=***&ApiKey=***&client_secret=***&password=***",
        ),
        # Not credentials: other parameters, and our access line's own fields.
        ("/v1/models?limit=1&q=hello&key_id=k&monkey=1", "/v1/models?limit=1&q=hello&key_id=k&monkey=1"),
        (
            "GET /v1/models 200 3.1 ms tenant=acme key_id=abcdefghij12",
            "GET /v1/models 200 3.1 ms tenant=acme key_id=abcdefghij12",
        ),
        # Headers echoed as `name: value` (uvicorn's DEBUG lines of a WebSocket handshake).
        ("< authorization: Basic dXNlcjpwYXNz", "< authorization: ***"),
        (
            '{"message": "< cookie: session=abc; x=1", "level": "DEBUG"}',
            '{"message": "< cookie: ***", "level": "DEBUG"}',
        ),
        ("< Proxy-Authorization: Bearer x", "< Proxy-Authorization: ***"),
        # A shell variable standing for a key (runstack's `curl` line) is no credential.
        ('curl -H "Authorization: Bearer $KEY"', 'curl -H "Authorization: Bearer $KEY"'),
        ("-H 'X-Api-Key: $EMBEDSITE_KEY'", "-H 'X-Api-Key: $EMBEDSITE_KEY'"),
    ],
)
def test_credentials_are_replaced_and_the_rest_is_kept(line, expected):
    assert redact_credentials(line) == expected


def test_a_key_hidden_by_percent_escapes_is_found_and_the_line_stays_one_line():
    encoded = "".join(f"%{byte:02X}" for byte in KEY.encode())
    line = f"GET /v1/jobs/{encoded}%0Aforged 404 2.0 ms"
    redacted = redact_credentials(line)
    assert redacted == "GET /v1/jobs/emb_abcdefghij12_***%0Aforged 404 2.0 ms"
    # Escapes that hide nothing are left as they came.
    assert redact_credentials("GET /v1/models/a%20b%0A 404") == "GET /v1/models/a%20b%0A 404"


def test_a_line_without_credentials_is_returned_as_it_is():
    line = "GET /v1/embeddings 200 31.2 ms tenant=acme key_id=l8n0v7ep2er1 endpoint=openai"
    assert redact_credentials(line) is line


@given(
    key=st.from_regex(KEY_PATTERN, fullmatch=True),
    before=st.text(max_size=30),
    after=st.text(max_size=30),
)
def test_no_key_of_our_shape_survives_whatever_surrounds_it(key, before, after):
    public_id, secret = KEY_PATTERN.fullmatch(key).group("public_id", "secret")
    redacted = redact_credentials(before + key + after)
    assert f"{public_id}_{secret}" not in redacted
    # Its longest piece between separators: a secret is never left half shown either.
    longest = max(re.split("[_-]", secret), key=len)
    if len(longest) >= 8 and longest not in before + after:
        assert longest not in redacted


@pytest.mark.parametrize("formatter", [logs.text_formatter, logs.json_formatter], ids=["text", "json"])
def test_both_formats_redact_message_extra_fields_and_traceback(formatter):
    class Request:
        def __repr__(self):
            return f"<ASGIRequest: GET '/v1/models?api_key={KEY}'>"

    def emit(logger):
        logger.warning("Unauthorized: %s", f"/v1/jobs/{KEY}", extra={"request": Request()})
        try:
            raise ValueError(f"bad header {KEY}")
        except ValueError:
            logger.exception("failed")

    text = "\n".join(logged(formatter(), emit))
    assert SECRET not in text
    assert f"emb_{PUBLIC_ID}_***" in text
    if formatter is logs.json_formatter:
        first = json.loads(text.splitlines()[0])
        assert first["request"] == "<ASGIRequest: GET '/v1/models?api_key=***'>"


def test_the_logging_settings_use_the_redacting_formatters(settings):
    for formatter in settings.LOGGING["formatters"].values():
        assert isinstance(import_string(formatter["()"])(), logs.Redacted)
