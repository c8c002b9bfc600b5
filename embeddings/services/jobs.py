"""Asynchronous embedding jobs: submission, the chunk engine the Celery tasks run, and the job's life.

A job's inputs, results and progress live in the job store (JOB_STORE_URL,
embeddings.services.job_store), its state in the EmbeddingJob row; its quota reservation and usage
in the critical Redis (REDIS_URL). Life of a job:

    job_create     validate, idempotency, max concurrent jobs, admit its bytes against the job
                   storage budgets (embeddings.services.job_storage), reserve the whole job's
                   tokens (an upper bound), store the inputs, save the row, and after the commit
                   hand out the first JOB_CHUNKS_IN_FLIGHT chunks to the broker.
    job_chunk_run  (a Celery task per chunk) embed one chunk under a lease its heartbeat keeps
                   alive (embeddings.services.job_leases), write it with its usage increments
                   (one script: JobStore.finish_chunk), count that usage in the critical Redis
                   (once per chunk: usage_count_once), mirror progress, and hand out exactly one
                   successor chunk. A redelivered chunk counts what a dead worker wrote but did
                   not count; so do the watchdog and the job's end, for every chunk.
    job_finalize   exactly once: completed | failed | cancelled, counts, tokens settled against
                   the reservation (the unused rest refunded), inputs deleted (their bytes given
                   back), event published, callback enqueued.
    job_watchdog   (beat, every JOB_WATCHDOG_INTERVAL_S) re-sends a chunk whose lease lapsed (its
                   worker died mid-chunk) and one handed out JOB_STALL_S ago that never started
                   (its message lost), hands out the successor a dead worker did not, finalises
                   what is done: a lost worker's job resumes within about JOB_CHUNK_LEASE_S +
                   JOB_WATCHDOG_INTERVAL_S.
    job_expire_due (beat) jobs past expires_at become expired and their Redis data goes (and
                   the bytes they held).

Batches (embeddings.services.batches) run as jobs whose inputs are OpenAI request lines: their
chunks write output lines (services/batch_lines.py) instead of vectors, and job_finalize hands the
ended job's batch to its finalisation; /v1/jobs does not list them.

Fair share: a job never has more than JOB_CHUNKS_IN_FLIGHT chunks in the broker. Each finished
chunk hands out one successor, taken from the job's Redis counter `next`, and only once per chunk
(the `handoff` hash), so a redelivered chunk neither sends extra chunks nor loses the job's slot.
With workers prefetching one message, a tenant's million-text job and another tenant's small job
take turns in the queue instead of the small one waiting behind the whole big one.

Quotas: at submission the job counts as one request against requests per minute, and its tokens
(an upper bound: min(max tokens, UTF-8 bytes + prompt + 2) per input, no tokenisation) are reserved
against tokens per day and per month. Tokens per minute and concurrent requests do not apply (a
job's tokens are spent over its whole run; concurrent jobs are bounded by max_concurrent_jobs,
counted in the database under a per-tenant Redis lock so the limit holds across processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import secrets
import string
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from celery import current_app
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from embeddings.callers import NO_LIMITS, Caller
from embeddings.models import ApiKey, Batch, EmbeddingJob, EmbeddingModel, Tenant
from embeddings.observability import context as request_context
from embeddings.redis import keys as redis_keys
from embeddings.redis.connections import redis_job_store, redis_sync
from embeddings.services.batch_lines import LineRequest, RenderError, batch_chunk_embed
from embeddings.services.embedding import (
    EmbeddingOptions,
    EmbeddingTarget,
    dimensions_check,
    embeddings_create_sync,
)
from embeddings.services.errors import (
    InvalidRequest,
    JobConflict,
    JobExpired,
    JobNotFinished,
    JobQueueUnavailable,
    QuotaExceeded,
)
from embeddings.services.job_events import job_event_publish
from embeddings.services.job_inputs import job_inputs_count_check
from embeddings.services.job_leases import (
    ChunkLease,
    chunk_hand_off,
    chunk_mark_sent,
    chunk_take_next,
    chunks_scan,
    live_leases,
)
from embeddings.services.job_storage import (
    job_storage_admit,
    job_storage_need,
    job_storage_release,
    job_storage_settle,
)
from embeddings.services.job_store import JobStore, inputs_encode
from embeddings.services.pages import creation_page
from embeddings.services.quotas import (
    QuotaHolder,
    QuotaLimitValues,
    Reservation,
    quota_refund_forget,
    quota_refund_once,
    quota_release_sync,
    quota_reserve_sync,
)
from embeddings.services.result_dtypes import RESULT_DTYPES
from embeddings.services.usage import UsageEvent, usage_count_once, usage_increments

logger = logging.getLogger(__name__)

Status = EmbeddingJob.Status
ACTIVE = (Status.QUEUED, Status.RUNNING, Status.CANCELLING)
ENCODING_FORMATS = ("float", "base64")
CHUNK_TASK = "embeddings.tasks.job_chunk_task"
CALLBACK_TASK = "embeddings.tasks.job_callback_task"
BATCH_FINALIZE_TASK = "embeddings.tasks.batch_finalize_task"
PUBLIC_ID_ALPHABET = string.ascii_lowercase + string.digits
# Every id _new_public_id draws: any other string names no job, and is not looked up (PostgreSQL
# refuses a query with a NUL in it).
JOB_ID_PATTERN = r"job_[a-z0-9]{24}"
# Progress events at most this often per job (each finished chunk when chunks are slower).
EVENT_INTERVAL_S = 0.5
# Chunks go to the broker below the default priority (0, which Redis serves first), so beat's
# tasks (the watchdog above all) are not stuck behind a backlog of chunks: each expires after one
# interval, and behind a backlog longer than that it would never run. What the watchdog re-sends
# goes ahead of the backlog: a dead worker's job resumes without queueing again.
CHUNK_PRIORITY = 6
RESENT_CHUNK_PRIORITY = 3


@dataclass(frozen=True)
class JobSpec:
    """What a client asked to embed, and how."""

    model: EmbeddingModel
    texts: list[str]
    ids: list[str] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool = True
    metadata: dict = field(default_factory=dict)
    callback_url: str = ""
    # How the results are stored (services/result_dtypes.py); None: the model's result_dtype.
    result_dtype: str | None = None
    # A batch's job (services/batches.py): each input is one request line, whose token estimate,
    # chunk size and output size the batch computes; None: a plain job's.
    token_estimate: int | None = None
    chunk_size: int | None = None
    result_bytes_per_input: int | None = None


# --- Redis -----------------------------------------------------------------------------------------


def job_store(job: EmbeddingJob) -> JobStore:
    """The job's data in the job store; kept a day past expires_at at most (expiry deletes it first)."""
    return JobStore(
        redis_job_store(),
        job.public_id,
        ttl_s=settings.JOB_RESULT_TTL_S + 86400,
        result_dtype=job.result_dtype,
    )


