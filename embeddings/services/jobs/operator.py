"""What an operator may do to a job (the admin's actions call these, as the API calls the rest of
the engine): cancel it, keep it longer, run its failed chunks again, send its callback again.

    job_cancel_by_operator    the engine's job_cancel, for a queued or running job, its history
                              naming who asked
    job_extend_expiry         keep a job's results longer: to at most JOB_MAX_RETENTION_S after its
                              submission, and not while its tenant's jobs hold more than its job
                              storage budget (the job's bytes stay held against that budget until
                              the new expiry); every key of the job in the job store, and its
                              once-markers in the critical Redis, made to outlive it by a day
    job_retry_failed_chunks   run a failed job's failed chunks again (their inputs are kept for
                              this when it ends): it runs again and ends once they have, each
                              input counted once (the retried chunks' failures leave the counts)
                              and each chunk's usage once more, once; their tokens reserved against
                              the tenant's quota and their results' bytes against its job storage
                              budget first, or the retry is refused saying which does not fit
    job_callback_resend       deliver a finished job's callback once more (the Celery task, as at
                              the job's end)

Each refuses what does not apply with JobActionRefused, whose message says why. Only jobs of the
kind "embeddings" are acted on here: a batch's job belongs to its batch (its files, its expiry).

    job_inspect               what the job's page shows beyond its row, read from the job store:
                              each chunk's state, attempts, lease and last error, the job's kept
                              events, its download's size, what it holds, and which actions apply
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis
from celery import current_app
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from embeddings.errors.service import JobActionRefused, QuotaExceeded, StorageBudgetExceeded
from embeddings.models import EmbeddingJob, JobStorageHold
from embeddings.services.jobs import engine
from embeddings.services.jobs.budget import (
    job_storage_grow,
    job_storage_shrink,
    size_text,
    tenant_job_storage,
)
from embeddings.services.jobs.engine import CALLBACK_TASK, job_cancel, job_usage_count_pending
from embeddings.services.jobs.events import job_event_keep, job_event_publish
from embeddings.services.jobs.kinds import EMBEDDINGS
from embeddings.services.jobs.leases import ChunkState, chunk_states, chunks_reopen
from embeddings.services.jobs.reads import job_object
from embeddings.services.jobs.results import npy_size
from embeddings.services.jobs.store import JobEvent, RetryRound, chunk_rows, job_store, job_store_ttl_s
from embeddings.services.jobs.submission import (
    job_quota_caller,
    job_token_estimate,
    job_tokens_release,
    job_tokens_reserve,
    reserved_token_counters,
)
from embeddings.services.quotas.limits import quota_job_markers_extend
from embeddings.services.quotas.usage import usage_count_forget

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
    quota_job_markers_extend(job_id=store.job_id, ttl_s=ttl_s, retry_rounds=len(store.retry_rounds()))
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


@dataclass(frozen=True)
class RetryStarted:
    chunks: list[int]  # the chunks that run again
    inputs: int
    reserved_tokens: int  # 0 where QUOTAS_ENABLED is off
    held_bytes: int  # what their results may hold, added to the job's hold


def job_retry_failed_chunks(*, job: EmbeddingJob, actor: str = "") -> RetryStarted:
    """Run a failed job's failed chunks again: the job is running again, as if they had not run,
    and ends (completed, or failed if some fail again) when they have, its callback sent again.

    In order, each step undone if a later one refuses: the usage still waiting to be counted is
    counted (none may wait when the chunks' once-markers are cleared below, or it would count
    twice); their results' bytes are held (job_storage_grow) and their tokens reserved (an upper
    bound, as at submission) as a new round the job's end settles; the job store re-opens the
    chunks (leases.chunks_reopen, one script: they leave the failed counts and join the requeue
    list) and their usage markers are cleared (usage_count_forget: each run counts once); then the
    row goes from failed to running (a conditional UPDATE) and the first JOB_CHUNKS_IN_FLIGHT
    chunks go to the broker; the rest are handed out as successors, the job's fair share as before.
    Between the re-opening and the row's change the job is still failed in the database, so no
    worker or watchdog runs or ends it meanwhile. A crash in that gap leaves the job failed with
    its chunks re-opened (no longer retryable) until it expires."""
    job = _fresh(job)
    if job.status != Status.FAILED:
        raise JobActionRefused(
            f"Job {job.public_id} is {job.status}: only a failed job's failed chunks can be run again."
        )
    if job.expires_at is not None and job.expires_at <= timezone.now():
        raise JobActionRefused(f"Job {job.public_id} has expired: its inputs are gone.")
    job_usage_count_pending(job=job)
    store = job_store(job)
    failed = sorted(store.failed_chunks())
    if not failed:
        raise JobActionRefused(
            f"Job {job.public_id} has no chunk recorded as failed (it failed before failed chunks "
            "were recorded, or they are being run again): nothing to run again."
        )
    if pending := sorted(set(store.uncounted_usage()) & set(failed)):
        raise JobActionRefused(
            f"The usage of job {job.public_id}'s chunks {pending} is not counted yet (is the critical "
            "Redis reachable?): try again shortly."
        )
    rows_of = chunk_rows(job)
    tokens = 0
    for chunk in failed:
        texts = store.chunk_inputs(chunk)
        if texts is None:
            raise JobActionRefused(
                f"The inputs of job {job.public_id}'s chunk {chunk} are gone (deleted when it ended, "
                "before failed chunks' inputs were kept): its failed chunks cannot be run again."
            )
        tokens += job_token_estimate(job.model, texts, job.input_type or None)
    inputs = sum(rows_of[chunk] for chunk in failed)
    hold = JobStorageHold.objects.filter(public_id=job.public_id).first()
    extra_bytes = 0 if hold is None else math.ceil(hold.result_bytes * inputs / job.total)
    try:
        if not job_storage_grow(tenant=job.tenant, public_id=job.public_id, extra_bytes=extra_bytes):
            raise JobActionRefused(f"Job {job.public_id} holds no data any more: nothing to run again.")
    except StorageBudgetExceeded as refusal:
        raise JobActionRefused(refusal.message) from refusal
    try:
        reservation = job_tokens_reserve(job_quota_caller(job.tenant, job.api_key), tokens)
    except QuotaExceeded as refusal:
        job_storage_shrink(public_id=job.public_id, bytes_given_back=extra_bytes)
        raise JobActionRefused(
            f"Tenant {job.tenant.slug}'s quota cannot take the {tokens:,} tokens that job "
            f"{job.public_id}'s {len(failed)} failed chunks may need: {refusal.message}"
        ) from refusal
    reserved = tokens if reservation is not None else 0
    progress = store.progress()
    number = max(store.retry_rounds(), default=0) + 1
    counters = reserved_token_counters(reservation)
    retry = RetryRound(reserved, progress.tokens, progress.cached_tokens, counters)

    def undo(why: str) -> JobActionRefused:
        store.retry_round_drop(number)
        job_tokens_release(reservation)
        job_storage_shrink(public_id=job.public_id, bytes_given_back=extra_bytes)
        return JobActionRefused(why)

    store.retry_round_save(number, retry)
    reopened = chunks_reopen(
        store,
        rows={chunk: rows_of[chunk] for chunk in failed},
        chunks=job.chunks,
        window=settings.JOB_CHUNKS_IN_FLIGHT,
    )
    if not reopened.reopened:
        raise undo(f"Job {job.public_id}'s failed chunks are being run again already.")
    # Their runs so far are counted (checked above); each run again counts once more, once.
    usage_count_forget(owner=store.job_id, units=reopened.reopened)
    counts = store.progress()
    restarted = EmbeddingJob.objects.filter(pk=job.pk, status=Status.FAILED).update(
        status=Status.RUNNING,
        finished_at=None,
        error_code="",
        error_message="",
        completed=counts.completed,
        failed=counts.failed,
        reserved_tokens=F("reserved_tokens") + reserved,
        callback_delivered_at=None,
        callback_error="",
    )
    if not restarted:
        raise undo(f"Job {job.public_id} changed meanwhile (deleted or expired): look again.")
    for chunk in reopened.to_send:
        engine.chunk_send(job.pk, chunk)
    job.refresh_from_db()
    detail = (
        f"round {number}: chunks {reopened.reopened} ({inputs:,} inputs) run again{_by(actor)}; "
        f"{reserved:,} tokens reserved"
    )
    job_event_keep(store, event="retrying", detail=detail)
    job_event_publish(public_id=job.public_id, job=job_object(job))
    return RetryStarted(reopened.reopened, inputs, reserved, extra_bytes)


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


# The job page's chunk table shows this many chunks at most (a million-input job has 3,907), the
# ones an operator looks for first: running, lapsed, sent, failed, waiting, then done.
CHUNKS_SHOWN = 200
STATE_ORDER = ("running", "lease lapsed", "sent", "failed", "requeued", "queued", "not run", "done")


@dataclass(frozen=True)
class JobInspection:
    chunks: list[ChunkState]  # at most CHUNKS_SHOWN, most telling first
    chunks_by_state: dict[str, int]  # every chunk counted, in STATE_ORDER
    clock_ms: int  # the job store's clock, for lease deadlines
    events: list[JobEvent]
    download_bytes: int | None  # the .npy download's size (None: a kind without vectors)
    hold: JobStorageHold | None
    # Each action ("cancel", "extend", "retry", "resend_callback") and None where it applies now,
    # else why not.
    actions: dict[str, str | None]
    unavailable: str = ""  # why the job store's part is missing (it did not answer)


def _actions(job: EmbeddingJob, failed_inputs_kept: int | None, now: datetime) -> dict[str, str | None]:
    if job.kind != EMBEDDINGS.name:
        reason = f"a {job.kind}'s job: act on its {job.kind}"
        return dict.fromkeys(("cancel", "extend", "retry", "resend_callback"), reason)
    expired = job.status == Status.EXPIRED or (job.expires_at is not None and job.expires_at <= now)
    cancel = None if job.status in (Status.QUEUED, Status.RUNNING) else f"it is {job.status}"
    if expired:
        extend = "it has expired"
    elif job.expires_at is not None and job.expires_at >= job_expiry_bound(job):
        extend = "it expires at the latest allowed already (JOB_MAX_RETENTION_S)"
    else:
        extend = None
    if job.status != Status.FAILED:
        retry = "only a failed job's failed chunks run again"
    elif expired:
        retry = "it has expired"
    elif failed_inputs_kept is None:
        retry = "the job store did not answer"
    elif failed_inputs_kept == 0:
        retry = "no failed chunk's inputs are kept"
    else:
        retry = None
    if not job.callback_url:
        resend = "it has no callback_url"
    elif not job.is_finished:
        resend = "its callback is sent when it finishes"
    else:
        resend = None
    return {"cancel": cancel, "extend": extend, "retry": retry, "resend_callback": resend}


def job_inspect(*, job: EmbeddingJob) -> JobInspection:
    """The job's chunks, events, sizes and applicable actions (JobInspection); the job store's part
    empty, and `unavailable` saying why, when it does not answer: the page still shows the row."""
    hold = JobStorageHold.objects.filter(public_id=job.public_id).first()
    now = timezone.now()
    store = job_store(job)
    try:
        states, clock_ms = chunk_states(store, chunks=job.chunks, ended=job.is_finished)
        events = store.events()
        failed = [state.chunk for state in states if state.state == "failed"]
        failed_inputs_kept = store.inputs_kept(failed)
    except redis.RedisError as error:
        return JobInspection(
            [], {}, 0, [], None, hold, _actions(job, None, now), f"The job store did not answer: {error}"
        )
    by_state = {state: 0 for state in STATE_ORDER}
    for state in states:
        by_state[state.state] += 1
    shown = sorted(states, key=lambda state: (STATE_ORDER.index(state.state), state.chunk))[:CHUNKS_SHOWN]
    download = npy_size(store, job.total, job.dims) if job.kind == EMBEDDINGS.name else None
    return JobInspection(
        chunks=shown,
        chunks_by_state={state: count for state, count in by_state.items() if count},
        clock_ms=clock_ms,
        events=events,
        download_bytes=download,
        hold=hold,
        actions=_actions(job, failed_inputs_kept, now),
    )
