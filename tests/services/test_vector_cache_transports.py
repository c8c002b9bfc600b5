"""The embedding cache's lookup and write on both transports against a real Redis: the asyncio client
(the web) and the blocking one (Celery workers) read what either wrote, count their rows, times and
failures alike, and a Redis that is down or never answers costs misses, not errors or waits."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference.vector_cache import (
    vector_cache_clear_local,
    vectors_get,
    vectors_get_sync,
    vectors_put,
    vectors_put_sync,
)
from embeddings.tooling.triton_server import free_port

TRANSPORTS = ("asyncio", "blocking")


@pytest.fixture
def cache(embedding_cache):
    """The cache's Redis, the job store's (the test's keys are random)."""


def get(transport: str, keys: list[bytes]) -> list[np.ndarray | None]:
    if transport == "blocking":
        return vectors_get_sync(keys)
    return asyncio.run(vectors_get(keys))


def put(transport: str, keys: list[bytes], vectors: np.ndarray) -> None:
    if transport == "blocking":
        vectors_put_sync(keys, vectors)
    else:
        asyncio.run(vectors_put(keys, vectors))


def new_keys(count: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(count)]


def metrics() -> dict[str, float]:
    """The cache's counters: rows by where they were found, Redis calls timed and failed."""

    def sample(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    values = {
        result: sample("embedsite_embedding_cache_rows_total", {"result": result})
        for result in ("local", "redis", "miss")
    }
    for operation in ("lookup", "write"):
        values[f"{operation} timed"] = sample(
            "embedsite_embedding_cache_seconds_count", {"operation": operation}
        )
        values[f"{operation} failed"] = sample(
            "embedsite_embedding_cache_failures_total", {"operation": operation}
        )
    return values


def since(before: dict[str, float]) -> dict[str, float]:
    after = metrics()
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


@pytest.mark.parametrize(("writer", "reader"), [("asyncio", "blocking"), ("blocking", "asyncio")])
def test_what_one_transport_writes_the_other_reads_exactly(cache, writer, reader):
    keys = new_keys(3)
    vectors = np.random.default_rng(7).standard_normal((2, 384)).astype(np.float32)
    put(writer, keys[:2], vectors)
    vector_cache_clear_local()  # from Redis, not from this process's entries
    found = get(reader, keys)
    assert np.array_equal(found[0], vectors[0]) and np.array_equal(found[1], vectors[1])
    assert found[0].dtype == np.float32 and found[2] is None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_counts_rows_times_and_failures_alike(cache, transport, settings):
    keys = new_keys(3)
    before = metrics()
    put(transport, keys[:2], np.ones((2, 8), dtype=np.float32))
    get(transport, keys)  # two local entries, one miss
    vector_cache_clear_local()
    get(transport, keys)  # two from Redis, one miss
    assert since(before) == {"local": 2, "redis": 2, "miss": 2, "lookup timed": 2, "write timed": 1}

    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    vector_cache_clear_local()
    before = metrics()
    put(transport, keys[:1], np.ones((1, 8), dtype=np.float32))  # dropped, never raised
    vector_cache_clear_local()
    assert get(transport, keys) == [None] * 3
    assert since(before) == {"miss": 3, "lookup failed": 1, "write failed": 1}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cache_that_never_answers_costs_at_most_its_timeout(cache, transport, settings):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        settings.EMBEDDING_CACHE_TIMEOUT_S = 0.2
        reset_redis_clients()
        keys = new_keys(2)
        started = time.monotonic()
        put(transport, keys, np.ones((2, 8), dtype=np.float32))
        vector_cache_clear_local()
        assert get(transport, keys) == [None, None]
        # One write and one lookup, each given up after 0.2 s (no retries).
        assert time.monotonic() - started < 1.5
