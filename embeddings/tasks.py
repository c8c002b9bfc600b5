"""Celery tasks: thin wrappers that call services."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from embeddings.errors.answers import Retry, retry_for
from embeddings.services.inference.serving import models_reconcile
from embeddings.services.jobs.budget import job_storage_sweep
from embeddings.services.jobs.callbacks import CallbackRetry, job_callback_deliver
from embeddings.services.jobs.engine import (
    job_chunk_fail,
    job_chunk_give_up,
    job_chunk_retry_scheduled,
    job_chunk_run,
    job_expire_due,
    job_watchdog,
)
from embeddings.services.openai_api.batches import (
    batch_finalize,
    batch_validate,
    batches_expire_due,
    batches_watch,
)
from embeddings.services.openai_api.files import files_expire_due
from embeddings.services.quotas.usage import usage_fold
from embeddings.triton import TritonError

logger = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def usage_fold_task() -> dict[str, int]:
    """Fold Redis's usage counters into UsageBucket rows (beat runs it every USAGE_FOLD_INTERVAL_S).

    Idempotent by design (UsageFold rows), so a redelivery after a lost worker is harmless.
    """
    result = usage_fold()
    return {"batches": result.batches, "buckets": result.buckets, "dropped": result.dropped}


@shared_task(acks_late=True, reject_on_worker_lost=True)
def models_reconcile_task() -> dict[str, str]:
    """Make Triton serve what the catalog says (beat, every MODEL_RECONCILE_INTERVAL_S). Idempotent:
    it compares the catalog with Triton's index and only loads or unloads the difference, so a
    redelivery finds nothing left to do. Triton unreachable: logged, the next run tries again."""
    try:
        states = models_reconcile()
    except TritonError as error:
        logger.warning("models reconcile: Triton unreachable: %s", error)
        return {}
    return {state.name: state.state or "NOT LOADED" for state in states}


# --- Embedding jobs (embeddings/services/jobs/engine.py) ----------------------------------------


def chunk_retry_countdown(retries: int) -> float:
    """Exponential backoff: JOB_CHUNK_RETRY_BACKOFF_S * 2^retries, capped."""
    return min(settings.JOB_CHUNK_RETRY_BACKOFF_MAX_S, settings.JOB_CHUNK_RETRY_BACKOFF_S * 2**retries)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def job_chunk_task(self, job_id: int, chunk: int) -> None:
    """Embed one chunk of a job. Idempotent (a chunk is written and counted once, and hands out one
    successor), so a redelivery after a lost worker, or the watchdog's re-send, is harmless."""
    try:
        job_chunk_run(job_id=job_id, chunk=chunk)
    except Exception as error:
        # The one error table (embeddings/errors/answers.py) says what a failure means for a job.
        retry = retry_for(error)
        if retry is Retry.NEVER:
            # The same inputs would fail the same way: they count failed and the job goes on
            # (re-running the chunk, as a stalled one would be, could only fail again).
            logger.warning("job %s chunk %s failed: %s", job_id, chunk, error)
            message = f"Some inputs could not be embedded: {error}"
            job_chunk_fail(job_id=job_id, chunk=chunk, code="embedding_failed", message=message)
            return
        if retry is not Retry.BACKOFF:
            # A store down (the watchdog re-sends the chunk once it is back), or unexpected.
            raise
        # The model server, for a moment. A model not loaded is loaded by the next reconcile.
        if self.request.retries >= settings.JOB_CHUNK_RETRIES:
            code = "model_unavailable"
            message = (
                f"The model could not be reached after {self.request.retries + 1} attempts ({error}); "
                "the job stopped."
            )
            job_chunk_give_up(job_id=job_id, chunk=chunk, code=code, message=message)
            return
        countdown = chunk_retry_countdown(self.request.retries)
        attempt = f"attempt {self.request.retries + 1} failed, retry in {countdown:g} s"
        error_name = type(error).__name__
        job_chunk_retry_scheduled(
            job_id=job_id, chunk=chunk, delay_s=countdown, error=f"{error_name}: {error} ({attempt})"
        )
        raise self.retry(exc=error, countdown=countdown) from error


@shared_task(acks_late=True, reject_on_worker_lost=True)
def job_expire_task() -> int:
    """Expire jobs past expires_at and give back the bytes of submissions that died half way (beat,
    every JOB_EXPIRE_INTERVAL_S). Idempotent: an expired job is skipped, a released hold is gone."""
    expired = job_expire_due()
    job_storage_sweep()
    batches_expire_due()
    files_expire_due()
    return expired


@shared_task(acks_late=True, reject_on_worker_lost=True)
def job_watchdog_task() -> int:
    """Re-send the chunks of dead workers (beat, every JOB_WATCHDOG_INTERVAL_S). Idempotent: what it
    re-sends is marked sent in the same script that decides it, and chunk tasks are idempotent."""
    touched = job_watchdog()
    return touched + batches_watch()


# --- Batches (embeddings/services/openai_api/batches.py) --------------------------------------------


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def batch_validate_task(self, batch_id: int) -> None:
    """Validate a batch's lines and start its job. Idempotent: the job is created under the batch's
    id as idempotency key, and a batch that left `validating` is not validated again."""
    try:
        batch_validate(batch_id=batch_id)
    except Exception as error:
        # A store or the queue down passes (embeddings/errors/answers.py: Retry.LATER): tried again.
        if retry_for(error) is not Retry.LATER:
            raise
        if self.request.retries >= settings.JOB_CHUNK_RETRIES:
            logger.warning(
                "batch %s: validation given up for now (the watchdog retries): %s", batch_id, error
            )
            return
        raise self.retry(exc=error, countdown=chunk_retry_countdown(self.request.retries)) from error


@shared_task(acks_late=True, reject_on_worker_lost=True)
def batch_finalize_task(batch_id: int) -> None:
    """Write a finished batch's output and error files. Idempotent: the files are written under
    new names and the batch's final status is set once; a second run finds it final (or, racing,
    deletes the files it wrote)."""
    batch_finalize(batch_id=batch_id)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def job_callback_task(self, job_id: int) -> None:
    """POST a finished job to its callback_url; retried JOB_CALLBACK_RETRIES times after
    JOB_CALLBACK_BACKOFF_S * 2^attempt seconds (5 s, 10 s, ... by default; at most an hour)."""
    try:
        job_callback_deliver(job_id=job_id)
    except CallbackRetry as error:
        if self.request.retries >= settings.JOB_CALLBACK_RETRIES:
            logger.warning(
                "job %s: callback given up after %s attempts: %s", job_id, self.request.retries + 1, error
            )
            return
        countdown = min(3600, settings.JOB_CALLBACK_BACKOFF_S * 2**self.request.retries)
        raise self.retry(exc=error, countdown=countdown) from error
