"""The embedding cache through the real ASGI app, the real Triton and a real Redis: order and exact
values kept, repeats not sent to Triton, tenants apart, an unreachable Redis harmless."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import numpy as np
import pytest
from asgiref.sync import sync_to_async
from prometheus_client import REGISTRY

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference import embedding
from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.inference.vector_cache import vector_cache_clear_local
from embeddings.services.quotas.limits import quota_status_sync
from embeddings.tooling.triton_server import free_port
from tests.conftest import tenant_with_key

FIRST = ["hello world", "a cached sentence", "日本語のテキスト"]
SECOND = ["new text one", "hello world", "another new one", "日本語のテキスト"]


@pytest.fixture
def cache(api_setup, embedding_cache):
    """The cache on, in the job store's Redis (emptied by api_setup), its local entries forgotten."""


@pytest.fixture
def rows_sent(monkeypatch) -> list[int]:
    sent: list[int] = []
    infer_rows = embedding._infer_rows

    async def counted(target, spec, texts, batch, deadline, **options):
        sent.append(len(batch))
        return await infer_rows(target, spec, texts, batch, deadline, **options)

    monkeypatch.setattr(embedding, "_infer_rows", counted)
    return sent


async def embed(client, tenant, texts, /, **body) -> np.ndarray:
    """POST /v1/embeddings: the answer's vectors."""
    return await posted(client, tenant, "/v1/embeddings", model="minilm", input=texts, **body)


