"""The embedding cache through a real uvicorn and its own Redis database: repeats not sent to
Triton (the batch-row metric), cached rows bit-exact, entries stored with their TTL."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx2
import numpy as np
import pytest
import redis

from tests.api.conftest import LiveServer, live_uvicorn
from tests.api.test_metrics import MODEL, delta, parse


@pytest.fixture(scope="module")
def cache_url(job_store_server) -> str:
    # A database of the job store's server that no other test empties or reads.
    url = job_store_server.url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def caching_server(triton_server, redis_server, cache_url, tmp_path_factory) -> Iterator[LiveServer]:
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("caching_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env={
            "EMBEDDING_CACHE": "true",
            "EMBEDDING_CACHE_REDIS_URL": cache_url,
            "EMBEDDING_CACHE_TTL_S": "3600",
        },
    ) as server:
        yield server


def vectors(response: httpx2.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    rows = [
        np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in response.json()["data"]
    ]
    return np.stack(rows)


async def test_a_repeat_is_served_from_the_cache_bit_exact(caching_server, cache_url):
    async def embed(http: httpx2.AsyncClient, texts: list[str]) -> np.ndarray:
        body = {"model": MODEL, "input": texts, "encoding_format": "base64"}
        return vectors(await http.post("/v1/embeddings", json=body, headers=caching_server.headers))

    async with httpx2.AsyncClient(base_url=caching_server.base_url, timeout=60) as http:
        before = parse((await http.get("/metrics")).text)
        first = await embed(http, ["over the socket", "a second text"])
        middle = parse((await http.get("/metrics")).text)
        mixed = await embed(http, ["a new one", "a second text", "over the socket"])
        after = parse((await http.get("/metrics")).text)
    assert delta(before, middle, "embedsite_batch_rows_sum", model="minilm") == 2
    assert delta(middle, after, "embedsite_batch_rows_sum", model="minilm") == 1  # the new text alone
    assert np.array_equal(mixed[1], first[1]) and np.array_equal(mixed[2], first[0])
    store = redis.Redis.from_url(cache_url)
    keys = store.keys("embedsite:vector:*")
    assert len(keys) == 3 and all(0 < store.ttl(key) <= 3600 for key in keys)
    assert {len(store.get(key)) for key in keys} == {4 * first.shape[1]}  # full-width float32