def _delete_data(job: EmbeddingJob) -> None:
    """Delete the job's Redis data, then give back the bytes it held (a failure in between leaves
    them held: counted too much until the sweep, never too little)."""
    store = job_store(job)
    _count_usage(store)
    store.delete(job.chunks)
    quota_refund_forget(job_id=store.job_id)
    job_storage_release(public_id=job.public_id)


def _count_usage(store: JobStore, chunk: int | None = None) -> None:
    """Count in the critical Redis the usage of finished chunks (one, or all of the job's) that is
    not counted yet, then forget it in the job store. Each chunk counts once however often this
    runs (usage_count_once keeps a marker per chunk), so a worker that died between writing a
    chunk and counting it leaves its usage to the next call, not lost and not doubled."""
    pending = store.uncounted_usage(chunk)
    for number, increments in pending.items():
        usage_count_once(owner=store.job_id, unit=number, increments=increments, ttl_s=store.ttl_s)
    store.forget_usage(list(pending))


# --- Submission ------------------------------------------------------------------------------------


def _new_public_id() -> str:
    return "job_" + "".join(secrets.choice(PUBLIC_ID_ALPHABET) for _ in range(24))


def _limits(tenant_id: int, api_key_id: int | None) -> tuple[Tenant, ApiKey | None]:
    tenant = Tenant.objects.get(pk=tenant_id)
    api_key = None if api_key_id is None else ApiKey.objects.get(pk=api_key_id, tenant_id=tenant_id)
    return tenant, api_key


def _validate(spec: JobSpec, tenant: Tenant, api_key: ApiKey | None) -> None:
    if not spec.texts:
        raise InvalidRequest("input must contain at least one item", param="input")
    if spec.ids is not None and len(spec.ids) != len(spec.texts):
        raise InvalidRequest("ids and input must have the same length", param="input")
    if spec.encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
    if spec.result_dtype is not None and spec.result_dtype not in RESULT_DTYPES:
        raise InvalidRequest(
            f"result_dtype must be one of {', '.join(map(repr, RESULT_DTYPES))}", param="result_dtype"
        )
    dimensions_check(dimensions=spec.dimensions, model_dimensions=spec.model.dimensions)
    caller = Caller(
        tenant.pk,
        None if api_key is None else api_key.pk,
        QuotaLimitValues.of(tenant),
        NO_LIMITS if api_key is None else QuotaLimitValues.of(api_key),
    )
    job_inputs_count_check(count=len(spec.texts), caller=caller)


