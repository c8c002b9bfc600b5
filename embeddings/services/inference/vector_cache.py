"""The embedding cache (part 1 of issue 35): one row's full-width vector, keyed by what determines it.

A row's key is the SHA-256 of the Triton model, its exact served version (the catalog's pinned one,
or the latest finished export for ""), that export's model.onnx SHA-256 (export.json), the scope
(the tenant's id: no tenant ever reads another's entries) and the row's token ids as sent to
Triton (after the prompt and truncation, so both are inside them) as little-endian int64. A new
export or version changes the key: an old vector is never served for a new model.

Values are the model's full-width float32 vector, little-endian, exactly as Triton returned it:
dimensions, normalisation and output types are applied after the cache, so one entry serves them
all, and a hit is bit-identical to a computed row (float16 would halve the bytes but not be exact).

Entries live in EMBEDDING_CACHE_REDIS_URL (by default the job store's server, never the critical
Redis, which holds quotas, usage and the broker: vectors must never crowd those out) for
EMBEDDING_CACHE_TTL_S, with a per-process LRU of EMBEDDING_CACHE_LOCAL_ENTRIES in front. A request's
rows are read with one MGET and its misses written with one pipeline of SET ... EX, each written once
and run on the asyncio client (the web) or the blocking one (Celery workers: jobs, batch lines).
Redis down or slower than EMBEDDING_CACHE_TIMEOUT_S: all misses, the writes dropped, a warning at
most once a minute, never a failed request or chunk.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from django.conf import settings
from redis.exceptions import RedisError

from embeddings.metrics import (
    EMBEDDING_CACHE_FAILURES,
    EMBEDDING_CACHE_LOCAL_EVICTIONS,
    EMBEDDING_CACHE_ROWS,
    EMBEDDING_CACHE_SECONDS,
)
from embeddings.redis.connections import (
    redis_embedding_cache_async,
    redis_embedding_cache_lean,
    redis_embedding_cache_sync,
)
from embeddings.redis.memory import redis_info
from embeddings.redis.transport import Command, Request, operation_run, operation_run_sync, single
from embeddings.services.inference.exports import (
    EXPORT_INFO_FILENAME,
    ModelExportError,
    model_export_info,
    model_export_version_dir,
)

logger = logging.getLogger(__name__)

KEY_PREFIX = b"embedsite:vector:"
FAILURE_LOG_INTERVAL_S = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """A Triton model as it is served: its version and its export's model.onnx SHA-256."""

    triton_model: str
    version: str
    export_sha256: str

    def row_key(self, scope: str, token_ids: np.ndarray) -> bytes:
        """The cache key of one row (its real token ids, padding excluded) under `scope`."""
        digest = hashlib.sha256()
        for part in (self.triton_model, self.version, self.export_sha256, scope):
            digest.update(part.encode())
            digest.update(b"\0")  # none of the parts holds a NUL: the fields cannot run together
        digest.update(np.ascontiguousarray(token_ids, dtype="<i8").tobytes())
        return digest.digest()


# (model, version, export.json's file version) -> its ServedModel, or None when it cannot be cached.
_served: dict[tuple, ServedModel | None] = {}
_SERVED_KEPT = 64


