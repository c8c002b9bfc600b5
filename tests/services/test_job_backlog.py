"""The job backlog /metrics reports: active jobs by status, their inputs not yet embedded, the
oldest one's age; finished jobs count for nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from embeddings.models import EmbeddingJob, EmbeddingModel
from embeddings.services.jobs.backlog import job_backlog

Status = EmbeddingJob.Status


@pytest.fixture
def job(alpha):
    model = EmbeddingModel.objects.create(name="backlog-model", triton_model="b", dimensions=4, max_tokens=16)
    numbers = iter(range(1, 100))
    now = timezone.now()

    def make(
        status: str, *, total: int, completed: int = 0, failed: int = 0, age_s: float = 0
    ) -> EmbeddingJob:
        return EmbeddingJob.objects.create(
            public_id=f"job_backlog{next(numbers)}",
            tenant=alpha,
            model=model,
            status=status,
            total=total,
            completed=completed,
            failed=failed,
            created_at=now - timedelta(seconds=age_s),
        )

    make.now = now
    return make


def test_an_empty_backlog_is_zeros(db):
    backlog = job_backlog()
    assert backlog.jobs_by_status == {"queued": 0, "running": 0, "cancelling": 0}
    assert (backlog.inputs_pending, backlog.oldest_age_s) == (0, 0.0)


def test_active_jobs_count_their_inputs_not_yet_embedded(job):
    job(Status.QUEUED, total=100, age_s=60)
    job(Status.RUNNING, total=50, completed=20, failed=5, age_s=600)
    job(Status.CANCELLING, total=10, completed=10)
    job(Status.COMPLETED, total=1000, completed=1000, age_s=86400)
    job(Status.FAILED, total=7, failed=3, age_s=86400)
    backlog = job_backlog(now=job.now + timedelta(seconds=5))
    assert backlog.jobs_by_status == {"queued": 1, "running": 1, "cancelling": 1}
    assert backlog.inputs_pending == 100 + 25
    assert backlog.oldest_age_s == 605
