"""The process's Redis clients, configured from settings (one place): async for the web, sync for Celery.

Every command has REDIS_TIMEOUT_S to connect and to answer, so a stuck Redis fails a request
instead of hanging it. Callers turn `redis.exceptions.RedisError` into their own errors.
"""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio
from django.conf import settings

_lock = threading.Lock()
_sync_client: redis.Redis | None = None
# redis.asyncio connections belong to the event loop that opened them: one client per loop.
_async_clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis] = {}


def _options() -> dict:
    timeout = settings.REDIS_TIMEOUT_S
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 30,
        "retry_on_timeout": False,
    }


def redis_sync() -> redis.Redis:
    """The blocking client (thread-safe pool), for Celery tasks, commands and the admin."""
    global _sync_client
    with _lock:
        if _sync_client is None:
            _sync_client = redis.Redis.from_url(settings.REDIS_URL, **_options())
        return _sync_client


def redis_async() -> redis.asyncio.Redis:
    """The asyncio client of the running event loop."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        with _lock:
            for stale in [other for other in _async_clients if other.is_closed()]:
                del _async_clients[stale]
            # A blocking pool: beyond REDIS_MAX_CONNECTIONS commands wait (up to the timeout) for
            # a connection, where the default pool refuses at once with MaxConnectionsError.
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                settings.REDIS_URL,
                max_connections=settings.REDIS_MAX_CONNECTIONS,
                timeout=settings.REDIS_TIMEOUT_S,
                **_options(),
            )
            client = _async_clients[loop] = redis.asyncio.Redis(connection_pool=pool)
    return client


def reset_redis_clients() -> None:
    """Forget the clients (settings changed, e.g. in tests); their connections are left to be collected."""
    global _sync_client
    with _lock:
        if _sync_client is not None:
            _sync_client.close()
        _sync_client = None
        _async_clients.clear()