def served_model(triton_model: str, triton_version: str) -> ServedModel | None:
    """What the cache keys `triton_model` at `triton_version` by; None (not cached) for a model
    without a pinned version, whose answer may come from whichever version Triton serves at that
    moment (the newest export on disk may not be loaded yet: its key on the old version's vectors
    would serve them as the new one's), and for a version without a finished export recording its
    checksum (nothing would tell a replaced model apart). The catalog pins the version at
    registration (register_model); only an admin blanking it makes a model unpinned."""
    if not triton_version:
        return None
    repository = Path(settings.TRITON_MODEL_REPOSITORY)
    version = triton_version
    try:
        info_path = (
            model_export_version_dir(repository_dir=repository, name=triton_model, version=version)
            / EXPORT_INFO_FILENAME
        )
        stat = os.stat(info_path)
    except (OSError, ModelExportError):
        return None
    memo = (triton_model, str(version), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if memo in _served:
        return _served[memo]
    try:
        # Checks model.onnx against the recorded SHA-256 (hashed once per file version).
        sha256 = model_export_info(repository_dir=repository, name=triton_model, version=version).get(
            "sha256"
        )
    except (OSError, ValueError, ModelExportError):
        return None
    served = ServedModel(triton_model, str(version), sha256) if sha256 else None
    if len(_served) >= _SERVED_KEPT:
        _served.clear()
    _served[memo] = served
    return served


class LocalVectors:
    """A bounded LRU of key -> vector, shared by the process's threads; each entry it drops to stay
    within `capacity` is counted (embedsite_embedding_cache_evictions_total{where="local"})."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        with self.lock:
            vector = self.entries.get(key)
            if vector is not None:
                self.entries.move_to_end(key)
            return vector

    def put(self, key: bytes, vector: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        vector = np.array(vector, dtype=np.float32)
        vector.flags.writeable = False
        evicted = 0
        with self.lock:
            self.entries[key] = vector
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
                evicted += 1
        if evicted:
            EMBEDDING_CACHE_LOCAL_EVICTIONS.inc(evicted)

    def __len__(self) -> int:
        return len(self.entries)


_local: LocalVectors | None = None
_last_failure_logged = -float("inf")


def local_vectors() -> LocalVectors:
    global _local
    if _local is None or _local.capacity != settings.EMBEDDING_CACHE_LOCAL_ENTRIES:
        _local = LocalVectors(settings.EMBEDDING_CACHE_LOCAL_ENTRIES)
    return _local


def vector_cache_clear_local() -> None:
    """Forget the in-process entries and the served models (tests)."""
    global _local
    _local = None
    _served.clear()


def _failed(action: str, error: BaseException) -> None:
    global _last_failure_logged
    EMBEDDING_CACHE_FAILURES.labels(action).inc()
    now = time.monotonic()
    if now - _last_failure_logged >= FAILURE_LOG_INTERVAL_S:
        _last_failure_logged = now
        logger.warning("embedding cache %s failed (%r): computing as without it", action, error)


def _decoded(value: bytes | None, width: int | None) -> np.ndarray | None:
    if value is None or len(value) % 4 or (width is not None and len(value) != 4 * width):
        return None
    vector = np.frombuffer(value, dtype="<f4")
    return vector if len(vector) else None


# A cache operation, written once for both transports (as embeddings.redis.transport's): it yields
# what it asks of the cache's Redis as (action, request), "lookup" or "write" and a transport
# Request, and is sent the reply, or UNANSWERED when Redis failed or was slower than
# EMBEDDING_CACHE_TIMEOUT_S (counted and logged by its _RoundTrip); it returns its result. `vectors_get`
# and `vectors_put` run them on the running loop, their `_sync` twins on the blocking client.
CacheOperation = Generator[tuple[str, Request], Any, T]
UNANSWERED = object()


def _lookup(keys: Sequence[bytes]) -> CacheOperation[list[np.ndarray | None]]:
    """Each key's vector (None for a miss): the local LRU first, then one MGET for the rest."""
    local = local_vectors()
    found: list[np.ndarray | None] = [local.get(key) for key in keys]
    missing = [index for index, vector in enumerate(found) if vector is None]
    EMBEDDING_CACHE_ROWS.labels("local").inc(len(keys) - len(missing))
    if not missing:
        return found
    values = yield "lookup", Command.of("MGET", *[KEY_PREFIX + keys[index] for index in missing])
    if values is UNANSWERED:
        EMBEDDING_CACHE_ROWS.labels("miss").inc(len(missing))
        return found
    width = next((len(vector) for vector in found if vector is not None), None)
    from_redis = 0
    for index, value in zip(missing, values, strict=True):
        vector = _decoded(value, width)
        if vector is not None:
            found[index] = vector
            local.put(keys[index], vector)
            from_redis += 1
    EMBEDDING_CACHE_ROWS.labels("redis").inc(from_redis)
    EMBEDDING_CACHE_ROWS.labels("miss").inc(len(missing) - from_redis)
    return found


def _write(keys: Sequence[bytes], vectors: np.ndarray) -> CacheOperation[None]:
    """Store each key's vector (float32) locally and, in one pipeline of SET ... EX, in Redis."""
    if not keys:
        return
    local = local_vectors()
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    sets = []
    for key, row in zip(keys, rows, strict=True):
        local.put(key, row)
        sets.append(Command.of("SET", KEY_PREFIX + key, row.tobytes(), "EX", settings.EMBEDDING_CACHE_TTL_S))
    yield "write", sets


class _RoundTrip:
    """One request of a cache operation, run in a `with` block that sets `reply`: timed when
    answered; when Redis failed or timed out, the failure counted and logged, the error suppressed
    and the reply UNANSWERED."""

    def __init__(self, action: str, request: Request) -> None:
        self.action = action
        self.request = request
        self.reply: Any = UNANSWERED

    def __enter__(self) -> _RoundTrip:
        self.started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback) -> bool:
        if error is None:
            EMBEDDING_CACHE_SECONDS.labels(self.action).observe(time.perf_counter() - self.started)
            return False
        if not isinstance(error, RedisError | OSError | TimeoutError):
            return False
        _failed(self.action, error)
        return True


