"""Merged requests (COALESCE_REQUESTS) on the real Triton: fewer calls, the same vectors, own errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import REGISTRY

from embeddings.errors.service import InferenceTimeout
from embeddings.services.inference import embedding
from embeddings.services.inference.embedding import EmbeddingTarget
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
