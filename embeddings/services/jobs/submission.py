"""Submitting a job: validation, idempotency, max concurrent jobs, its bytes admitted against the
job storage budgets, its tokens reserved, its inputs stored, its row saved and, after the commit,
its first JOB_CHUNKS_IN_FLIGHT chunks handed to the broker (the engine runs them: engine.py).

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
import secrets
import string
from dataclasses import dataclass, field
from datetime import timedelta

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from embeddings.callers import NO_LIMITS, Caller
from embeddings.errors.service import InvalidRequest, JobConflict, JobQueueUnavailable, QuotaExceeded
from embeddings.model_tasks import OUTPUT_TYPES
from embeddings.models import ApiKey, EmbeddingJob, EmbeddingModel, Tenant
from embeddings.observability import context as request_context
from embeddings.redis import keys as redis_keys
from embeddings.redis.connections import redis_sync
from embeddings.result_dtypes import RESULT_DTYPES, result_storage_name
from embeddings.services.inference.embedding import (
    EmbeddingOptions,
    EmbeddingTarget,
    dimensions_check,
    input_type_canonical,
    model_prompt_for,
    output_type_check,
)
from embeddings.services.jobs.budget import job_storage_admit, job_storage_need
from embeddings.services.jobs.engine import chunk_send, job_data_delete
from embeddings.services.jobs.inputs import job_inputs_count_check
from embeddings.services.jobs.kinds import EMBEDDINGS
from embeddings.services.jobs.leases import chunk_take_next
from embeddings.services.jobs.store import inputs_encode, job_store
from embeddings.services.quotas.limits import (
    QuotaLimitValues,
    Reservation,
    quota_release_sync,
    quota_reserve_sync,
)

logger = logging.getLogger(__name__)

Status = EmbeddingJob.Status
ACTIVE = EmbeddingJob.ACTIVE
ENCODING_FORMATS = ("float", "base64")
PUBLIC_ID_ALPHABET = string.ascii_lowercase + string.digits


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
    # How float results are stored (result_dtypes.py); None: the model's result_dtype.
    result_dtype: str | None = None
    # The vectors' type: float, or quantised (int8, uint8, binary, ubinary), stored in that type
    # whatever result_dtype says; and what the inputs are for (picks the model's prompt).
    output_type: str = "float"
    input_type: str | None = None
    # A batch's job (services/openai_api/batches.py): each input is one request line, whose token estimate,
    # chunk size and output size the batch computes; None: a plain job's.
    token_estimate: int | None = None
    chunk_size: int | None = None
    result_bytes_per_input: int | None = None
    # The job's kind (kinds.py): how its chunks are embedded and written.
    kind: str = EMBEDDINGS.name


def _new_public_id() -> str:
    """A job id, of models.JOB_ID_PATTERN's form."""
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
    if spec.output_type not in OUTPUT_TYPES:
        raise InvalidRequest(f"output_dtype must be one of {', '.join(OUTPUT_TYPES)}", param="output_dtype")
    if spec.input_type is not None:
        input_type_canonical(spec.input_type)
    if spec.output_type != "float":
        # Refused now, before anything is stored, rather than by every chunk: no calibration for
        # int8/uint8, or binary of a width that is not a multiple of 8.
        target = EmbeddingTarget.for_model(spec.model)
        options = EmbeddingOptions(
            dimensions=spec.dimensions, normalize=spec.normalize, output_type=spec.output_type
        )
        output_type_check(target, options)
    caller = Caller(
        tenant.pk,
        None if api_key is None else api_key.pk,
        QuotaLimitValues.of(tenant),
        NO_LIMITS if api_key is None else QuotaLimitValues.of(api_key),
    )
    job_inputs_count_check(count=len(spec.texts), caller=caller)


def job_token_estimate(model: EmbeddingModel, texts: list[str], input_type: str | None = None) -> int:
    """An upper bound of the job's tokens without tokenising: a wordpiece/BPE token covers at least
    one UTF-8 byte, plus the prompt (the one `input_type` picks, else the default) and two special
    tokens, capped by the model's maximum."""
    prompt = len(model_prompt_for(model, input_type).encode())
    cap = model.max_tokens
    return sum(min(cap, len(text.encode()) + prompt + 2) for text in texts)


def job_quota_caller(tenant: Tenant, api_key: ApiKey | None) -> Caller:
    """Whom a job's tokens are reserved for: its tenant and key, without the limits a job does not
    meet (tokens per minute, concurrent requests; module docstring)."""

    def job_limits(owner) -> QuotaLimitValues:
        values = QuotaLimitValues.of(owner)
        return dataclasses.replace(values, tokens_per_minute=None, max_concurrent_requests=None)

    key_limits = job_limits(api_key) if api_key is not None else QuotaLimitValues()
    return Caller(tenant.pk, None if api_key is None else api_key.pk, job_limits(tenant), key_limits)


def job_tokens_reserve(caller: Caller, tokens: int) -> Reservation | None:
    """Reserve a job's tokens (and count one request) against the caller's limits; None where
    QUOTAS_ENABLED is off. Raises QuotaExceeded."""
    if not settings.QUOTAS_ENABLED:
        return None
    # inputs=0: a job's size is checked against max_inputs_per_job, not the per-request limit.
    return quota_reserve_sync(caller=caller, inputs=0, tokens=tokens)


def job_tokens_release(reservation: Reservation | None) -> None:
    """Give back a reservation that will not be used (a submission or a retry undone)."""
    if reservation is not None and reservation.holds_anything:
        quota_release_sync(reservation=reservation, refund=True)


def reserved_token_counters(reservation: Reservation | None) -> list[str]:
    """The token budget counters a reservation holds tokens on: what the job's end refunds."""
    if reservation is None:
        return []
    return [counter.key for counter in reservation.counters if counter.window.kind == "tokens"]


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
    caller = job_quota_caller(tenant, api_key)
    estimate = spec.token_estimate
    if estimate is None:
        estimate = job_token_estimate(model, spec.texts, spec.input_type)
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
        kind=spec.kind,
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
        output_type=spec.output_type,
        input_type=spec.input_type or "",
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
    # A quantised output type is held at its own size (int8 a byte a dimension, binary a bit).
    stored_as = result_storage_name(result_dtype=job.result_dtype, output_type=job.output_type)
    need = job_storage_need(inputs=inputs, rows=job.total, dims=job.dims, result_dtype=stored_as)
    reservation: Reservation | None = None
    with _SubmitLock(tenant_id, needed=bool(limited)):
        _check_concurrent(tenant, api_key)
        # StorageBudgetExceeded here leaves nothing behind: no bytes held, no tokens reserved.
        job_storage_admit(tenant=tenant, public_id=job.public_id, need=need)
        try:
            reservation = job_tokens_reserve(caller, estimate)
            store.put_encoded_inputs(inputs)
            if reservation is not None and reservation.counters:
                store.put_reservation(reserved_token_counters(reservation))
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
            job_data_delete(job)
        except redis.RedisError as error:
            # The job store is down (what failed the submission, often): the caller's error says
            # so, and whatever got in expires with the job's TTL.
            logger.warning("job %s: data not deleted after a failed submission: %s", job.public_id, error)
    finally:
        job_tokens_release(reservation)


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
        chunk_send(job.pk, chunk)
