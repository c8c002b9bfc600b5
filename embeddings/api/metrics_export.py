"""GET /metrics: django-prometheus's export, with the job backlog read just before and, with the
embedding cache on, its Redis's own figures read at the scrape."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import DatabaseError
from django_prometheus.exports import ExportToDjangoView
from prometheus_client import generate_latest
from redis.exceptions import RedisError

from embeddings.metrics import (
    JOB_INPUTS_PENDING,
    JOB_OLDEST_ACTIVE_SECONDS,
    JOBS_ACTIVE,
    EmbeddingCacheRedisFigures,
)
from embeddings.redis.connections import redis_embedding_cache_sync
from embeddings.services.jobs.backlog import job_backlog

logger = logging.getLogger(__name__)


def embedding_cache_redis_info() -> dict | None:
    """The embedding cache Redis's INFO memory and stats, or None when it did not answer within
    EMBEDDING_CACHE_TIMEOUT_S (one round trip: a scrape never waits on a cache that is down)."""
    try:
        with redis_embedding_cache_sync().pipeline(transaction=False) as pipeline:
            memory, stats = pipeline.info("memory").info("stats").execute()
    except (RedisError, OSError):
        return None
    return {**memory, **stats}


def metrics(request):
    try:
        backlog = job_backlog()
    except DatabaseError as error:
        # The other metrics still say what they know; the backlog keeps its last reading.
        logger.warning("job backlog not read for /metrics: %s", error)
    else:
        for status, count in backlog.jobs_by_status.items():
            JOBS_ACTIVE.labels(status).set(count)
        JOB_INPUTS_PENDING.set(backlog.inputs_pending)
        JOB_OLDEST_ACTIVE_SECONDS.set(backlog.oldest_age_s)
    response = ExportToDjangoView(request)
    if settings.EMBEDDING_CACHE:
        # Appended, not registered: with PROMETHEUS_MULTIPROC_DIR the export builds its own registry
        # from the workers' files, and these figures are the server's, read now, not a worker's.
        response.write(generate_latest(EmbeddingCacheRedisFigures(embedding_cache_redis_info())))
    return response