async def posted(client, tenant, path, /, **body) -> np.ndarray:
    response = await client.post(path, json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    data = response.json()
    if "embeddings" in data:  # Cohere's /v2/embed
        return np.array(data["embeddings"]["float"], dtype=np.float32)
    return np.array([item["embedding"] for item in data["data"]], dtype=np.float32)


async def test_hits_and_misses_keep_order_and_exact_values(client, alpha, cache, rows_sent, settings):
    settings.EMBEDDING_CACHE = False
    uncached = await embed(client, alpha, SECOND)
    settings.EMBEDDING_CACHE = True
    await embed(client, alpha, FIRST)
    assert rows_sent[-1] == 3
    mixed = await embed(client, alpha, SECOND)
    assert rows_sent[-1] == 2  # "hello world" and the Japanese text came from the cache
    assert np.array_equal(mixed, uncached)  # bit-exact (float32 entries), in input order
    # From Redis alone (the process's LRU forgotten), and cut to fewer dimensions after the cache.
    vector_cache_clear_local()
    sent = len(rows_sent)
    again = await embed(client, alpha, SECOND)
    assert len(rows_sent) == sent and np.array_equal(again, uncached)
    short = await embed(client, alpha, SECOND, dimensions=64)
    assert len(rows_sent) == sent and short.shape == (4, 64)


async def test_a_repeated_request_sends_no_rows_on_every_embedding_route(
    client, alpha, cache, rows_sent, settings
):
    first = await embed(client, alpha, FIRST)
    calls = len(rows_sent)
    assert np.array_equal(await embed(client, alpha, FIRST), first)  # the express lane
    settings.EXPRESS_EMBEDDINGS = False
    assert np.array_equal(await embed(client, alpha, FIRST), first)  # the view
    assert np.array_equal(await posted(client, alpha, "/embed", inputs=FIRST), first)
    cohere = await posted(
        client,
        alpha,
        "/v2/embed",
        model="minilm",
        texts=FIRST,
        input_type="search_document",
        embedding_types=["float"],
    )
    assert len(rows_sent) == calls and cohere.shape == first.shape


async def test_another_tenant_does_not_read_the_first_ones_entries(client, alpha, beta, cache, rows_sent):
    first = await embed(client, alpha, FIRST)
    assert rows_sent == [3]
    second = await embed(client, beta, FIRST)
    assert rows_sent == [3, 3]
    assert np.array_equal(first, second)


async def test_an_unreachable_cache_answers_as_without_it(client, alpha, cache, rows_sent, settings):
    settings.EMBEDDING_CACHE = False
    uncached = await embed(client, alpha, SECOND)
    settings.EMBEDDING_CACHE = True
    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.EMBEDDING_CACHE_LOCAL_ENTRIES = 0
    reset_redis_clients()
    for _ in range(2):
        assert np.array_equal(await embed(client, alpha, SECOND), uncached)
    assert rows_sent[-2:] == [4, 4]


async def test_chunks_of_a_long_input_are_rows_like_any_other(client, alpha, cache, rows_sent, settings):
    long_text = " ".join(["a long document about caches and vectors"] * 80)
    texts = [long_text, "short one"]
    settings.EMBEDDING_CACHE = False
    uncached = await embed(client, alpha, texts, long_inputs="chunk")
    settings.EMBEDDING_CACHE = True
    first = await embed(client, alpha, texts, long_inputs="chunk")
    assert rows_sent[-1] > 2  # the long input's chunks and the short one
    sent = len(rows_sent)
    again = await embed(client, alpha, texts, long_inputs="chunk")
    assert len(rows_sent) == sent
    assert np.array_equal(first, uncached) and np.array_equal(again, uncached)


async def test_a_cache_that_never_answers_costs_at_most_its_timeout(
    client, alpha, cache, rows_sent, settings
):
    settings.EMBEDDING_CACHE = False
    uncached = await embed(client, alpha, SECOND)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        settings.EMBEDDING_CACHE = True
        settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        settings.EMBEDDING_CACHE_TIMEOUT_S = 0.2
        settings.EMBEDDING_CACHE_LOCAL_ENTRIES = 0
        reset_redis_clients()
        started = time.monotonic()
        assert np.array_equal(await embed(client, alpha, SECOND), uncached)
        # One lookup and one write, each given up after its timeout.
        assert time.monotonic() - started < 2.0
    assert rows_sent[-1] == 4


def cache_rows() -> dict[str, float]:
    return {
        result: REGISTRY.get_sample_value("embedsite_embedding_cache_rows_total", {"result": result}) or 0.0
        for result in ("local", "redis", "miss")
    }


def cache_failures(operation: str) -> float:
    return (
        REGISTRY.get_sample_value("embedsite_embedding_cache_failures_total", {"operation": operation}) or 0.0
    )


async def test_metrics_count_where_each_row_was_found_and_every_failure(client, alpha, cache, settings):
    before = cache_rows()
    await embed(client, alpha, FIRST)  # 3 misses
    await embed(client, alpha, SECOND)  # 2 from this process's entries, 2 misses
    vector_cache_clear_local()
    await embed(client, alpha, FIRST)  # 3 from Redis
    after = cache_rows()
    assert {result: after[result] - before[result] for result in after} == {"local": 2, "redis": 3, "miss": 5}
    assert REGISTRY.get_sample_value("embedsite_embedding_cache_seconds_count", {"operation": "lookup"}) >= 3

    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    vector_cache_clear_local()
    lookups, writes, misses = cache_failures("lookup"), cache_failures("write"), cache_rows()["miss"]
    await embed(client, alpha, FIRST)
    assert (cache_failures("lookup"), cache_failures("write")) == (lookups + 1, writes + 1)
    assert cache_rows()["miss"] == misses + 3


async def shared_scope(who, *, tenant: bool = False, model=None) -> None:
    """Opt `who`'s tenant (and/or `model`) in to the shared scope; the key's cached caller expires."""
    who.tenant.shared_embedding_cache = tenant
    await sync_to_async(who.tenant.save)(update_fields=["shared_embedding_cache"])
    if model is not None:
        model.shared_embedding_cache = True
        await sync_to_async(model.save)(update_fields=["shared_embedding_cache"])
        embedding_model_cache_clear()
    await asyncio.sleep(0.25)  # API_KEY_CACHE_SECONDS in these tests: 0.2


async def test_tenants_that_opt_in_share_entries_and_no_one_else_reads_them(
    client, alpha, beta, cache, rows_sent
):
    gamma = await sync_to_async(tenant_with_key)("Gamma")
    await shared_scope(alpha, tenant=True)
    first = await embed(client, alpha, FIRST)
    assert rows_sent == [3]
    assert np.array_equal(await embed(client, beta, FIRST), first)
    assert rows_sent == [3, 3]  # beta did not opt in: its own scope, nothing read from the shared one
    await shared_scope(beta, tenant=True)
    assert np.array_equal(await embed(client, beta, FIRST), first)
    assert rows_sent == [3, 3]  # now both share: every row a hit
    await shared_scope(gamma, tenant=True)
    assert np.array_equal(await embed(client, gamma, FIRST), first)
    assert rows_sent == [3, 3]


async def test_a_model_that_opts_in_shares_entries_between_all_its_tenants(
    client, alpha, beta, model, cache, rows_sent
):
    await shared_scope(alpha, model=model)
    first = await embed(client, alpha, FIRST)
    assert np.array_equal(await embed(client, beta, FIRST), first)
    assert rows_sent == [3]


async def test_usage_records_hits_apart_and_quotas_count_them_unless_told_not_to(
    client, alpha, cache, rows_sent, settings
):
    alpha.tenant.tokens_per_day = 100_000
    await sync_to_async(alpha.tenant.save)(update_fields=["tokens_per_day"])
    await asyncio.sleep(0.25)
    first = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": FIRST}, headers=alpha.headers
    )
    tokens = first.json()["usage"]["total_tokens"]
    assert await tokens_used_today(alpha) == tokens

    # SECOND: "hello world" and the Japanese text are hits.
    second = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": SECOND}, headers=alpha.headers
    )
    second_tokens = second.json()["usage"]["total_tokens"]  # the answer counts every input
    hit_tokens = sum(len(row) for row in await token_ids(client, alpha, [SECOND[1], SECOND[3]]))
    assert await tokens_used_today(alpha) == tokens + second_tokens  # counted by default

    settings.EMBEDDING_CACHE_COUNT_HITS = False
    await client.post("/v1/embeddings", json={"model": "minilm", "input": SECOND}, headers=alpha.headers)
    # All four hits: their tokens given back to the limits after the request.
    assert await tokens_used_today(alpha) == tokens + second_tokens
    assert rows_sent == [3, 2]

    usage = (await client.get("/v1/usage", headers=alpha.headers)).json()["totals"]
    # 3 + 4 + 4 embedded, and /tokenize's 2 (no tokens billed).
    assert (usage["inputs"], usage["tokens"]) == (13, tokens + 2 * second_tokens)
    assert (usage["cached_inputs"], usage["cached_tokens"]) == (2 + 4, hit_tokens + second_tokens)
    assert usage["computed_tokens"] == tokens + second_tokens - hit_tokens


