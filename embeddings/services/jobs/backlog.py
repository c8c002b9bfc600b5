"""The job backlog as /metrics reports it: active jobs, the inputs they still have to embed, and
how long the oldest has waited (one aggregate query over the indexed status column)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, F, Min, Sum
from django.utils import timezone

from embeddings.models import EmbeddingJob

ACTIVE = (EmbeddingJob.Status.QUEUED, EmbeddingJob.Status.RUNNING, EmbeddingJob.Status.CANCELLING)


@dataclass(frozen=True)
class JobBacklog:
    jobs_by_status: dict[str, int]
    inputs_pending: int
    oldest_age_s: float


def job_backlog(*, now: datetime | None = None) -> JobBacklog:
    """Every active job's count by status, their inputs not yet embedded (from the rows' progress,
    which workers update after each chunk) and the age of the oldest active one (0 when none)."""
    now = now or timezone.now()
    active = EmbeddingJob.objects.filter(status__in=ACTIVE)
    by_status = {status: 0 for status in ACTIVE}
    for row in active.values("status").annotate(jobs=Count("id")):
        by_status[row["status"]] = row["jobs"]
    totals = active.aggregate(
        pending=Sum(F("total") - F("completed") - F("failed")), oldest=Min("created_at")
    )
    oldest = totals["oldest"]
    return JobBacklog(
        jobs_by_status={str(status): count for status, count in by_status.items()},
        inputs_pending=int(totals["pending"] or 0),
        oldest_age_s=max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0,
    )
