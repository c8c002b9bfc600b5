"""The process's Redis connections, configured from settings (one place): async for the web, sync for Celery.

Two roles, two connections: the critical Redis (REDIS_URL: quotas, usage counters; the broker and
the channel layer connect to it on their own) and the job store (JOB_STORE_URL, by default the same
server: jobs' inputs, results and progress), so a full job store cannot refuse a quota check; and
the embedding cache's (EMBEDDING_CACHE_REDIS_URL, by default the job store's server).
Every command has REDIS_TIMEOUT_S (JOB_STORE_TIMEOUT_S) to connect and to answer, so a stuck Redis
fails a request instead of hanging it. Callers turn `redis.exceptions.RedisError` into their own errors.

Operations do not use these clients directly but through embeddings.redis.transport; the lean
client below is the asyncio transport's connection where REDIS_URL is plain TCP.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

import redis
import redis.asyncio
import redis.connection
from django.conf import settings
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

_lock = threading.Lock()
_sync_client: redis.Redis | None = None
_job_store_client: redis.Redis | None = None
_embedding_cache_sync_client: redis.Redis | None = None
# redis.asyncio connections belong to the event loop that opened them: one client per loop.
_async_clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis] = {}
# The embedding cache's (EMBEDDING_CACHE_REDIS_URL), one per event loop likewise.
_embedding_cache_clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis] = {}


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


def _loop_client(
    clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis], make: Callable[[], redis.asyncio.Redis]
) -> redis.asyncio.Redis:
    """The running loop's client in `clients` (made by `make` on first use; closed loops' dropped)."""
    loop = asyncio.get_running_loop()
    client = clients.get(loop)
    if client is None:
        with _lock:
            for stale in [other for other in clients if other.is_closed()]:
                del clients[stale]
            client = clients[loop] = make()
    return client


def redis_async() -> redis.asyncio.Redis:
    """The asyncio client of the running event loop."""

    def make() -> redis.asyncio.Redis:
        # A blocking pool: beyond REDIS_MAX_CONNECTIONS commands wait (up to the timeout) for
        # a connection, where the default pool refuses at once with MaxConnectionsError.
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            max_connections=settings.REDIS_MAX_CONNECTIONS,
            timeout=settings.REDIS_TIMEOUT_S,
            **_options(),
        )
        return redis.asyncio.Redis(connection_pool=pool)

    return _loop_client(_async_clients, make)


def embedding_cache_url() -> str:
    """The embedding cache's Redis: EMBEDDING_CACHE_REDIS_URL, else the job store's server (never
    the critical Redis's role: see settings)."""
    return settings.EMBEDDING_CACHE_REDIS_URL or job_store_url()


def redis_embedding_cache_async() -> redis.asyncio.Redis:
    """The embedding cache's asyncio client of the running loop: every command within
    EMBEDDING_CACHE_TIMEOUT_S to connect and to answer (a slow cache is a miss, not a wait)."""
    return _loop_client(
        _embedding_cache_clients,
        lambda: redis.asyncio.Redis.from_url(
            embedding_cache_url(), **_options(settings.EMBEDDING_CACHE_TIMEOUT_S)
        ),
    )


def redis_embedding_cache_sync() -> redis.Redis:
    """The embedding cache's blocking client, for Celery workers' lookups and writes (jobs, batch
    lines) and what reads its server's figures (/metrics): every command within
    EMBEDDING_CACHE_TIMEOUT_S to connect and to answer, tried again at once only when its connection
    broke (Redis restarted since), never after a timeout (our policy, not redis-py's default, which
    retries timeouts too, with backoff): a cache Redis that is down or silent costs a caller about
    that timeout once."""
    global _embedding_cache_sync_client
    with _lock:
        if _embedding_cache_sync_client is None:
            _embedding_cache_sync_client = redis.Redis.from_url(
                embedding_cache_url(),
                **_options(settings.EMBEDDING_CACHE_TIMEOUT_S),
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
        return _embedding_cache_sync_client


def reset_redis_clients() -> None:
    """Forget the clients (settings changed, e.g. in tests); their connections are left to be collected."""
    global _sync_client, _job_store_client, _embedding_cache_sync_client
    with _lock:
        for client in (_sync_client, _job_store_client, _embedding_cache_sync_client):
            if client is not None:
                client.close()
        _sync_client = _job_store_client = _embedding_cache_sync_client = None
        _async_clients.clear()
        _embedding_cache_clients.clear()
        _lean_clients.clear()
        _embedding_cache_lean_clients.clear()


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


# What ends a connection's reading: the socket failed or closed, or Redis sent what is not RESP.
_READ_FAILURES = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, RedisError)


class LeanConnection:
    """One plain-TCP RESP2 connection that every coroutine of the loop shares: commands are written
    in the order they come, those of one loop iteration in one write, and one reader task hands
    each reply to its caller in that order (Redis answers a connection's commands in order).

    Pipelining: under load a request's quota reserve and another's settle share a write and a
    read, where a connection each cost two system calls a command (bench/notes/). A caller that
    gave up (cancelled, timed out) leaves its reply to be read and dropped, so the connection stays
    in step; an error reply is its command's alone. When the connection fails (Redis closed it,
    was killed, sent what is not RESP) every command waiting on it fails with ConnectionError and
    the client opens a new one for the next.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        # (future, None for one reply or the number of a batch's replies), in the order sent.
        self.waiting: collections.deque[tuple[asyncio.Future, int | None]] = collections.deque()
        self.outgoing: list[bytes] = []
        self.failure: BaseException | None = None
        # Whether a reply was ever read here, and since the connection was last idle: a pooled
        # connection Redis closed while it was idle (a restart the loop has not yet seen) fails
        # its next commands unanswered, which may then be sent again on a new one.
        self.answered_ever = False
        self.answered_since_idle = False
        # Reads while commands wait for replies, and only then: no task is left behind on an idle
        # connection (or a loop that ends).
        self.reading: asyncio.Task | None = None

    @property
    def usable(self) -> bool:
        """False once failed, or closed by Redis while idle (restarted, or its idle timeout)."""
        return self.failure is None and not self.reader.at_eof() and not self.writer.is_closing()

    def send(self, command: bytes, replies: int | None) -> asyncio.Future:
        """Queue packed command(s); the future's result is the reply (or the list of `replies`
        replies), an error reply its exception."""
        future = self.loop.create_future()
        if self.failure is not None:
            future.set_exception(
                redis.exceptions.ConnectionError(f"Redis connection failed: {self.failure!r}")
            )
            return future
        if not self.waiting:
            self.answered_since_idle = False
        if not self.outgoing:
            self.loop.call_soon(self._flush)
        self.outgoing.append(command)
        self.waiting.append((future, replies))
        if self.reading is None or self.reading.done():
            self.reading = self.loop.create_task(self._read_replies())
        return future

    def _flush(self) -> None:
        if self.outgoing and self.failure is None:
            try:
                self.writer.write(b"".join(self.outgoing))
            except (OSError, RuntimeError) as error:
                self.fail(error)
        self.outgoing.clear()

    async def _read_replies(self) -> None:
        try:
            while self.waiting:
                reply = await self.read_reply()
                future, count = self.waiting[0]
                if count is not None:
                    replies = [reply]
                    for _ in range(count - 1):
                        replies.append(await self.read_reply())
                    errors = [r for r in replies if isinstance(r, redis.exceptions.ResponseError)]
                    reply = errors[0] if errors else replies
                self.waiting.popleft()
                self.answered_ever = self.answered_since_idle = True
                if future.done():
                    continue  # its caller gave up
                if isinstance(reply, redis.exceptions.ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except asyncio.CancelledError:
            self.fail(ConnectionError("closed"))
            raise
        except _READ_FAILURES as error:
            self.fail(error)

    async def read_reply(self):
        """One reply; an error reply is returned (ResponseError, NoScriptError), not raised."""
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
                return redis.exceptions.NoScriptError(message)
            return redis.exceptions.ResponseError(message)
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [await self.read_reply() for _ in range(count)]
        raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:40]!r}")

    def fail(self, error: BaseException) -> None:
        """Close the connection; every command still waiting fails with ConnectionError."""
        if self.failure is not None:
            return
        self.failure = error
        self.writer.close()
        unanswered = not isinstance(error, asyncio.IncompleteReadError) or not error.partial
        closed_while_idle = (
            self.answered_ever
            and not self.answered_since_idle
            and unanswered
            and isinstance(error, ConnectionError | asyncio.IncompleteReadError)
        )
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                failed = (
                    ClosedWhileIdle()
                    if closed_while_idle
                    else redis.exceptions.ConnectionError(f"Redis connection failed: {error!r}")
                )
                failed.__cause__ = error
                future.set_exception(failed)

    def close(self) -> None:
        self.fail(ConnectionError("closed"))
        if self.reading is not None:
            self.reading.cancel()


class LeanScriptClient:
    """Pre-packed commands (EVALSHA above all) on one pipelined plain-TCP connection of one event loop.

    redis-py's asyncio client costs ~100-150 us of Python per command; the request path's quota
    scripts run once or twice per request, so they take this path (~50 us a round trip). Same
    timeouts and the same exceptions (redis.exceptions.*) as the redis-py clients: a command not
    answered within `timeout` (REDIS_TIMEOUT_S) raises TimeoutError (its reply, should it come, is
    dropped); a failed connection is replaced by the next command. Only for redis:// URLs (TCP, no
    TLS). The embedding cache's lookups and writes take it too, on their own server.
    """

    def __init__(self, url: str, *, timeout: float | None = None) -> None:
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
        self.timeout = settings.REDIS_TIMEOUT_S if timeout is None else timeout
        self.connection: LeanConnection | None = None
        # The connection being opened, which every caller meanwhile waits for.
        self.connecting: asyncio.Future[LeanConnection] | None = None

    async def _connect(self) -> LeanConnection:
        connection = LeanConnection(*await asyncio.open_connection(self.host, self.port))
        try:
            if self.handshake:
                connection.writer.write(self.handshake)
                for _ in range(self.handshake_replies):
                    reply = await connection.read_reply()
                    if isinstance(reply, redis.exceptions.ResponseError):
                        raise reply
        except BaseException:
            connection.close()
            raise
        return connection

    async def _usable_connection(self) -> LeanConnection:
        if self.connection is not None and self.connection.usable:
            return self.connection
        if self.connecting is None:
            self.connecting = asyncio.ensure_future(self._connect())
            self.connecting.add_done_callback(self._connected)
        return await asyncio.shield(self.connecting)

    def _connected(self, connecting: asyncio.Future) -> None:
        self.connecting = None
        if not connecting.cancelled() and connecting.exception() is None:
            self.connection = connecting.result()

    async def call(self, command: bytes, *, replies: int | None = None):
        """Send packed command(s), return the reply (a list of `replies` replies for a pipelined
        batch); raises redis.exceptions.RedisError."""
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    return await (await self._usable_connection()).send(command, replies)
                except ClosedWhileIdle:
                    pass  # Redis closed it meanwhile (e.g. restarted): once more on a new one
                try:
                    return await (await self._usable_connection()).send(command, replies)
                except ClosedWhileIdle as error:
                    raise redis.exceptions.ConnectionError("Redis closed the connection.") from error
        except TimeoutError as error:
            raise redis.exceptions.TimeoutError(f"Redis did not answer within {self.timeout} s") from error
        except OSError as error:
            raise redis.exceptions.ConnectionError(f"Redis connection failed: {error}") from error

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class ClosedWhileIdle(redis.exceptions.ConnectionError):
    """A command sent on a pooled connection Redis had closed while it was idle: never answered."""


_lean_clients: dict[asyncio.AbstractEventLoop, LeanScriptClient | None] = {}
_embedding_cache_lean_clients: dict[asyncio.AbstractEventLoop, LeanScriptClient | None] = {}


def _lean_loop_client(
    clients: dict[asyncio.AbstractEventLoop, LeanScriptClient | None], url: str, timeout: float
) -> LeanScriptClient | None:
    loop = asyncio.get_running_loop()
    try:
        return clients[loop]
    except KeyError:
        pass
    with _lock:
        for stale in [other for other in clients if other.is_closed()]:
            del clients[stale]
        try:
            client = LeanScriptClient(url, timeout=timeout)
        except ValueError:
            client = None
        clients[loop] = client
    return client


def redis_lean_async() -> LeanScriptClient | None:
    """The running loop's lean script client, or None where REDIS_URL is not plain TCP."""
    return _lean_loop_client(_lean_clients, settings.REDIS_URL, settings.REDIS_TIMEOUT_S)


def redis_embedding_cache_lean() -> LeanScriptClient | None:
    """The running loop's lean client of the embedding cache (EMBEDDING_CACHE_TIMEOUT_S), or None
    where its URL is not plain TCP (then redis_embedding_cache_async)."""
    return _lean_loop_client(
        _embedding_cache_lean_clients, embedding_cache_url(), settings.EMBEDDING_CACHE_TIMEOUT_S
    )