def job_token_estimate(model: EmbeddingModel, texts: list[str]) -> int:
    """An upper bound of the job's tokens without tokenising: a wordpiece/BPE token covers at least
    one UTF-8 byte, plus the prompt and two special tokens, capped by the model's maximum."""
    prompt = len((model.prompts or {}).get(model.default_prompt_name, "").encode())
    cap = model.max_tokens
    return sum(min(cap, len(text.encode()) + prompt + 2) for text in texts)


def _job_quota_subject(tenant: Tenant, api_key: ApiKey | None) -> QuotaHolder:
    def job_limits(owner) -> QuotaLimitValues:
        values = QuotaLimitValues.of(owner)
        return dataclasses.replace(values, tokens_per_minute=None, max_concurrent_requests=None)

    key_limits = job_limits(api_key) if api_key is not None else QuotaLimitValues()
    return QuotaHolder(tenant.pk, None if api_key is None else api_key.pk, job_limits(tenant), key_limits)


def _reserve(subject: QuotaHolder, tokens: int) -> Reservation | None:
    if not settings.QUOTAS_ENABLED:
        return None
    # inputs=0: a job's size is checked against max_inputs_per_job, not the per-request limit.
    return quota_reserve_sync(subject=subject, inputs=0, tokens=tokens)


def _refund(reservation: Reservation | None) -> None:
    if reservation is not None and reservation.holds_anything:
        quota_release_sync(reservation=reservation, refund=True)


