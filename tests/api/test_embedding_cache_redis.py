"""The embedding cache's own Redis, real and run as deployments run it (allkeys-lfu, no persistence):
its figures in /metrics."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference.vector_cache import vector_cache_clear_local
from embeddings.tooling.local_redis import RedisServer
from tests.api.conftest import cache_redis
from tests.api.test_embedding_cache import embed

FIGURES = (
    "embedsite_embedding_cache_redis_evicted_keys",
    "embedsite_embedding_cache_redis_memory_used_bytes",
    "embedsite_embedding_cache_redis_memory_max_bytes",
)


@pytest.fixture
def small_cache_redis(tmp_path) -> Iterator[RedisServer]:
    """A cache Redis of this test's own with 2 MiB: room for about 500 vectors."""
    with cache_redis(tmp_path / "redis-cache", maxmemory_mb=2) as server:
        yield server


@pytest.fixture
def cache_in(settings, api_setup, small_cache_redis) -> Iterator[redis.Redis]:
    """The in-process app's cache on, in `small_cache_redis`, without in-process entries (every
    lookup reaches Redis and counts there); a client to that Redis, for its INFO."""
    settings.EMBEDDING_CACHE = True
    settings.EMBEDDING_CACHE_REDIS_URL = small_cache_redis.url
    settings.EMBEDDING_CACHE_TIMEOUT_S = 2.0
    settings.EMBEDDING_CACHE_LOCAL_ENTRIES = 0
    reset_redis_clients()
    vector_cache_clear_local()
    with redis.Redis.from_url(small_cache_redis.url) as direct:
        yield direct
    vector_cache_clear_local()
    reset_redis_clients()


async def scraped(client) -> tuple[str, float]:
    started = time.monotonic()
    response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text, time.monotonic() - started


def families(text: str) -> dict[str, list]:
    """Each family's samples; the exposition must parse and name no family twice."""
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(set(declared)), sorted(declared)
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def figure(found: dict[str, list], name: str) -> float:
    (sample,) = found[name]
    return sample.value


async def test_metrics_read_the_cache_redis_figures_at_each_scrape_only_with_the_cache_on(
    client, alpha, cache_in, settings
):
    await embed(client, alpha, ["a row, so the cache holds something"])
    found = families((await scraped(client))[0])
    info = cache_in.info()
    assert figure(found, "embedsite_embedding_cache_redis_up") == 1
    assert figure(found, "embedsite_embedding_cache_redis_memory_max_bytes") == 2 * 1024 * 1024
    assert figure(found, "embedsite_embedding_cache_redis_memory_max_bytes") == info["maxmemory"]
    # used_memory moves with every client's buffers, the scrape's own included: near, not equal.
    used = figure(found, "embedsite_embedding_cache_redis_memory_used_bytes")
    assert abs(used - info["used_memory"]) < 64 * 1024 and used > 0
    assert figure(found, "embedsite_embedding_cache_redis_evicted_keys") == info["evicted_keys"] == 0

    settings.EMBEDDING_CACHE = False
    off = families((await scraped(client))[0])
    assert not [name for name in off if name.startswith("embedsite_embedding_cache_redis")]
    # The request path's counters are there, cache on or off, at 0 until used (the dashboard's).
    assert {sample.labels["operation"] for sample in off["embedsite_embedding_cache_failures"]} == {
        "lookup",
        "write",
    }


async def test_a_cache_redis_down_or_silent_never_fails_or_slows_a_scrape(
    client, alpha, cache_in, small_cache_redis, settings
):
    _, healthy_s = await scraped(client)
    settings.EMBEDDING_CACHE_TIMEOUT_S = 0.2
    reset_redis_clients()
    small_cache_redis.kill()
    down, down_s = await scraped(client)
    found = families(down)
    assert figure(found, "embedsite_embedding_cache_redis_up") == 0
    assert not set(FIGURES) & set(found)  # no stale figures of a server that did not answer
    assert "embedsite_embedding_cache_rows" in found  # the rest is served as ever
    # Refused at once: one try and one retry (a broken connection), no backoff.
    assert down_s < healthy_s + 0.2
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        reset_redis_clients()
        silent_text, silent_s = await scraped(client)
    assert figure(families(silent_text), "embedsite_embedding_cache_redis_up") == 0
    # Given up after the timeout (connected, then no answer), not retried.
    assert silent_s < healthy_s + 2 * settings.EMBEDDING_CACHE_TIMEOUT_S + 0.2
