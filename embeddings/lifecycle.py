"""Whether this web process is shutting down: the server marks it on SIGTERM, /ready reads it.

Nothing Django here: the mark is set from a signal handler, which must not import or lock anything.
"""

from __future__ import annotations

import time

_shutdown_began_at: float | None = None


def shutdown_begin() -> None:
    """Mark this process as shutting down (the first call counts; later ones change nothing)."""
    global _shutdown_began_at
    if _shutdown_began_at is None:
        _shutdown_began_at = time.monotonic()


def shutting_down() -> bool:
    return _shutdown_began_at is not None


def shutdown_reset() -> None:
    """For tests that mark a process that goes on serving."""
    global _shutdown_began_at
    _shutdown_began_at = None


def connection_closing(send):
    """The ASGI `send` of a request served while shutting down: its response says `Connection: close`,
    so a client that keeps connections alive opens a new one, which the load balancer (having seen
    /ready fail) gives to another process, instead of reusing this one until it stops accepting."""

    async def send_closing(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return send_closing