def _find_existing(tenant_id: int, idempotency_key: str, fingerprint: str) -> EmbeddingJob | None:
    existing = EmbeddingJob.objects.filter(tenant_id=tenant_id, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != fingerprint:
        raise JobConflict(
            "This Idempotency-Key was used for a different request; use a new key", param="Idempotency-Key"
        )
    return existing


class _SubmitLock:
    """Serialises submissions of one tenant while max_concurrent_jobs is counted (only when a limit
    applies); a lock lost to a dead process expires."""

    def __init__(self, tenant_id: int, needed: bool) -> None:
        self.lock = redis_sync().lock(redis_keys.job_submit_lock(tenant_id), timeout=30, blocking_timeout=10)
        self.needed = needed

    def __enter__(self):
        if self.needed and not self.lock.acquire():
            raise QuotaExceeded(
                "Too many job submissions at once for this tenant; retry shortly.",
                reason="rate_limit_exceeded",
                kind="requests",
                retry_after_s=1,
            )
        return self

    def __exit__(self, *exc_info):
        if self.needed:
            with contextlib.suppress(redis.exceptions.LockError):  # expired meanwhile
                self.lock.release()


def _check_concurrent(tenant: Tenant, api_key: ApiKey | None) -> None:
    for owner, field_name, who in (
        (tenant, "tenant_id", "this tenant"),
        (api_key, "api_key_id", "this API key"),
    ):
        if owner is None or owner.max_concurrent_jobs is None:
            continue
        active = EmbeddingJob.objects.filter(**{field_name: owner.pk}, status__in=ACTIVE).count()
        if active >= owner.max_concurrent_jobs:
            raise QuotaExceeded(
                f"Too many concurrent jobs for {who}: limit {owner.max_concurrent_jobs}. "
                "Submit again when one has finished.",
                reason="rate_limit_exceeded",
                kind="requests",
                retry_after_s=5,
            )


def job_create(
    *,
    tenant_id: int,
    api_key_id: int | None,
    spec: JobSpec,
    idempotency_key: str = "",
    fingerprint: str = "",
) -> tuple[EmbeddingJob, bool]:
    """Submit a job; (job, created). The same idempotency key and fingerprint return the existing
    job (created False); the key with another fingerprint raises JobConflict.

    Raises InvalidRequest, LimitExceeded, QuotaExceeded (429), StorageBudgetExceeded (413 or 429:
    the job's bytes do not fit a job storage budget; nothing was stored), JobConflict (409),
    JobQueueUnavailable (503: the broker refused the first chunks; nothing is left behind) and
    RedisError. Not to be
    called inside a transaction: the concurrent-jobs count is exact only when the row commits under
    the submission lock.
    """
    if idempotency_key:
        existing = _find_existing(tenant_id, idempotency_key, fingerprint)
        if existing is not None:
            return existing, False
    tenant, api_key = _limits(tenant_id, api_key_id)
    _validate(spec, tenant, api_key)
    model = spec.model
    subject = _job_quota_subject(tenant, api_key)
    estimate = job_token_estimate(model, spec.texts) if spec.token_estimate is None else spec.token_estimate
    size = spec.chunk_size or settings.JOB_CHUNK_SIZE
    dims = spec.dimensions or model.dimensions
    result_dtype = spec.result_dtype or model.result_dtype
    if spec.result_bytes_per_input is not None:
        # A batch's output lines, held as if float32 values: admitted by their estimated bytes.
        dims, result_dtype = math.ceil(spec.result_bytes_per_input / 4), "float32"
    chunks = math.ceil(len(spec.texts) / size)
    now = timezone.now()
    job = EmbeddingJob(
        public_id=_new_public_id(),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        model=model,
        status=Status.QUEUED,
        encoding_format=spec.encoding_format,
        dimensions=spec.dimensions,
        normalize=spec.normalize,
        metadata=spec.metadata or {},
        callback_url=spec.callback_url,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        total=len(spec.texts),
        chunk_size=size,
        chunks=chunks,
        dims=dims,
        result_dtype=result_dtype,
        has_ids=spec.ids is not None,
        reserved_tokens=estimate,
        created_at=now,
        expires_at=now + timedelta(seconds=settings.JOB_RESULT_TTL_S),
    )
    limited = tenant.max_concurrent_jobs is not None or (api_key is not None and api_key.max_concurrent_jobs)
    store = job_store(job)
    # Encoded once, before any lock: their exact stored size is what admission counts.
    text_chunks = [spec.texts[start : start + size] for start in range(0, job.total, size)]
    id_chunks = None
    if spec.ids is not None:
        id_chunks = [[str(i) for i in spec.ids[start : start + size]] for start in range(0, job.total, size)]
    inputs = inputs_encode(text_chunks, id_chunks)
    need = job_storage_need(inputs=inputs, rows=job.total, dims=job.dims, result_dtype=job.result_dtype)
    reservation: Reservation | None = None
    with _SubmitLock(tenant_id, needed=bool(limited)):
        _check_concurrent(tenant, api_key)
        # StorageBudgetExceeded here leaves nothing behind: no bytes held, no tokens reserved.
        job_storage_admit(tenant=tenant, public_id=job.public_id, need=need)
        try:
            reservation = _reserve(subject, estimate)
            store.put_encoded_inputs(inputs)
            if reservation is not None and reservation.counters:
                keys = [c.key for c in reservation.counters if c.window.kind == "tokens"]
                store.put_reservation(keys)
            with transaction.atomic():
                job.save(force_insert=True)
                transaction.on_commit(lambda: _dispatch(job))
        except IntegrityError:
            # Another submission with the same idempotency key committed first.
            _undo(job, reservation)
            existing = _find_existing(tenant_id, idempotency_key, fingerprint)
            if existing is None:
                raise
            return existing, False
        except BaseException:
            _undo(job, reservation)
            raise
    # The submitting request's id goes with this line and, in their message headers, with every
    # chunk task (embeddings/observability/celery_hooks.py): the job's logs name the request.
    request_context.annotate(job=job.public_id)
    logger.info("job %s submitted: %d inputs in %d chunks", job.public_id, job.total, job.chunks)
    return job, True


def _undo(job: EmbeddingJob, reservation: Reservation | None) -> None:
    """Take back a submission that failed part way: its row, Redis data, held bytes and reserved
    tokens."""
    try:
        if job.pk is not None:
            EmbeddingJob.objects.filter(pk=job.pk).delete()
        try:
            _delete_data(job)
        except redis.RedisError as error:
            # The job store is down (what failed the submission, often): the caller's error says
            # so, and whatever got in expires with the job's TTL.
            logger.warning("job %s: data not deleted after a failed submission: %s", job.public_id, error)
    finally:
        _refund(reservation)


def _dispatch(job: EmbeddingJob) -> None:
    """Send the job's first window of chunks (after the commit: workers must find the row)."""
    try:
        for _ in range(min(settings.JOB_CHUNKS_IN_FLIGHT, job.chunks)):
            _send_next(job)
    except Exception as error:
        raise JobQueueUnavailable(
            "The job queue does not answer, so the job was not submitted; retry shortly."
        ) from error


def _send_next(job: EmbeddingJob) -> None:
    chunk = chunk_take_next(job_store(job), chunks=job.chunks)
    if chunk < job.chunks:
        _send_chunk(job.pk, chunk)


def _send_chunk(job_id: int, chunk: int, priority: int = CHUNK_PRIORITY) -> None:
    current_app.send_task(CHUNK_TASK, args=[job_id, chunk], priority=priority)


# --- Reads -----------------------------------------------------------------------------------------


def job_for_tenant(*, tenant_id: int, public_id: str) -> EmbeddingJob | None:
    """The tenant's job with this public id; None for an unknown id or another tenant's job."""
    if not re.fullmatch(JOB_ID_PATTERN, public_id):
        return None
    # A batch's job is reached through /v1/batches only.
    return (
        EmbeddingJob.objects.select_related("model")
        .filter(tenant_id=tenant_id, public_id=public_id, batch__isnull=True)
        .first()
    )


def jobs_for_tenant(
    *, tenant_id: int, limit: int, after: str | None = None
) -> tuple[list[EmbeddingJob], bool]:
    """The tenant's jobs, newest first, `limit` of them after the job `after` (a cursor); has_more."""
    jobs = EmbeddingJob.objects.select_related("model").filter(tenant_id=tenant_id, batch__isnull=True)
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
        "usage": {"prompt_tokens": job.prompt_tokens},
        "created_at": _timestamp(job.created_at),
        "started_at": _timestamp(job.started_at),
        "finished_at": _timestamp(job.finished_at),
        "expires_at": _timestamp(job.expires_at),
        "error": error,
        "metadata": job.metadata,
        "encoding_format": job.encoding_format,
        "dimensions": job.dims,
        "result_dtype": job.result_dtype,
    }


