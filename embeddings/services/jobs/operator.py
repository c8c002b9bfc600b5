"""What an operator may do to a job (the admin's actions call these, as the API calls the rest of
the engine): cancel it, keep it longer, run its failed chunks again, send its callback again.

    job_cancel_by_operator    the engine's job_cancel, for a queued or running job, its history
                              naming who asked
    job_extend_expiry         keep a job's results longer: to at most JOB_MAX_RETENTION_S after its
                              submission, and not while its tenant's jobs hold more than its job
                              storage budget (the job's bytes stay held against that budget until
                              the new expiry); every key of the job in the job store, and its
                              once-markers in the critical Redis, made to outlive it by a day
    job_callback_resend       deliver a finished job's callback once more (the Celery task, as at
                              the job's end)

Each refuses what does not apply with JobActionRefused, whose message says why. Only jobs of the
kind "embeddings" are acted on here: a batch's job belongs to its batch (its files, its expiry).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from celery import current_app
from django.conf import settings
from django.utils import timezone

from embeddings.errors.service import JobActionRefused
from embeddings.models import EmbeddingJob
from embeddings.services.jobs.budget import size_text, tenant_job_storage
from embeddings.services.jobs.engine import CALLBACK_TASK, job_cancel
from embeddings.services.jobs.events import job_event_keep
from embeddings.services.jobs.kinds import EMBEDDINGS
from embeddings.services.jobs.store import job_store, job_store_ttl_s
from embeddings.services.quotas.limits import quota_job_markers_extend

Status = EmbeddingJob.Status


def _when(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M} UTC"


def _by(actor: str) -> str:
    return f" by {actor}" if actor else ""


def _fresh(job: EmbeddingJob) -> EmbeddingJob:
    """The job as the database holds it now (an admin page's copy may be old), refused if it is not
    one an operator acts on here."""
    fresh = EmbeddingJob.objects.select_related("model", "tenant", "api_key").filter(pk=job.pk).first()
    if fresh is None:
        raise JobActionRefused(f"Job {job.public_id} no longer exists.")
    if fresh.kind != EMBEDDINGS.name:
        raise JobActionRefused(
            f"Job {fresh.public_id} runs a {fresh.kind}: act on it through its {fresh.kind}, not its job."
        )
    return fresh


def job_cancel_by_operator(*, job: EmbeddingJob, actor: str = "") -> EmbeddingJob:
    """Stop a queued or running job (cancelling, then cancelled once its chunks stop), as its client
    may; refused for a job that has finished."""
    job = _fresh(job)
    if job.status not in (Status.QUEUED, Status.RUNNING):
        raise JobActionRefused(f"Job {job.public_id} is {job.status}: there is nothing to cancel.")
    return job_cancel(job=job, actor=actor)


@dataclass(frozen=True)
class ExpiryExtension:
    previous: datetime
    expires_at: datetime
    # The latest expiry allowed (JOB_MAX_RETENTION_S after submission), and whether it cut the
    # extension short.
    bound: datetime
    capped: bool


def job_expiry_bound(job: EmbeddingJob) -> datetime:
    """The latest a job may expire: JOB_MAX_RETENTION_S after its submission."""
    return job.created_at + timedelta(seconds=settings.JOB_MAX_RETENTION_S)


def job_extend_expiry(*, job: EmbeddingJob, by: timedelta, actor: str = "") -> ExpiryExtension:
    """Move a job's expiry `by` later, to at most job_expiry_bound (then `capped`). Refused for an
    expired job, one already at the bound, and while its tenant holds more than its job storage
    budget (lowered since): keeping the job would keep the tenant over it longer.

    The job's keys are made to live past the new expiry before the row says so, so a failure in
    between leaves data that lives longer than announced (the expiry sweep still deletes it on
    time), never an expiry announced past its data."""
    job = _fresh(job)
    if by <= timedelta(0):
        raise JobActionRefused("An expiry can only be moved later.")
    now = timezone.now()
    if job.status == Status.EXPIRED or job.expires_at is None or job.expires_at <= now:
        raise JobActionRefused(f"Job {job.public_id} has expired: its results are gone.")
    bound = job_expiry_bound(job)
    days = settings.JOB_MAX_RETENTION_S / 86400
    if job.expires_at >= bound:
        raise JobActionRefused(
            f"Job {job.public_id} already expires at {_when(job.expires_at)}, the latest allowed: "
            f"{days:g} days after its submission (JOB_MAX_RETENTION_S)."
        )
    storage = tenant_job_storage(tenant=job.tenant)
    if storage.used_bytes > storage.budget_bytes:
        raise JobActionRefused(
            f"Tenant {job.tenant.slug}'s jobs hold {size_text(storage.used_bytes)}, more than its job "
            f"storage budget of {size_text(storage.budget_bytes)}: keeping job {job.public_id} longer "
            "would keep the tenant over it. Raise the budget or delete jobs first."
        )
    target = min(job.expires_at + by, bound)
    store = job_store(job)
    ttl_s = job_store_ttl_s(target)
    store.extend(job.chunks, ttl_s)
    quota_job_markers_extend(job_id=store.job_id, ttl_s=ttl_s)
    moved = (
        EmbeddingJob.objects.filter(pk=job.pk, expires_at=job.expires_at)
        .exclude(status=Status.EXPIRED)
        .update(expires_at=target)
    )
    if not moved:
        raise JobActionRefused(f"Job {job.public_id} changed meanwhile (expired, or extended): look again.")
    detail = f"from {_when(job.expires_at)} to {_when(target)}{_by(actor)}"
    job_event_keep(store, event="expiry_extended", detail=detail)
    return ExpiryExtension(previous=job.expires_at, expires_at=target, bound=bound, capped=target == bound)


def job_callback_resend(*, job: EmbeddingJob, actor: str = "") -> EmbeddingJob:
    """Deliver a finished job's callback again: its delivery is forgotten and the callback task sent,
    which POSTs the job as it is now (signed, retried, given up, as at the job's end). A delivery
    still being retried may then arrive too: receivers take a job's callbacks by its id."""
    job = _fresh(job)
    if not job.callback_url:
        raise JobActionRefused(f"Job {job.public_id} has no callback_url.")
    if not job.is_finished:
        raise JobActionRefused(f"Job {job.public_id} is {job.status}: its callback is sent when it finishes.")
    EmbeddingJob.objects.filter(pk=job.pk).update(callback_delivered_at=None, callback_error="")
    current_app.send_task(CALLBACK_TASK, args=[job.pk])
    if job.status != Status.EXPIRED:  # an expired job's history went with its data
        job_event_keep(job_store(job), event="callback_resent", detail=f"to {job.callback_url}{_by(actor)}")
    job.refresh_from_db()
    return job
