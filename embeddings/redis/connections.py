"""The process's Redis connections, configured from settings (one place): async for the web, sync for Celery.

Two roles, two connections: the critical Redis (REDIS_URL: quotas, usage counters; the broker and
the channel layer connect to it on their own) and the job store (JOB_STORE_URL, by default the same
server: jobs' inputs, results and progress), so a full job store cannot refuse a quota check.
Every command has REDIS_TIMEOUT_S (JOB_STORE_TIMEOUT_S) to connect and to answer, so a stuck Redis
fails a request instead of hanging it. Callers turn `redis.exceptions.RedisError` into their own errors.

Operations do not use these clients directly but through embeddings.redis.transport; the lean
client below is the asyncio transport's connection where REDIS_URL is plain TCP.
"""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio
import redis.connection
from django.conf import settings

_lock = threading.Lock()
_sync_client: redis.Redis | None = None
_job_store_client: redis.Redis | None = None
# redis.asyncio connections belong to the event loop that opened them: one client per loop.
_async_clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis] = {}


def _options(timeout: float | None = None) -> dict:
    timeout = settings.REDIS_TIMEOUT_S if timeout is None else timeout
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


def job_store_url() -> str:
    return settings.JOB_STORE_URL or settings.REDIS_URL


def redis_job_store() -> redis.Redis:
    """The job store's blocking client (Celery workers, submissions and downloads in threads): its
    own pool even when it names the critical Redis's server."""
    global _job_store_client
    with _lock:
        if _job_store_client is None:
            _job_store_client = redis.Redis.from_url(
                job_store_url(), **_options(settings.JOB_STORE_TIMEOUT_S)
            )
        return _job_store_client


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
    global _sync_client, _job_store_client
    with _lock:
        for client in (_sync_client, _job_store_client):
            if client is not None:
                client.close()
        _sync_client = _job_store_client = None
        _async_clients.clear()
        _lean_clients.clear()


# --- A lean path for the request path's scripts ----------------------------------------------------


def pack_arguments(arguments) -> bytes:
    """Arguments as RESP bulk strings (what redis-py's pack_command does, without its per-call cost)."""
    parts = []
    for argument in arguments:
        data = argument if isinstance(argument, bytes) else str(argument).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def pack_command(*arguments) -> bytes:
    return b"*%d\r\n" % len(arguments) + pack_arguments(arguments)


async def read_replies(read, count: int) -> list:
    """`count` replies read with `read`; an error reply is raised after all are read, so the
    connection stays in step."""
    replies: list = []
    error: redis.exceptions.ResponseError | None = None
    for _ in range(count):
        try:
            replies.append(await read())
        except redis.exceptions.ResponseError as reply_error:
            error = error or reply_error
            replies.append(reply_error)
    if error is not None:
        raise error
    return replies