def job_refreshed(job: EmbeddingJob) -> EmbeddingJob:
    """The job with its progress counters from Redis (one HGETALL) for a job still running; the row
    is updated when they moved. Finished jobs are returned as they are."""
    if job.status not in ACTIVE:
        return job
    progress = job_store(job).progress()
    if (progress.completed, progress.failed, progress.tokens) != (
        job.completed,
        job.failed,
        job.prompt_tokens,
    ):
        job.completed, job.failed, job.prompt_tokens = progress.completed, progress.failed, progress.tokens
        EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
            completed=job.completed, failed=job.failed, prompt_tokens=job.prompt_tokens
        )
    return job


def job_results_source(job: EmbeddingJob) -> tuple[JobStore, list[int], int]:
    """(store, rows of each chunk, dims) to stream a finished job's results from."""
    return job_store(job), _chunk_rows(job), job.dims


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


# --- Cancel, delete, expire ------------------------------------------------------------------------


def job_cancel(*, job: EmbeddingJob) -> EmbeddingJob:
    """Ask a queued or running job to stop: cancelling now, cancelled once its chunks stop (each
    checks the flag before and after embedding). A finished job is returned unchanged."""
    if job.status not in (Status.QUEUED, Status.RUNNING):
        return job
    job_store(job).cancel()
    EmbeddingJob.objects.filter(pk=job.pk, status__in=(Status.QUEUED, Status.RUNNING)).update(
        status=Status.CANCELLING
    )
    job.refresh_from_db()
    _publish(job, force=True)
    return job


def job_delete(*, job: EmbeddingJob) -> None:
    """Delete a job: a running one is cancelled first (its reservation settled), then its Redis data
    and its row go (a later GET is 404; usage already recorded stays)."""
    if job.status in ACTIVE:
        job_store(job).cancel()
        EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(status=Status.CANCELLING)
        job_finalize(job_id=job.pk, status=Status.CANCELLED, publish=False)
    _delete_data(job)
    EmbeddingJob.objects.filter(pk=job.pk).delete()


def job_expire_due(*, now: datetime | None = None) -> int:
    """Expire every job past expires_at: its Redis data deleted, status expired (a job still running
    then is stopped, its reservation settled). Returns how many."""
    now = now or timezone.now()
    expired = 0
    for job in EmbeddingJob.objects.filter(expires_at__lte=now).exclude(status=Status.EXPIRED).iterator():
        if job.status in ACTIVE:
            job_store(job).cancel()
            job_finalize(job_id=job.pk, status=Status.CANCELLED, publish=False)
        _delete_data(job)
        if (
            EmbeddingJob.objects.filter(pk=job.pk)
            .exclude(status=Status.EXPIRED)
            .update(status=Status.EXPIRED)
        ):
            expired += 1
    return expired


# --- The engine: one chunk -------------------------------------------------------------------------


