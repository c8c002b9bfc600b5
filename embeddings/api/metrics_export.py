"""GET /metrics: django-prometheus's export, with the job backlog read just before."""

from __future__ import annotations

import logging

from django.db import DatabaseError
from django_prometheus.exports import ExportToDjangoView

from embeddings.metrics import JOB_INPUTS_PENDING, JOB_OLDEST_ACTIVE_SECONDS, JOBS_ACTIVE
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
    return ExportToDjangoView(request)