async def token_ids(client, who, texts) -> list[list[int]]:
    """The ids each text is sent to Triton as (with its special tokens): TEI's /tokenize."""
    response = await client.post("/tokenize", json={"inputs": texts}, headers=who.headers)
    assert response.status_code == 200, response.text
    return [[token["id"] for token in row] for row in response.json()]


async def tokens_used_today(who) -> int:
    status = await sync_to_async(quota_status_sync)(who.tenant.pk)
    return status["tenant"]["tokens_per_day"]["used"]


async def test_the_access_log_line_counts_the_rows_the_cache_answered(client, alpha, cache, caplog):
    caplog.set_level(logging.INFO, logger="embedsite.access")
    await embed(client, alpha, FIRST)
    await embed(client, alpha, SECOND)
    lines = [record.getMessage() for record in caplog.records if record.name == "embedsite.access"]
    assert "cache_hits=0" in lines[-2] and "cache_hits=2" in lines[-1], lines


async def test_the_seed_route_and_rerank_by_similarity_read_the_cache(client, alpha, cache, rows_sent):
    await embed(client, alpha, FIRST)
    response = await client.post(
        "/v1/embedding", json=[{"query": text} for text in FIRST], headers=alpha.headers
    )
    assert response.status_code == 200, response.text
    assert rows_sent == [3]
    ranked = {"model": "minilm", "query": FIRST[0], "documents": FIRST[1:]}
    first = await client.post("/v1/rerank", json=ranked, headers=alpha.headers)
    assert first.status_code == 200, first.text
    again = await client.post("/v1/rerank", json=ranked, headers=alpha.headers)
    assert again.json()["results"] == first.json()["results"]
    # MiniLM has no query or document prompt: the ranking's rows are the texts /v1/embeddings cached.
    assert rows_sent == [3]


async def test_ready_reports_the_cache_and_stays_ready_without_it(client, cache, settings):
    body = (await client.get("/ready")).json()
    assert body["embedding_cache"]["enabled"] is True and body["embedding_cache"]["redis"] == "ok"
    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    response = await client.get("/ready")
    assert response.status_code == 200 and response.json()["status"] == "ready"
    state = response.json()["embedding_cache"]["redis"]
    assert state.startswith("unreachable (") and "127.0.0.1" not in state