class LeanConnection:
    """One plain-TCP RESP2 connection: send a packed command, read one reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def call(self, command: bytes, replies: int | None = None):
        """Send, then read one reply, or a list of `replies` replies (a pipelined batch)."""
        self.writer.write(command)
        if replies is None:
            return await self.read_reply()
        return await read_replies(self.read_reply, replies)

    async def read_reply(self):
        line = await self.reader.readuntil(b"\r\n")
        kind, rest = line[:1], line[1:-2]
        if kind == b"$":
            length = int(rest)
            return None if length < 0 else (await self.reader.readexactly(length + 2))[:-2]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            message = rest.decode(errors="replace")
            if message.startswith("NOSCRIPT"):
                raise redis.exceptions.NoScriptError(message)
            raise redis.exceptions.ResponseError(message)
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [await self.read_reply() for _ in range(count)]
        raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:40]!r}")

    def close(self) -> None:
        self.writer.close()


class LeanScriptClient:
    """Pre-packed commands (EVALSHA above all) on a few plain TCP connections of one event loop.

    redis-py's asyncio client costs ~100-150 us of Python per command; the request path's quota
    scripts run once or twice per request, so they take this path (~50 us a round trip). Same
    timeouts and the same exceptions (redis.exceptions.*) as the redis-py clients; a connection
    that fails in any way is closed, never reused, and a pooled one found closed by Redis (after a
    restart) is replaced once. Only for redis:// URLs (TCP, no TLS).
    """

    def __init__(self, url: str) -> None:
        options = redis.connection.parse_url(url)
        if "connection_class" in options:
            raise ValueError("the lean client speaks plain TCP only")
        self.host = options["host"]
        self.port = options.get("port", 6379)
        self.handshake = b""
        self.handshake_replies = 0
        if options.get("password") is not None:
            credentials = [options.get("username") or "default", options["password"]]
            self.handshake += pack_command(b"AUTH", *credentials)
            self.handshake_replies += 1
        if options.get("db"):
            self.handshake += pack_command(b"SELECT", options["db"])
            self.handshake_replies += 1
        self.timeout = settings.REDIS_TIMEOUT_S
        self.idle: list[LeanConnection] = []
        self.slots = asyncio.Semaphore(settings.REDIS_MAX_CONNECTIONS)

    async def _connect(self) -> LeanConnection:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        connection = LeanConnection(reader, writer)
        try:
            if self.handshake:
                writer.write(self.handshake)
                for _ in range(self.handshake_replies):
                    await connection.read_reply()
        except BaseException:
            connection.close()
            raise
        return connection

    async def call(self, command: bytes, *, replies: int | None = None):
        """Send packed command(s), return the reply (a list of `replies` replies for a pipelined
        batch); raises redis.exceptions.RedisError."""
        try:
            async with asyncio.timeout(self.timeout):
                await self.slots.acquire()
        except TimeoutError as error:
            raise redis.exceptions.ConnectionError("No Redis connection available.") from error
        try:
            async with asyncio.timeout(self.timeout):
                if self.idle:
                    try:
                        return await self._exchange(self.idle.pop(), command, replies, fresh=False)
                    except _ClosedWhileIdle:
                        pass  # Redis closed it meanwhile (e.g. restarted): once more on a new one
                return await self._exchange(await self._connect(), command, replies, fresh=True)
        except TimeoutError as error:
            raise redis.exceptions.TimeoutError(f"Redis did not answer within {self.timeout} s") from error
        except OSError as error:
            raise redis.exceptions.ConnectionError(f"Redis connection failed: {error}") from error
        finally:
            self.slots.release()

    async def _exchange(
        self, connection: LeanConnection, command: bytes, replies: int | None, *, fresh: bool
    ):
        try:
            reply = await connection.call(command, replies)
        except redis.exceptions.ResponseError:
            self.idle.append(connection)  # an error reply leaves the connection in step
            raise
        except (OSError, asyncio.IncompleteReadError, redis.exceptions.RedisError) as error:
            connection.close()
            unanswered = not isinstance(error, asyncio.IncompleteReadError) or not error.partial
            if not fresh and unanswered and isinstance(error, ConnectionError | asyncio.IncompleteReadError):
                # A pooled connection Redis had closed: the command never reached a live server.
                raise _ClosedWhileIdle from error
            raise redis.exceptions.ConnectionError(f"Redis connection failed: {error!r}") from error
        except BaseException:  # cancelled or timed out mid-command: its reply must not be read later
            connection.close()
            raise
        self.idle.append(connection)
        return reply


class _ClosedWhileIdle(Exception):
    pass


_lean_clients: dict[asyncio.AbstractEventLoop, LeanScriptClient | None] = {}


def redis_lean_async() -> LeanScriptClient | None:
    """The running loop's lean script client, or None where REDIS_URL is not plain TCP."""
    loop = asyncio.get_running_loop()
    try:
        return _lean_clients[loop]
    except KeyError:
        pass
    with _lock:
        for stale in [other for other in _lean_clients if other.is_closed()]:
            del _lean_clients[stale]
        try:
            client = LeanScriptClient(settings.REDIS_URL)
        except ValueError:
            client = None
        _lean_clients[loop] = client
    return client
