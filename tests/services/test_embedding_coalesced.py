"""Merged requests (COALESCE_REQUESTS) on the real Triton: fewer calls, the same vectors, own errors."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from embeddings.callers import Caller, QuotaLimitValues
from embeddings.errors.service import InferenceTimeout, LimitExceeded, QuotaExceeded
from embeddings.redis import keys
from embeddings.redis.connections import redis_sync
from embeddings.services.inference import embedding
from embeddings.services.inference.embedding import EmbeddingTarget
from embeddings.services.quotas.limits import RequestQuota
from embeddings.services.quotas.usage import counters_from_hash
from embeddings.tokenization import InvalidText

TEXTS = [f"query number {i}: " + "word " * (i % 9) for i in range(24)]


def calls_and_rows() -> tuple[float, float]:
    labels = {"model": "minilm"}
    return (
        REGISTRY.get_sample_value("embedsite_batch_rows_count", labels) or 0.0,
        REGISTRY.get_sample_value("embedsite_batch_rows_sum", labels) or 0.0,
    )


async def embed_each(texts: list[str], **options) -> list:
    return await asyncio.gather(
        *(
            embedding.embeddings_create(target=EmbeddingTarget("minilm"), texts=[text], **options)
            for text in texts
        ),
        return_exceptions=True,
    )


@pytest.fixture
def coalescing(service_triton, settings):
    settings.COALESCE_REQUESTS = True
    settings.COALESCE_MAX_CALLS = 1
    return settings


async def test_concurrent_requests_are_merged_and_get_the_vectors_they_would_alone(service_triton, settings):
    settings.COALESCE_REQUESTS = False
    alone = await embed_each(TEXTS)
    settings.COALESCE_REQUESTS = True
    settings.COALESCE_MAX_CALLS = 1
    calls_before, rows_before = calls_and_rows()
    merged = await embed_each(TEXTS)
    calls, rows = calls_and_rows()
    assert rows - rows_before == len(TEXTS)
    # 24 requests at once with one call at a time: at least the later ones leave together.
    assert calls - calls_before < len(TEXTS)
    for single, shared in zip(alone, merged, strict=True):
        assert np.allclose(single.vectors, shared.vectors, atol=1e-5)
        assert single.token_counts.tolist() == shared.token_counts.tolist()
    # Neighbours differ, so rows given to the wrong request could not pass by luck.
    stacked = np.concatenate([result.vectors for result in merged])
    assert (stacked[:-1] * stacked[1:]).sum(axis=1).max() < 0.9999


async def test_a_request_past_its_deadline_fails_alone(coalescing):
    late, *on_time = await asyncio.gather(
        embedding.embeddings_create(target=EmbeddingTarget("minilm"), texts=["too late"], timeout_s=1e-6),
        *(embedding.embeddings_create(target=EmbeddingTarget("minilm"), texts=[text]) for text in TEXTS[:8]),
        return_exceptions=True,
    )
    assert isinstance(late, InferenceTimeout)
    assert all(result.vectors.shape == (1, 384) for result in on_time)


async def test_a_bad_request_among_merged_ones_is_refused_alone_before_triton(coalescing):
    outcomes = await asyncio.gather(
        embedding.embeddings_create(target=EmbeddingTarget("minilm"), token_ids=[[101, 10**9, 102]]),
        *(embedding.embeddings_create(target=EmbeddingTarget("minilm"), texts=[text]) for text in TEXTS[:8]),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], InvalidText)
    assert all(result.vectors.shape == (1, 384) for result in outcomes[1:])


def usage_of(tenant_id: int) -> dict[str, int]:
    """The tenant's live usage counters that are not zero, summed by metric (requests, succeeded,
    tokens, ...)."""
    counters, _ = counters_from_hash(redis_sync().hgetall(keys.LIVE_USAGE), tenant_id=tenant_id)
    totals: dict[str, int] = {}
    for metrics in counters.values():
        for metric, value in metrics.items():
            if value and metric != "latency_ms_total":
                totals[metric] = totals.get(metric, 0) + value
    return totals


async def test_merged_requests_keep_their_own_quota_refusal_and_token_count_error(coalescing, service_redis):
    """Requests that arrive together share a Triton call; a refused quota and a wrong token count
    fail only their own request, and quotas and usage stay exact for the others."""
    paying = Caller(1, 10, QuotaLimitValues(tokens_per_day=10_000, max_concurrent_requests=20))
    spent = Caller(2, 20, QuotaLimitValues(tokens_per_day=3))
    target = EmbeddingTarget("minilm", max_total_tokens=16)

    def request(caller: Caller, **inputs):
        quota = RequestQuota(
            caller=caller, model="minilm", endpoint="embeddings", started=time.perf_counter()
        )
        return embedding.embeddings_create(target=target, quota=quota, **inputs)

    calls_before, _ = calls_and_rows()
    refused, too_long, outside_vocabulary, *served = await asyncio.gather(
        request(spent, texts=["one text too many for this tenant's day"]),
        request(paying, texts=["word " * 20]),  # 22 tokens, above the request's 16
        request(paying, token_ids=[[101, 10**9, 102]]),
        *(request(paying, texts=[text]) for text in TEXTS[:8]),
        return_exceptions=True,
    )
    calls, _ = calls_and_rows()
    assert isinstance(refused, QuotaExceeded) and refused.reason == "insufficient_quota"
    assert isinstance(too_long, LimitExceeded) and "22 tokens" in too_long.message
    assert isinstance(outside_vocabulary, InvalidText)
    assert [result.vectors.shape for result in served] == [(1, 384)] * 8
    assert calls - calls_before < 8  # the served ones shared Triton calls

    served_tokens = sum(result.total_tokens for result in served)
    assert usage_of(1) == {"requests": 8, "succeeded": 8, "inputs": 8, "tokens": served_tokens}
    assert usage_of(2) == {"requests": 1, "rejected": 1}
    (day_counter,) = redis_sync().keys("quota:{t1}:t:tpd:*")
    assert int(redis_sync().get(day_counter)) == served_tokens
    # Refused: its counter (if the script made it) holds nothing.
    assert [int(redis_sync().get(key)) for key in redis_sync().keys("quota:{t2}:t:tpd:*")] in ([], [0])
    assert redis_sync().zcard("quota:{t1}:t:concurrent") == 0  # every lease given back