def job_embedding_target(model: EmbeddingModel) -> EmbeddingTarget:
    """What a job's chunks are embedded with: the model without the synchronous per-request limits
    (a chunk is sized by JOB_CHUNK_SIZE)."""
    return dataclasses.replace(EmbeddingTarget.for_model(model), max_inputs=None, max_total_tokens=None)


def _publish(job: EmbeddingJob, *, force: bool = False) -> None:
    """Publish the job's state, at most every EVENT_INTERVAL_S per job unless forced (start, end)."""
    if not force and not job_store(job).event_due(EVENT_INTERVAL_S):
        return
    job_event_publish(public_id=job.public_id, job=job_object(job))


def _mark_started(job: EmbeddingJob) -> None:
    now = timezone.now()
    if EmbeddingJob.objects.filter(pk=job.pk, status=Status.QUEUED).update(
        status=Status.RUNNING, started_at=now
    ):
        job.status, job.started_at = Status.RUNNING, now
        _publish(job, force=True)


def job_chunk_run(*, job_id: int, chunk: int, render_error: RenderError | None = None) -> None:
    """Embed one chunk of a job and write it once; hand out the job's next chunk.

    Runs under the chunk's lease (ChunkLease: renewed by a heartbeat while it embeds, so a long
    chunk is never re-sent while its worker lives). Triton errors (TritonUnavailable, TritonTimeout,
    ...) propagate: the Celery task retries them and calls job_chunk_give_up after the last. A
    chunk that ran before (redelivered, or re-sent by the watchdog) writes and counts nothing
    again, and hands out no second successor. A batch's chunk (its inputs are request lines)
    writes OpenAI's output lines instead of vectors, their errors rendered by `render_error`.
    """
    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None:
        return
    store = job_store(job)
    if job.status not in ACTIVE:
        _count_usage(store, chunk)  # written by a worker that died before counting it
        return
    if job.status == Status.CANCELLING or store.is_cancelled():
        _finish_cancelled(job)
        return
    _mark_started(job)
    with ChunkLease(store, chunk):
        if not store.is_chunk_done(chunk):
            texts = store.chunk_inputs(chunk)
            if texts is None:  # deleted or expired under us
                return
            if Batch.objects.filter(job_id=job.pk).exists():
                written = _batch_chunk_run(job, store, chunk, texts, render_error)
            else:
                written = _vectors_chunk_run(job, store, chunk, texts)
            if not written:
                return
        # Also when the chunk was done before: its first run may have died before counting.
        _count_usage(store, chunk)
        _after_chunk(job, store, chunk)


def _vectors_chunk_run(job: EmbeddingJob, store: JobStore, chunk: int, texts: list[str]) -> bool:
    """Embed a job's chunk of texts and write its vectors once; False if the job was cancelled
    meanwhile (it is finished as cancelled)."""
    started = time.perf_counter()
    result = embeddings_create_sync(
        target=job_embedding_target(job.model),
        texts=texts,
        options=EmbeddingOptions(dimensions=job.dimensions, normalize=job.normalize),
    )
    if store.is_cancelled():
        _finish_cancelled(job)
        return False
    usage = _usage(job, "succeeded", len(texts), result.total_tokens, started)
    store.finish_chunk(chunk, result.vectors, tokens=result.total_tokens, usage=usage)
    return True


def _batch_chunk_run(
    job: EmbeddingJob, store: JobStore, chunk: int, texts: list[str], render_error: RenderError | None
) -> bool:
    """Embed a batch's chunk of request lines and write its output lines once; False if the job
    was cancelled meanwhile (it is finished as cancelled)."""
    if render_error is None:
        raise ValueError("a batch's chunk needs render_error (the API's error table)")
    lines = [LineRequest.decode(text) for text in texts]
    models = {
        model.name: model for model in EmbeddingModel.objects.filter(name__in={line.model for line in lines})
    }
    output = batch_chunk_embed(
        lines=lines,
        models=models,
        tenant_id=job.tenant_id,
        api_key_id=job.api_key_id,
        render_error=render_error,
    )
    if store.is_cancelled():
        _finish_cancelled(job)
        return False
    store.finish_chunk_lines(
        chunk, output.payload, rows=output.succeeded, tokens=output.tokens, usage=output.usage
    )
    return True


def job_chunk_retry_scheduled(*, job_id: int, chunk: int, delay_s: float) -> None:
    """A chunk's Celery retry is due in `delay_s`: the stall timer counts from then, so the watchdog
    does not re-send a chunk that is waiting out its backoff."""
    job = EmbeddingJob.objects.filter(pk=job_id).first()
    if job is not None and job.status in ACTIVE:
        chunk_mark_sent(job_store(job), chunk=chunk, delay_s=delay_s)