class _Steps:
    """A cache operation's round trips, for a transport to run each (setting its reply) in turn;
    `result` is the operation's once they are done."""

    def __init__(self, operation: CacheOperation[T]) -> None:
        self.operation = operation
        self.result: Any = None

    def __iter__(self) -> Iterator[_RoundTrip]:
        reply = None
        while True:
            try:
                action, request = self.operation.send(reply)
            except StopIteration as done:
                self.result = done.value
                return
            trip = _RoundTrip(action, request)
            yield trip
            reply = trip.reply


async def _run(operation: CacheOperation[T]) -> T:
    """Run a cache operation on the running loop's client, each request within the timeout."""
    steps = _Steps(operation)
    for trip in steps:
        with trip:
            async with asyncio.timeout(settings.EMBEDDING_CACHE_TIMEOUT_S):
                trip.reply = await _send(trip.request)
    return steps.result


async def _send(request: Request) -> Any:
    """One request to the cache's Redis from the running loop: on its lean client where its URL is
    plain TCP (bench/cache.py: redis-py's asyncio client was most of what a miss cost the web
    process), else on redis-py's."""
    lean = redis_embedding_cache_lean()
    if lean is not None:
        return await operation_run(single(request), lean=lean)
    return await operation_run(single(request), client=redis_embedding_cache_async())


def _run_sync(operation: CacheOperation[T]) -> T:
    """Run a cache operation on the blocking client (its socket timeout is the cache's)."""
    steps = _Steps(operation)
    for trip in steps:
        with trip:
            trip.reply = operation_run_sync(single(trip.request), redis_embedding_cache_sync())
    return steps.result


async def vectors_get(keys: Sequence[bytes]) -> list[np.ndarray | None]:
    """Each key's vector, None for a miss (`_lookup`), on the running loop's client."""
    return await _run(_lookup(keys))


def vectors_get_sync(keys: Sequence[bytes]) -> list[np.ndarray | None]:
    """`vectors_get` on the blocking client (Celery workers: jobs and batch lines)."""
    return _run_sync(_lookup(keys))


async def vectors_put(keys: Sequence[bytes], vectors: np.ndarray) -> None:
    """Store each key's vector (`_write`), on the running loop's client."""
    await _run(_write(keys, vectors))


def vectors_put_sync(keys: Sequence[bytes], vectors: np.ndarray) -> None:
    """`vectors_put` on the blocking client."""
    _run_sync(_write(keys, vectors))


async def vector_cache_state() -> dict[str, object]:
    """What /ready says of the cache (never a reason for not being ready: without it requests are
    computed): whether it is on, whether its Redis answers a PING within EMBEDDING_CACHE_TIMEOUT_S,
    and the process's local entries."""
    if not settings.EMBEDDING_CACHE:
        return {"enabled": False}
    local = local_vectors()
    state = {"enabled": True, "redis": "ok", "local_entries": len(local), "local_capacity": local.capacity}
    try:
        async with asyncio.timeout(settings.EMBEDDING_CACHE_TIMEOUT_S):
            await redis_embedding_cache_async().ping()
    except TimeoutError:
        state["redis"] = f"timed out after {settings.EMBEDDING_CACHE_TIMEOUT_S:g} s: every row is computed"
    except (RedisError, OSError) as error:
        # The error's class only: the cache's host stays in the log.
        state["redis"] = f"unreachable ({type(error).__name__}): every row is computed"
    return state


def vector_cache_redis_info() -> dict | None:
    """The cache Redis's INFO memory and stats (for /metrics), or None when it did not answer within
    EMBEDDING_CACHE_TIMEOUT_S (one round trip: a scrape never waits on a cache that is down)."""
    try:
        return redis_info(redis_embedding_cache_sync())
    except (RedisError, OSError):
        return None
