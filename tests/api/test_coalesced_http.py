"""Merged requests (COALESCE_REQUESTS) through a real uvicorn: shared calls, per-request answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx2
import pytest

from tests.api.conftest import LiveServer, live_uvicorn
from tests.api.test_metrics import MODEL, delta, parse


@pytest.fixture(scope="module")
def coalescing_server(triton_server, redis_server, tmp_path_factory) -> Iterator[LiveServer]:
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("coalescing_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env={"COALESCE_REQUESTS": "true", "COALESCE_MAX_CALLS": "1"},
    ) as server:
        yield server


async def test_concurrent_requests_share_calls_and_keep_their_own_usage(coalescing_server):
    texts = [f"query {i} " + "word " * i for i in range(16)]

    async def one(http: httpx2.AsyncClient, text: str) -> httpx2.Response:
        return await http.post(
            "/v1/embeddings", json={"model": MODEL, "input": text}, headers=coalescing_server.headers
        )

    async with httpx2.AsyncClient(base_url=coalescing_server.base_url, timeout=60) as http:
        before = parse((await http.get("/metrics")).text)
        together = await asyncio.gather(*(one(http, text) for text in texts))
        after = parse((await http.get("/metrics")).text)
        alone = [await one(http, text) for text in texts[:3]]
    assert [response.status_code for response in together] == [200] * len(texts)
    rows = delta(before, after, "embedsite_batch_rows_sum", model="minilm")
    calls = delta(before, after, "embedsite_batch_rows_count", model="minilm")
    assert rows == len(texts) and calls < len(texts)
    # Each request is billed its own tokens: longer texts, more tokens, as when sent alone.
    usage = [response.json()["usage"]["prompt_tokens"] for response in together]
    assert usage == sorted(usage) and len(set(usage)) == len(texts)
    for merged, single in zip(together, alone, strict=False):
        assert merged.json()["usage"] == single.json()["usage"]
        merged_vector = merged.json()["data"][0]["embedding"]
        single_vector = single.json()["data"][0]["embedding"]
        assert max(abs(a - b) for a, b in zip(merged_vector, single_vector, strict=True)) < 1e-5
