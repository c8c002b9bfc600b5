"""Credentials taken out of log lines: our API keys wherever they appear, and the values of query
parameters and echoed headers that carry credentials, percent-encoded or not.

Both log formats (embeddings/observability/logs.py) pass every finished line through
`redact_credentials`, message, extra fields and traceback alike, whoever wrote it: our access line
(a key pasted into a path), Django's `Not Found: <path>` and the request it attaches to JSON lines
(query string included), uvicorn's WebSocket handshake line (query string included) and its DEBUG
echo of the handshake's headers. Nothing here imports Django: logging is configured before the apps
load.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

REDACTED = "***"

# Our keys: services/accounts/api_keys.py KEY_PATTERN (emb_<public id>_<secret>), found anywhere,
# with a secret of any length from 20 characters (the rest of a run is hidden too). The public id
# stays: it names the key, as every line's `key_id` does. Not imported from api_keys.py, which
# loads the models.
KEY = re.compile(r"emb_([a-z0-9]{12})_[A-Za-z0-9_-]{20,}")

# `name=value` after `?`, `&` or `;`: a query parameter in a URL or query string. Both stop where a
# log line's own syntax starts (whitespace, quotes, a backslash of a JSON escape, `<>` of a repr).
PARAMETER = re.compile(r"(?<=[?&;])([^=&;?#\s\"'\\<>]+)=([^&;#\s\"'\\<>]+)")
# A parameter name (percent-decoded, lower case, "-" read as "_") that carries a credential: api_key,
# apikey, key, token, access_token, client_secret, password, authorization, signature, session...
CREDENTIAL_NAME = re.compile(
    r"(?:^|_)(?:key|apikey|token|secret|password|passwd|pwd|auth|authorization|bearer|"
    r"credentials?|signature|sig|session|sessionid|jwt)$"
)
# A header echoed as `name: value`, the value up to the end of the line or of the JSON string; but a
# shell variable standing for one (runstack's `curl ... -H "Authorization: Bearer $KEY"`).
HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|cookie|x-api-key|api-key)(\s*:\s*)"
    r"(?!\s*(?:\w+ )?\$\w+\b)[^\r\n\"\\]+"
)
HEADER_NAMES = ("authorization", "cookie", "api-key")
# A run of text holding a percent-escape: decoded, it may show a key or a parameter name that its
# escapes hide (`emb%5F...`, `API%5FKEY=`).
PERCENT_ENCODED_RUN = re.compile(r"[^\s\"'\\<>]*%[0-9A-Fa-f]{2}[^\s\"'\\<>]*")
# Left as they are when a decoded run is escaped again: printable ASCII but the space, quotes and the
# backslash, so a text line stays one line and a JSON line stays JSON.
LOG_SAFE = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) not in "\"'\\")


def holds_key(text: str) -> bool:
    """Whether `text` holds something shaped like one of our keys."""
    return "emb_" in text and KEY.search(text) is not None


def _hide_value(match: re.Match) -> str:
    name = unquote(match[1]).lower().replace("-", "_")
    return f"{match[1]}={REDACTED}" if CREDENTIAL_NAME.search(name) else match[0]


def _redacted_plain(line: str) -> str:
    if "emb_" in line:
        line = KEY.sub(rf"emb_\1_{REDACTED}", line)
    if "?" in line or "&" in line or ";" in line:
        line = PARAMETER.sub(_hide_value, line)
    lowered = line.lower()
    if any(name in lowered for name in HEADER_NAMES):
        line = HEADER.sub(rf"\1\2{REDACTED}", line)
    return line


def _redacted_run(match: re.Match) -> str:
    run = match[0]
    decoded = unquote(run)
    hidden = _redacted_plain(decoded)
    return run if hidden == decoded else quote(hidden, safe=LOG_SAFE)


def redact_credentials(line: str) -> str:
    """`line` with every credential in it replaced by ***. Each rule is tried only when a cheap
    test of the line says it may apply: most lines (an access line) cost a few substring tests."""
    line = _redacted_plain(line)
    if "%" in line:
        line = PERCENT_ENCODED_RUN.sub(_redacted_run, line)
    return line