def _usage(job: EmbeddingJob, outcome: str, inputs: int, tokens: int, started: float) -> dict[str, int]:
    """A chunk's usage increments, kept with its result and counted once (_count_usage)."""
    return usage_increments(
        UsageEvent(
            tenant_id=job.tenant_id,
            api_key_id=job.api_key_id,
            model=job.model.name,
            # A batch's failed chunk counts under its own endpoint (its lines count there).
            endpoint="batches" if Batch.objects.filter(job_id=job.pk).exists() else "jobs",
            outcome=outcome,
            inputs=inputs if outcome == "succeeded" else 0,
            tokens=tokens if outcome == "succeeded" else 0,
            latency_ms=round((time.perf_counter() - started) * 1000),
        )
    )


def _after_chunk(job: EmbeddingJob, store: JobStore, chunk: int) -> None:
    progress = store.progress()
    if progress.chunks_done >= job.chunks:
        job_finalize(job_id=job.pk, status=Status.FAILED if progress.failed else Status.COMPLETED)
        return
    next_chunk = chunk_hand_off(store, chunk=chunk, chunks=job.chunks)
    if 0 <= next_chunk < job.chunks:
        _send_chunk(job.pk, next_chunk)
    job.completed, job.failed, job.prompt_tokens = progress.completed, progress.failed, progress.tokens
    EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
        completed=job.completed, failed=job.failed, prompt_tokens=job.prompt_tokens
    )
    _publish(job)


def job_chunk_fail(*, job_id: int, chunk: int, code: str, message: str) -> None:
    """A chunk failed in a way a retry would repeat (the model answered wrongly, refused an input):
    its inputs count failed (once), the job goes on with the other chunks and ends `failed`."""
    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None or job.status not in ACTIVE:
        return
    EmbeddingJob.objects.filter(pk=job.pk, error_code="").update(error_code=code, error_message=message)
    store = job_store(job)
    rows = _chunk_rows(job)[chunk]
    store.fail_chunk(chunk, rows=rows, usage=_usage(job, "failed", 0, 0, time.perf_counter()))
    _count_usage(store, chunk)
    _after_chunk(job, store, chunk)


def _finish_cancelled(job: EmbeddingJob) -> None:
    job_finalize(job_id=job.pk, status=Status.CANCELLED)


def job_chunk_give_up(*, job_id: int, chunk: int, code: str, message: str) -> None:
    """A chunk failed for good (Triton down past the retries): the job fails. Its remaining chunks
    are counted failed at once (so it does not take every chunk's retries to stop) and no more run."""
    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None or job.status not in ACTIVE:
        return
    EmbeddingJob.objects.filter(pk=job.pk, error_code="").update(error_code=code, error_message=message)
    store = job_store(job)
    store.cancel()  # chunks still queued or running stop at their next check
    rows_in = _chunk_rows(job)
    for number in range(job.chunks):
        store.fail_chunk(number, rows=rows_in[number], usage=_usage(job, "failed", 0, 0, time.perf_counter()))
    job_finalize(job_id=job.pk, status=Status.FAILED)


def _chunk_rows(job: EmbeddingJob) -> list[int]:
    return [min(job.chunk_size, job.total - chunk * job.chunk_size) for chunk in range(job.chunks)]


# --- Finalisation ----------------------------------------------------------------------------------


def job_finalize(*, job_id: int, status: str, publish: bool = True) -> bool:
    """End an active job once: its final status, counts and tokens; its reservation settled (the
    tokens it did not use refunded, exactly once); an event; its callback. False if it had ended."""
    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None or job.status not in ACTIVE:
        return False
    store = job_store(job)
    # Every chunk's usage counted before the job ends (a dead worker's included): after the end a
    # redelivered chunk may find the job gone.
    _count_usage(store)
    progress = store.progress()
    if status == Status.COMPLETED and progress.failed:
        status = Status.FAILED
    _settle(job, store, progress.tokens)
    now = timezone.now()
    won = EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
        status=status,
        finished_at=now,
        completed=progress.completed,
        failed=progress.failed,
        prompt_tokens=progress.tokens,
    )
    if not won:
        return False
    _free_inputs(job, store, progress.completed)
    job.refresh_from_db()
    if status == Status.FAILED and not job.error_code:
        job.error_code, job.error_message = "embedding_failed", "Some inputs could not be embedded"
        job.save(update_fields=["error_code", "error_message"])
    if publish:
        _publish(job, force=True)
    _hand_batch_over(job)
    if job.callback_url:
        try:
            current_app.send_task(CALLBACK_TASK, args=[job.pk])
        except Exception as error:  # the job is done either way; the callback is best effort
            logger.warning("could not enqueue the callback of job %s: %s", job.public_id, error)
    return True


