"""What the API shows of a tenant's jobs: one job, a page of them, its object, its results' source."""

from __future__ import annotations

import re
from datetime import datetime

from django.utils import timezone

from embeddings.errors.service import JobExpired, JobNotFinished
from embeddings.models import JOB_ID_PATTERN, EmbeddingJob
from embeddings.services.jobs.kinds import EMBEDDINGS
from embeddings.services.jobs.store import JobProgress, JobStore, chunk_rows, job_store
from embeddings.services.pages import creation_page

Status = EmbeddingJob.Status
ACTIVE = EmbeddingJob.ACTIVE
# Any string but a job id (models.JOB_ID_PATTERN) names no job, and is not looked up (PostgreSQL
# refuses a query with a NUL in it).


def job_for_tenant(*, tenant_id: int, public_id: str) -> EmbeddingJob | None:
    """The tenant's job with this public id; None for an unknown id or another tenant's job."""
    if not re.fullmatch(JOB_ID_PATTERN, public_id):
        return None
    # Jobs of other kinds (a batch's) are reached through their own API only.
    return (
        EmbeddingJob.objects.select_related("model")
        .filter(tenant_id=tenant_id, public_id=public_id, kind=EMBEDDINGS.name)
        .first()
    )


def jobs_for_tenant(
    *, tenant_id: int, limit: int, after: str | None = None
) -> tuple[list[EmbeddingJob], bool]:
    """The tenant's jobs, newest first, `limit` of them after the job `after` (a cursor); has_more."""
    jobs = EmbeddingJob.objects.select_related("model").filter(tenant_id=tenant_id, kind=EMBEDDINGS.name)
    return creation_page(jobs, tenant_id=tenant_id, limit=limit, after=after, what="job")


def _timestamp(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def job_object(job: EmbeddingJob) -> dict:
    """The API representation of a job (views, WebSocket events, callbacks)."""
    error = {"code": job.error_code, "message": job.error_message} if job.error_code else None
    return {
        "id": job.public_id,
        "object": "embedding.job",
        "status": job.status,
        "model": job.model.name,
        "counts": {"total": job.total, "completed": job.completed, "failed": job.failed},
        # OpenAI's shape for tokens a cache answered (its chat usage's prompt_tokens_details).
        "usage": {
            "prompt_tokens": job.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
        },
        "created_at": _timestamp(job.created_at),
        "started_at": _timestamp(job.started_at),
        "finished_at": _timestamp(job.finished_at),
        "expires_at": _timestamp(job.expires_at),
        "error": error,
        "metadata": job.metadata,
        "encoding_format": job.encoding_format,
        "dimensions": job.dims,
        "result_dtype": job.result_dtype,
        "output_dtype": job.output_type,
        "input_type": job.input_type or None,
    }


def job_refreshed(job: EmbeddingJob) -> EmbeddingJob:
    """The job with its progress counters from Redis (one HGETALL) for a job still running; the row
    is updated when they moved. Finished jobs are returned as they are."""
    if job.status not in ACTIVE:
        return job
    job_progress_mirror(job, job_store(job).progress())
    return job


def job_progress_mirror(job: EmbeddingJob, progress: JobProgress) -> None:
    """Copy a running job's progress counters from Redis onto its row (and `job`) where they moved."""
    counters = {
        "completed": progress.completed,
        "failed": progress.failed,
        "prompt_tokens": progress.tokens,
        "cached_tokens": progress.cached_tokens,
    }
    if all(getattr(job, name) == value for name, value in counters.items()):
        return
    for name, value in counters.items():
        setattr(job, name, value)
    EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(**counters)


def job_results_source(job: EmbeddingJob) -> tuple[JobStore, list[int], int]:
    """(store, rows of each chunk, dims) to stream a finished job's results from."""
    return job_store(job), chunk_rows(job), job.dims


def job_results_download(job: EmbeddingJob) -> tuple[JobStore, list[int], int]:
    """`job_results_source` for a client: refused with JobExpired (410) once the results expired or
    were deleted, and with JobNotFinished (409) while the job runs. `job` is freshly read."""
    expired = job.expires_at is not None and job.expires_at <= timezone.now()
    if job.status == EmbeddingJob.Status.EXPIRED or expired:
        raise JobExpired(f"The results of job {job.public_id} have expired or were deleted.")
    if not job.is_finished:
        raise JobNotFinished(
            f"Job {job.public_id} is {job.status}; download its results once it has finished."
        )
    return job_results_source(job)
