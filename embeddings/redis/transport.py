"""Redis operations written once, run by a blocking and an asyncio transport (as embeddings.triton.client).

An operation is a generator: it yields what it needs from Redis (a `Command`, a `ScriptCall`, or a
list of commands to pipeline in one round trip) and is sent the raw replies back, then returns its
result. `operation_run_sync` runs it on a redis-py client (Celery workers, commands, the admin, views'
threads); `operation_run` on the running loop's connection to the critical Redis (the request path).
Scripts run by EVALSHA; a NOSCRIPT reply (first use, or Redis restarted) loads the script and runs
it again, once (`_lowered`, shared by every transport). Failures are `redis.exceptions.RedisError`.

The asyncio transport sends pre-packed RESP commands on the hand-written lean client where
REDIS_URL is plain TCP (embeddings.redis.connections), else on redis-py's asyncio client; a
`PackedRun` lets an operation pack constant arguments (a quota plan's keys) once, not per call.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from embeddings.redis.connections import LeanScriptClient, pack_arguments, redis_async, redis_lean_async
from embeddings.redis.scripts import Script

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PackedRun:
    """Arguments packed once (RESP bulk strings), kept as values too for redis-py's own packing."""

    values: tuple
    data: bytes

    @classmethod
    def of(cls, values: Sequence) -> PackedRun:
        return cls(tuple(values), pack_arguments(values))

    def __len__(self) -> int:
        return len(self.values)


def _flat(arguments: Sequence) -> list:
    flat: list = []
    for argument in arguments:
        if isinstance(argument, PackedRun):
            flat += argument.values
        else:
            flat.append(argument)
    return flat


def _packed(arguments: Sequence) -> bytes:
    """One RESP command of `arguments`: PackedRun parts as they are, the others packed now."""
    count = 0
    parts: list[bytes] = []
    loose: list = []
    for argument in arguments:
        if isinstance(argument, PackedRun):
            if loose:
                parts.append(pack_arguments(loose))
                count += len(loose)
                loose = []
            parts.append(argument.data)
            count += len(argument)
        else:
            loose.append(argument)
    if loose:
        parts.append(pack_arguments(loose))
        count += len(loose)
    return b"*%d\r\n" % count + b"".join(parts)


@dataclass(frozen=True, slots=True)
class Command:
    """One plain command: its name and arguments (a PackedRun counts as its values)."""

    arguments: tuple

    @classmethod
    def of(cls, *arguments) -> Command:
        return cls(arguments)


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One script run: its keys and arguments (either may hold PackedRun parts)."""

    script: Script
    keys: Sequence
    args: Sequence = ()

    def arguments(self) -> list:
        key_count = sum(len(key) if isinstance(key, PackedRun) else 1 for key in self.keys)
        return ["EVALSHA", self.script.sha, key_count, *self.keys, *self.args]


Request = Command | ScriptCall | list[Command]
# An operation yields a Request and is sent its reply (a list of replies for a list), and returns
# its result.
Operation = Generator[Request, Any, T]


def single(request: Request) -> Operation:
    """The operation of one request: its reply."""
    return (yield request)


# --- What both transports share: scripts by EVALSHA, loaded once on NOSCRIPT ---------------------


def _lowered(operation: Operation[T]) -> Generator[Request, Any, T]:
    """The operation's requests as the transports send them: a ScriptCall by EVALSHA, and when
    Redis does not know the script (first use, or after a restart: the transport sends the
    NoScriptError back as the reply) loaded, then run once more."""
    reply = None
    while True:
        try:
            request = operation.send(reply)
        except StopIteration as done:
            return done.value
        reply = yield request
        if isinstance(reply, NoScriptError):
            yield Command.of("SCRIPT", "LOAD", request.script.source)
            reply = yield request
            if isinstance(reply, NoScriptError):
                raise reply


# --- Blocking transport (redis-py) ----------------------------------------------------------------


def operation_run_sync(operation: Operation[T], client: redis.Redis) -> T:
    """Run `operation` on a blocking redis-py client; its result."""
    steps, reply = _lowered(operation), None
    while True:
        try:
            plain = steps.send(reply)
        except StopIteration as done:
            return done.value
        reply = _sync_send(client, plain)


def _sync_send(client: redis.Redis, plain: Request):
    """The reply; a NOSCRIPT error is returned, not raised (for `_lowered`)."""
    try:
        if isinstance(plain, ScriptCall):
            return client.execute_command(*_flat(plain.arguments()))
        if isinstance(plain, Command):
            return client.execute_command(*_flat(plain.arguments))
        if not plain:
            return []
        pipeline = client.pipeline(transaction=False)
        for command in plain:
            pipeline.execute_command(*_flat(command.arguments))
        return pipeline.execute()
    except NoScriptError as error:
        return error


# --- asyncio transport (the request path, critical Redis) -----------------------------------------


async def operation_run(
    operation: Operation[T],
    *,
    client: redis.asyncio.Redis | None = None,
    lean: LeanScriptClient | None = None,
) -> T:
    """Run `operation` on the critical Redis from the running loop; its result.

    On the lean client where REDIS_URL is plain TCP, else on redis-py's asyncio client; `client`
    picks a redis-py client instead (bench/quota.py compares the two), `lean` another lean client
    (another server's: the embedding cache's).
    """
    if lean is None and client is None:
        lean = redis_lean_async()
        if lean is None:
            client = redis_async()
    steps, reply = _lowered(operation), None
    while True:
        try:
            plain = steps.send(reply)
        except StopIteration as done:
            return done.value
        try:
            reply = await (_lean_send(lean, plain) if lean is not None else _redis_py_send(client, plain))
        except NoScriptError as error:
            reply = error  # for `_lowered`


async def _lean_send(lean: LeanScriptClient, plain: Request):
    if isinstance(plain, ScriptCall):
        return await lean.call(_packed(plain.arguments()))
    if isinstance(plain, Command):
        return await lean.call(_packed(plain.arguments))
    if not plain:
        return []
    packed = b"".join(_packed(command.arguments) for command in plain)
    return await lean.call(packed, replies=len(plain))


async def _redis_py_send(client: redis.asyncio.Redis, plain: Request):
    if isinstance(plain, ScriptCall):
        return await client.execute_command(*_flat(plain.arguments()))
    if isinstance(plain, Command):
        return await client.execute_command(*_flat(plain.arguments))
    if not plain:
        return []
    pipeline = client.pipeline(transaction=False)
    for command in plain:
        pipeline.execute_command(*_flat(command.arguments))
    return await pipeline.execute()
