"""Job kinds: how a kind's chunks are embedded and written, where their usage counts, and what
happens once a job of the kind has ended.

The engine runs every job alike (chunks under leases, each written and counted once, one successor
handed out per chunk, the end settled once) and asks the job's kind (EmbeddingJob.kind, saved at
submission) only for what differs. Kinds are named in settings.JOB_KINDS (name -> the dotted path
of a JobKind), so the engine imports none of the wings built on it: the OpenAI Batch API's "batch"
kind is registered there (embeddings/services/openai_api/batches.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils.module_loading import import_string

from embeddings.callers import embedding_cache_scope
from embeddings.services.inference.catalog import embedding_model_variant
from embeddings.services.inference.embedding import (
    NO_CACHE_HITS,
    CacheHits,
    EmbeddingOptions,
    EmbeddingTarget,
    embeddings_create_sync,
)
from embeddings.services.quotas.usage import UsageEvent, usage_increments

if TYPE_CHECKING:
    from embeddings.models import EmbeddingJob, EmbeddingModel
    from embeddings.services.jobs.store import JobStore

# Writes an embedded chunk to the job store: (store, chunk number).
ChunkWrite = Callable[["JobStore", int], None]


class JobKind:
    """A plain embedding job (/v1/jobs): a chunk's texts embedded into vectors."""

    name = "embeddings"
    # The endpoint a job's usage counts under.
    usage_endpoint = "jobs"
    # Whether an operator may run a failed job's failed chunks again: their inputs are then kept
    # when the job ends (engine.py _free_inputs), until it expires.
    chunks_retryable = True

    def chunk_embed(self, job: EmbeddingJob, texts: list[str]) -> ChunkWrite:
        """Embed one chunk's inputs; returns what writes them to the job store, which the engine
        calls unless the job was cancelled meanwhile. Failures propagate to the chunk's task."""
        started = time.perf_counter()
        result = embeddings_create_sync(
            target=job_embedding_target(job.model),
            texts=texts,
            options=EmbeddingOptions(
                dimensions=job.dimensions,
                normalize=job.normalize,
                output_type=job.output_type,
                input_type=job.input_type or None,
            ),
            cache_scope=job_cache_scope(job),
        )

        def write(store: JobStore, chunk: int) -> None:
            tokens, hits = result.total_tokens, result.cache_hits
            usage = self.chunk_usage(
                job, "succeeded", inputs=len(texts), tokens=tokens, cache_hits=hits, started=started
            )
            store.finish_chunk(chunk, result.vectors, tokens=tokens, cached_tokens=hits.tokens, usage=usage)

        return write

    def ended(self, job: EmbeddingJob) -> None:
        """A job of this kind has ended: its final status is saved, its event published."""

    def chunk_usage(
        self,
        job: EmbeddingJob,
        outcome: str,
        *,
        inputs: int = 0,
        tokens: int = 0,
        cache_hits: CacheHits = NO_CACHE_HITS,
        started: float,
    ) -> dict[str, int]:
        """A chunk's usage increments, under this kind's endpoint and the variant serving the job's
        model, kept with its result and counted once (the engine's _count_usage); of its inputs and
        tokens, those the embedding cache answered are counted apart too."""
        succeeded = outcome == "succeeded"
        variant = embedding_model_variant(model=job.model)
        return usage_increments(
            UsageEvent(
                tenant_id=job.tenant_id,
                api_key_id=job.api_key_id,
                model=job.model.name,
                model_version=variant.version,
                model_dtype=variant.dtype,
                endpoint=self.usage_endpoint,
                outcome=outcome,
                inputs=inputs if succeeded else 0,
                tokens=tokens if succeeded else 0,
                latency_ms=round((time.perf_counter() - started) * 1000),
                cached_inputs=cache_hits.inputs if succeeded else 0,
                cached_tokens=cache_hits.tokens if succeeded else 0,
            )
        )


EMBEDDINGS = JobKind()


def job_kind(name: str) -> JobKind:
    """The kind a job was submitted as (settings.JOB_KINDS)."""
    return import_string(settings.JOB_KINDS[name])


def job_cache_scope(job: EmbeddingJob, model: EmbeddingModel | None = None) -> str:
    """The embedding cache scope of a job's chunk for `model` (the job's by default): its tenant's, or
    the shared one where the tenant or the model opted in (callers.py), read from their rows as the
    chunk runs, so that a tenant's or a model's change applies to jobs already queued as it does to
    requests."""
    model = job.model if model is None else model
    return embedding_cache_scope(
        tenant_id=job.tenant_id, tenant_shared=job.tenant.shared_embedding_cache, model=model
    )


def job_embedding_target(model: EmbeddingModel) -> EmbeddingTarget:
    """What a job's chunks are embedded with: the model without the synchronous per-request limits
    (a chunk is sized by JOB_CHUNK_SIZE)."""
    return dataclasses.replace(EmbeddingTarget.for_model(model), max_inputs=None, max_total_tokens=None)
