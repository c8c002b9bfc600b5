"""GET /metrics: django-prometheus's export, with the job backlog read just before and, with the
embedding cache on, its Redis's own figures read at the scrape."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import DatabaseError
from django_prometheus.exports import ExportToDjangoView
from prometheus_client import generate_latest

from embeddings.metrics import (
    JOB_INPUTS_PENDING,
    JOB_OLDEST_ACTIVE_SECONDS,
    JOBS_ACTIVE,
    EmbeddingCacheRedisFigures,
)
from embeddings.services.inference.vector_cache import vector_cache_redis_info
from embeddings.services.jobs.backlog import job_backlog

logger = logging.getLogger(__name__)


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
        response.write(generate_latest(EmbeddingCacheRedisFigures(vector_cache_redis_info())))
    return response
