"""Signed job callbacks: the body a finished job POSTs to its `callback_url`, and how receivers verify it.

Header `Embedsite-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`, keyed with
JOB_CALLBACK_SECRET. Receivers recompute it, compare in constant time and refuse old timestamps
(replays).
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "Embedsite-Signature"


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