def _hand_batch_over(job: EmbeddingJob) -> None:
    """A batch's job has ended: its batch's output files are written next (services/batches.py);
    the batch watchdog hands it over if this message is lost."""
    batch_id = Batch.objects.filter(job_id=job.pk).values_list("pk", flat=True).first()
    if batch_id is None:
        return
    Batch.objects.filter(pk=batch_id).update(handed_out_at=timezone.now())
    try:
        current_app.send_task(BATCH_FINALIZE_TASK, args=[batch_id])
    except Exception as error:  # the batch watchdog sends it again
        logger.warning("could not enqueue the finalisation of job %s's batch: %s", job.public_id, error)


def _free_inputs(job: EmbeddingJob, store: JobStore, completed: int) -> None:
    """No chunk of an ended job runs again: its texts go now (ids and results stay until expiry) and
    it holds only what it keeps. A failure here leaves them stored and counted until expiry."""
    try:
        store.delete_inputs(job.chunks)
    except redis.RedisError as error:
        logger.warning("job %s: inputs not freed (they expire with the job): %s", job.public_id, error)
        return
    job_storage_settle(public_id=job.public_id, completed=completed, total=job.total)


def _settle(job: EmbeddingJob, store: JobStore, used_tokens: int) -> None:
    """Give back what the reservation held beyond the tokens used, once (a marker in the script,
    run on the critical Redis that holds the token counters)."""
    keys = store.reservation()
    refund = max(0, job.reserved_tokens - used_tokens)
    if keys and refund:
        quota_refund_once(job_id=store.job_id, counters=keys, tokens=refund, ttl_s=store.ttl_s)


# --- Watchdog ------------------------------------------------------------------------------------


def job_watchdog(*, stall_s: float | None = None) -> int:
    """One pass over the active jobs (beat runs it every JOB_WATCHDOG_INTERVAL_S): finalise a job
    whose chunks are all finished, or that was cancelled and has no chunk running; re-send the
    chunks whose worker died (lease lapsed) or whose message was lost (handed out JOB_STALL_S ago,
    never started); hand out the successors dead workers did not, and a fresh window to a job with
    nothing in flight; count the usage of chunks whose worker died before counting it. Chunk tasks
    are idempotent, so a re-send is harmless even when the original turns up after all. Returns
    how many jobs it acted on."""
    stall_s = settings.JOB_STALL_S if stall_s is None else stall_s
    touched = 0
    for job in EmbeddingJob.objects.select_related("model").filter(status__in=ACTIVE).iterator():
        try:
            touched += _watch(job, stall_s)
        except redis.RedisError as error:  # one job's data unreachable: the next pass tries again
            logger.warning("watchdog: job %s not checked: %s", job.public_id, error)
    return touched


def _watch(job: EmbeddingJob, stall_s: float) -> bool:
    store = job_store(job)
    _count_usage(store)  # chunks whose worker died between writing and counting: counted now
    if job.status == Status.CANCELLING or store.is_cancelled():
        # A running chunk stops at its next check and ends the job; otherwise nothing would.
        return live_leases(store) == 0 and job_finalize(job_id=job.pk, status=Status.CANCELLED)
    if store.progress().chunks_done >= job.chunks:
        return job_finalize(job_id=job.pk, status=Status.COMPLETED)
    scan = chunks_scan(store, chunks=job.chunks, stall_s=stall_s)
    for chunk in [*scan.lost, *scan.stalled, *scan.successors]:
        _send_chunk(job.pk, chunk, RESENT_CHUNK_PRIORITY)
    fresh = []
    if scan.in_flight == 0:  # nothing handed out (data from before leases, or lost): start again
        for _ in range(settings.JOB_CHUNKS_IN_FLIGHT):
            chunk = chunk_take_next(store, chunks=job.chunks)
            if chunk < job.chunks:
                _send_chunk(job.pk, chunk, RESENT_CHUNK_PRIORITY)
                fresh.append(chunk)
    actions = {
        "re-sent (worker lost mid-chunk)": scan.lost,
        "re-sent (never started)": scan.stalled,
        "handed out (successors a dead worker did not)": scan.successors,
        "handed out (a fresh window)": fresh,
    }
    done = "; ".join(f"{action}: {chunks}" for action, chunks in actions.items() if chunks)
    if done:
        logger.warning("watchdog: job %s: chunks %s", job.public_id, done)
    return bool(done)
