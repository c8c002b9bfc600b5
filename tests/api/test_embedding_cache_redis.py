"""The embedding cache's own Redis, real and run as deployments run it (allkeys-lfu, no persistence):
its figures in /metrics, its memory bound under a workload larger than the bound, and killed and
restarted under load behind the real server with no request failing."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import time
from collections.abc import Callable, Iterator

import httpx2
import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference.vector_cache import vector_cache_clear_local
from embeddings.tooling.local_redis import EMBEDDING_CACHE_EVICTION, RedisServer
from tests.api.conftest import LiveServer, cache_redis
from tests.api.test_embedding_cache import cache_rows, embed
from tests.api.test_metrics import Samples, parse, value
from tests.processes import tenant_with_key

MODEL = "all-MiniLM-L6-v2"
# Deadline of each wait below: against hanging only, far above what the event takes here.
HANG_DEADLINE_S = 30
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


# What may be above maxmemory when INFO is read, and was at the peak: Redis evicts before it runs
# each command, so a write leaves at most its own entry above the bound (~2 KiB: 1,536 bytes of
# vector, the rest key, expiry and bookkeeping, measured), and the clients' buffers are counted in
# used_memory: one request's MGET reply or SET pipeline (32 rows x ~1.6 KiB ~ 52 KiB), INFO's own
# reply (~5 KiB). Measured here: used_memory and its peak stayed below maxmemory itself.
MEMORY_SLACK_BYTES = 64 * 1024


async def test_memory_stays_bounded_under_more_rows_than_fit_and_the_hot_rows_stay(client, alpha, cache_in):
    """allkeys-lfu is what deployments run because embedding traffic is a hot set of popular queries
    plus one-off rows (a re-index): a flood of one-off rows three times what fits must evict those,
    not the popular ones, which an LRU would drop as the oldest."""
    maxmemory = cache_in.info("memory")["maxmemory"]
    hot = [f"popular query {index}" for index in range(8)]
    await embed(client, alpha, hot)
    # Each popular row read 100 times from Redis (each a frequency count; 32 rows a request).
    for _ in range(25):
        await embed(client, alpha, hot * 4)
    one_off_rows = 0
    for request in itertools.count():
        assert request < 150, "the bound was never exceeded three times over"
        rows = [f"re-index row {request}-{row}" for row in range(32)]
        await embed(client, alpha, rows)
        one_off_rows += len(rows)
        if cache_in.info("stats")["evicted_keys"] > 2 * cache_in.dbsize():
            break  # more than twice what fits evicted: the rows written were 3x the bound
    memory, stats = cache_in.info("memory"), cache_in.info("stats")
    assert memory["maxmemory_policy"] == EMBEDDING_CACHE_EVICTION
    assert memory["used_memory"] <= maxmemory + MEMORY_SLACK_BYTES, memory["used_memory"]
    assert memory["used_memory_peak"] <= maxmemory + MEMORY_SLACK_BYTES, memory["used_memory_peak"]
    assert stats["evicted_keys"] > 0 and one_off_rows > 2 * cache_in.dbsize()

    before = cache_rows()
    await embed(client, alpha, hot)
    assert {result: cache_rows()[result] - before[result] for result in before} == {
        "local": 0,
        "redis": len(hot),
        "miss": 0,
    }
    # The latest rows are mostly there too: new entries share one frequency, so each of the last
    # request's 32 writes may have evicted one of those written just before it (about one does).
    before = cache_rows()
    await embed(client, alpha, rows)
    assert cache_rows()["redis"] - before["redis"] >= 24
    # /metrics reports the server's own figures.
    found = families((await scraped(client))[0])
    assert figure(found, "embedsite_embedding_cache_redis_evicted_keys") >= stats["evicted_keys"]
    assert figure(found, "embedsite_embedding_cache_redis_memory_max_bytes") == maxmemory


# --- Through the real server: the cache's Redis killed and restarted under load --------------------


def redis_rows(samples: Samples) -> float:
    return value(samples, "embedsite_embedding_cache_rows_total", result="redis")


def lookup_failures(samples: Samples) -> float:
    return value(samples, "embedsite_embedding_cache_failures_total", operation="lookup")


async def live_metrics(http: httpx2.AsyncClient) -> Samples:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


async def until(
    http: httpx2.AsyncClient, holds: Callable[[Samples], bool], what: str, *, failed: Callable[[], list]
) -> Samples:
    """The server's /metrics once `holds` is true of them (polled); at once a failure if `failed()`
    names any."""
    deadline = time.monotonic() + HANG_DEADLINE_S
    while time.monotonic() < deadline:
        assert failed() == [], f"while waiting for {what}"
        samples = await live_metrics(http)
        if holds(samples):
            return samples
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {HANG_DEADLINE_S} s: {what}")


def vectors(response: httpx2.Response) -> np.ndarray:
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


async def test_the_cache_redis_killed_and_restarted_under_load_fails_no_request(
    cache_server: LiveServer, cache_redis_server: RedisServer
):
    """Four clients embed two popular texts and two new ones a request through the server (two
    workers, the cache on in a Redis of its own) while that Redis is SIGKILLed and, later, started
    again on its port, empty: every request is answered 200 with the vectors an uncached request
    gets; while it is down the server counts failed lookups and /metrics says it is down; once it is
    back, the popular texts are read from it again."""
    popular = [f"popular text {index}" for index in range(10)]
    answered: list[tuple[float, list[str], httpx2.Response]] = []
    numbers = itertools.count()
    stop = asyncio.Event()

    async def client_loop(http: httpx2.AsyncClient, seed: int) -> None:
        chooser = random.Random(seed)
        while not stop.is_set():
            number = next(numbers)
            # Two new texts each time: every Triton call has two rows at least. (A call of one row
            # takes another path in ONNX Runtime, which differs in the last bits, cache or not.)
            texts = [*chooser.sample(popular, 2), f"new text {number} a", f"new text {number} b"]
            started = time.monotonic()
            response = await http.post(
                "/v1/embeddings", json={"model": MODEL, "input": texts}, headers=cache_server.headers
            )
            answered.append((started, texts, response))

    def failed() -> list:
        return [
            (texts, response.status_code, response.text[:200])
            for _, texts, response in answered
            if response.status_code != 200
        ]

    async with httpx2.AsyncClient(base_url=cache_server.base_url, timeout=HANG_DEADLINE_S) as http:
        start = await live_metrics(http)
        clients = [asyncio.create_task(client_loop(http, seed)) for seed in range(4)]
        try:
            await until(
                http, lambda now: redis_rows(now) > redis_rows(start), "hits before the kill", failed=failed
            )
            cache_redis_server.kill()
            killed_at = time.monotonic()
            down = await until(
                http,
                lambda now: (
                    lookup_failures(now) > lookup_failures(start)
                    and sum(started > killed_at for started, _, _ in answered) >= 16
                ),
                "sixteen requests answered with the cache's Redis down",
                failed=failed,
            )
            assert value(down, "embedsite_embedding_cache_redis_up") == 0
            cache_redis_server.start()
            cache_redis_server.wait_until_ready()
            restarted = await live_metrics(http)
            back = await until(
                http,
                lambda now: redis_rows(now) > redis_rows(restarted),
                "hits after the restart",
                failed=failed,
            )
        finally:
            stop.set()
            await asyncio.gather(*clients)
            if cache_redis_server.process is None:  # failed while it was down: up for the session
                cache_redis_server.start()
                cache_redis_server.wait_until_ready()
        assert value(back, "embedsite_embedding_cache_redis_up") == 1

    with redis.Redis.from_url(cache_redis_server.url) as restarted_redis:
        assert restarted_redis.info("stats")["keyspace_hits"] > 0  # read from the new process
    assert failed() == []

    # The uncached vectors: another tenant's (its own entries, none yet), the popular texts in one
    # request and the new ones (two a request, so an even count) 32 a request: two rows at least.
    reference_key = tenant_with_key(cache_server.env, "cache-reference")
    new_texts = sorted({text for _, texts, _ in answered for text in texts[2:]})
    parts = [popular] + [new_texts[first : first + 32] for first in range(0, len(new_texts), 32)]
    uncached: dict[str, np.ndarray] = {}
    async with httpx2.AsyncClient(base_url=cache_server.base_url, timeout=HANG_DEADLINE_S) as http:
        for part in parts:
            response = await http.post(
                "/v1/embeddings",
                json={"model": MODEL, "input": part},
                headers={"Authorization": f"Bearer {reference_key}"},
            )
            assert response.status_code == 200, response.text
            uncached.update(zip(part, vectors(response), strict=True))
    differing = [
        texts
        for _, texts, response in answered
        if not np.array_equal(vectors(response), np.stack([uncached[text] for text in texts]))
    ]
    assert differing == []
