"""The embedding cache on the blocking path (embeddings_create_sync: Celery workers' jobs and batch
lines) against the real Triton and a real Redis: only the misses are sent, in sub-batches as
before, and the answer is the uncached one bit for bit, long inputs' chunks included."""

from __future__ import annotations

import numpy as np
import pytest

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference import embedding
from embeddings.services.inference.embedding import (
    NO_CACHE_HITS,
    CacheHits,
    EmbeddingOptions,
    EmbeddingTarget,
    embeddings_create_sync,
)
from embeddings.services.inference.vector_cache import vector_cache_clear_local
from embeddings.tooling.triton_server import free_port
from tests.conftest import texts_of_one_length

MINILM = EmbeddingTarget("minilm", "1", dimensions=384)  # pinned: what the cache keys
SCOPE = "tenant:1"


@pytest.fixture
def texts() -> tuple[list[str], list[str]]:
    """Two requests' texts, new to the cache and of one length (conftest.texts_of_one_length): the
    second repeats the first's second and third texts, in other places."""
    *first, new, other = texts_of_one_length(5)
    return first, [new, first[1], other, first[2]]


@pytest.fixture
def cache(service_triton, embedding_cache):
    """The test Triton, and the cache on in the job store's Redis (texts of the test's own)."""


@pytest.fixture
def sub_batches_sent(monkeypatch) -> list[list[int]]:
    """Each call's sub-batches (their rows) as sent to Triton."""
    sent: list[list[int]] = []
    plan = embedding._plan

    def recorded(spec, batch):
        groups = plan(spec, batch)
        sent.append([len(group.rows) for group in groups])
        return groups

    monkeypatch.setattr(embedding, "_plan", recorded)
    return sent


def embed(texts, scope=SCOPE, **options):
    return embeddings_create_sync(
        target=MINILM, texts=texts, options=EmbeddingOptions(**options), cache_scope=scope
    )


def test_only_misses_are_sent_and_the_answer_is_the_uncached_one(cache, texts, sub_batches_sent):
    first, second = texts
    uncached = embed(second, scope=None)
    assert uncached.cache_hits == NO_CACHE_HITS
    assert embed(first).cache_hits == NO_CACHE_HITS
    mixed = embed(second)
    assert sub_batches_sent[1:] == [[3], [2]]  # the second request's two new texts alone
    assert np.array_equal(mixed.vectors, uncached.vectors)  # bit-exact, in input order
    assert np.array_equal(mixed.token_counts, uncached.token_counts)
    hit_tokens = int(uncached.token_counts[[1, 3]].sum())
    assert mixed.cache_hits == CacheHits(inputs=2, rows=2, tokens=hit_tokens)
    assert mixed.cache_hits.between(0, 2) == CacheHits(inputs=1, rows=1, tokens=int(uncached.token_counts[1]))
    # From Redis alone (this process's entries forgotten), then cut to fewer dimensions after it.
    vector_cache_clear_local()
    again = embed(second)
    short = embed(second, dimensions=64)
    assert len(sub_batches_sent) == 3 and np.array_equal(again.vectors, uncached.vectors)
    assert short.vectors.shape == (4, 64) and short.cache_hits.inputs == 4


def test_another_scope_reads_none_of_the_entries(cache, texts, sub_batches_sent):
    first, _ = texts
    cached = embed(first)
    other = embed(first, scope="tenant:2")
    assert sub_batches_sent == [[3], [3]] and other.cache_hits == NO_CACHE_HITS
    assert np.array_equal(cached.vectors, other.vectors)


def test_misses_are_sent_in_sub_batches_as_before(cache, settings, sub_batches_sent):
    """A request bigger than one sub-batch: its misses are planned into sub-batches of at most
    MAX_BATCH_TOKENS as without the cache (three rows each here), and the answer is the same."""
    many = texts_of_one_length(12)
    (width,) = set(embed(many, scope=None).token_counts)
    settings.MAX_BATCH_TOKENS = 3 * int(width)
    uncached = embed(many, scope=None)
    embed(many[::2])
    mixed = embed(many)
    assert sub_batches_sent[1:] == [[3, 3, 3, 3], [3, 3], [3, 3]]
    assert np.array_equal(mixed.vectors, uncached.vectors) and mixed.cache_hits.inputs == 6


def test_chunks_of_long_inputs_are_rows_like_any_other(cache, sub_batches_sent):
    short, long_start = texts_of_one_length(2)
    both = [long_start + " and vectors" * 200, short]
    uncached = embed(both, scope=None, chunk=True)
    chunks = sum(sub_batches_sent[0])
    assert chunks > 2
    first = embed(both, chunk=True)
    again = embed(both, chunk=True)
    assert len(sub_batches_sent) == 2  # the third call sent nothing
    assert np.array_equal(first.vectors, uncached.vectors) and np.array_equal(again.vectors, uncached.vectors)
    assert again.cache_hits == CacheHits(inputs=2, rows=chunks, tokens=int(uncached.token_counts.sum()))
    # Of the long input alone: its chunks, not the short one's row.
    assert again.cache_hits.between(0, 1) == CacheHits(
        inputs=1, rows=chunks - 1, tokens=int(uncached.token_counts[0])
    )


def test_an_unreachable_cache_costs_nothing_but_misses(cache, settings, texts, sub_batches_sent):
    _, second = texts
    uncached = embed(second, scope=None)
    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.EMBEDDING_CACHE_LOCAL_ENTRIES = 0
    reset_redis_clients()
    for _ in range(2):
        result = embed(second)
        assert np.array_equal(result.vectors, uncached.vectors) and result.cache_hits == NO_CACHE_HITS
    assert sub_batches_sent == [[4], [4], [4]]
