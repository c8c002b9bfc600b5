"""The job engine: the chunks the Celery tasks run, a job's end, the watchdog, cancel and expiry.

A job's inputs, results and progress live in the job store (JOB_STORE_URL,
embeddings.services.jobs.store), its state in the EmbeddingJob row; its quota reservation and usage
in the critical Redis (REDIS_URL). Life of a job:

    job_create     (submission.py) validate, idempotency, max concurrent jobs, admit its bytes
                   against the job storage budgets (budget.py), reserve the whole job's tokens
                   (an upper bound), store the inputs, save the row, and after the commit hand
                   out the first JOB_CHUNKS_IN_FLIGHT chunks to the broker.
    job_chunk_run  (a Celery task per chunk) embed one chunk under a lease its heartbeat keeps
                   alive (embeddings.services.jobs.leases), write it with its usage increments
                   (one script: JobStore.finish_chunk), count that usage in the critical Redis
                   (once per chunk: usage_count_once), mirror progress, and hand out exactly one
                   successor chunk. A redelivered chunk counts what a dead worker wrote but did
                   not count; so do the watchdog and the job's end, for every chunk.
    job_finalize   exactly once: completed | failed | cancelled, counts, tokens settled against
                   the reservation (the unused rest refunded, and the embedding cache's hits where
                   EMBEDDING_CACHE_COUNT_HITS is off), inputs deleted (their bytes given back),
                   event published, callback enqueued.
    job_watchdog   (beat, every JOB_WATCHDOG_INTERVAL_S) re-sends a chunk whose lease lapsed (its
                   worker died mid-chunk) and one handed out JOB_STALL_S ago that never started
                   (its message lost), hands out the successor a dead worker did not, finalises
                   what is done: a lost worker's job resumes within about JOB_CHUNK_LEASE_S +
                   JOB_WATCHDOG_INTERVAL_S.
    job_expire_due (beat) jobs past expires_at become expired and their Redis data goes (and
                   the bytes they held).

Kinds (kinds.py): a job's kind embeds and writes its chunks and hears of its end; the engine knows
no more of it. OpenAI's batches are the kind "batch" (embeddings.services.openai_api.batches): their
chunks write output lines instead of vectors, and an ended batch job hands its batch over to be
finalised; /v1/jobs lists only the kind "embeddings".

Fair share: a job never has more than JOB_CHUNKS_IN_FLIGHT chunks in the broker. Each finished
chunk hands out one successor, taken from the job's Redis counter `next`, and only once per chunk
(the `handoff` hash), so a redelivered chunk neither sends extra chunks nor loses the job's slot.
With workers prefetching one message, a tenant's million-text job and another tenant's small job
take turns in the queue instead of the small one waiting behind the whole big one.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

import redis
from celery import current_app
from django.conf import settings
from django.utils import timezone

from embeddings.models import EmbeddingJob
from embeddings.redis.keys import job_retry_settlement
from embeddings.services.jobs.budget import job_storage_release, job_storage_settle
from embeddings.services.jobs.events import job_event_keep, job_event_publish
from embeddings.services.jobs.kinds import job_kind
from embeddings.services.jobs.leases import (
    ChunkLease,
    chunk_hand_off,
    chunk_mark_sent,
    chunk_take_next,
    chunks_scan,
    live_leases,
)
from embeddings.services.jobs.reads import job_object, job_progress_mirror
from embeddings.services.jobs.store import JobProgress, JobStore, chunk_rows, job_store
from embeddings.services.quotas.limits import quota_refund_forget, quota_refund_once
from embeddings.services.quotas.usage import usage_count_once

logger = logging.getLogger(__name__)

Status = EmbeddingJob.Status
ACTIVE = EmbeddingJob.ACTIVE
CHUNK_TASK = "embeddings.tasks.job_chunk_task"
CALLBACK_TASK = "embeddings.tasks.job_callback_task"
# Progress events at most this often per job (each finished chunk when chunks are slower).
EVENT_INTERVAL_S = 0.5
# Chunks go to the broker below the default priority (0, which Redis serves first), so beat's
# tasks (the watchdog above all) are not stuck behind a backlog of chunks: each expires after one
# interval, and behind a backlog longer than that it would never run. What the watchdog re-sends
# goes ahead of the backlog: a dead worker's job resumes without queueing again.
CHUNK_PRIORITY = 6
RESENT_CHUNK_PRIORITY = 3


# --- Redis -----------------------------------------------------------------------------------------


def job_data_delete(job: EmbeddingJob) -> None:
    """Delete the job's Redis data, then give back the bytes it held (a failure in between leaves
    them held: counted too much until the sweep, never too little)."""
    store = job_store(job)
    _count_usage(store)
    rounds = store.retry_rounds()
    store.delete(job.chunks)
    quota_refund_forget(job_id=store.job_id)
    for number in rounds:
        quota_refund_forget(job_id=job_retry_settlement(store.job_id, number))
    job_storage_release(public_id=job.public_id)


def job_usage_count_pending(*, job: EmbeddingJob) -> None:
    """Count now whatever usage of the job's finished chunks still waits to be (a worker died
    between writing a chunk and counting it): before an operator runs failed chunks again."""
    _count_usage(job_store(job))


def _count_usage(store: JobStore, chunk: int | None = None) -> None:
    """Count in the critical Redis the usage of finished chunks (one, or all of the job's) that is
    not counted yet, then forget it in the job store. Each chunk counts once however often this
    runs (usage_count_once keeps a marker per chunk), so a worker that died between writing a
    chunk and counting it leaves its usage to the next call, not lost and not doubled."""
    pending = store.uncounted_usage(chunk)
    for number, increments in pending.items():
        usage_count_once(owner=store.job_id, unit=number, increments=increments, ttl_s=store.ttl_s)
    store.forget_usage(list(pending))


def chunk_send(job_id: int, chunk: int, priority: int = CHUNK_PRIORITY) -> None:
    """Hand one chunk of a job to the broker (its Celery task runs job_chunk_run)."""
    current_app.send_task(CHUNK_TASK, args=[job_id, chunk], priority=priority)


# --- Cancel, delete, expire ------------------------------------------------------------------------


def job_cancel(*, job: EmbeddingJob, actor: str = "") -> EmbeddingJob:
    """Ask a queued or running job to stop: cancelling now, cancelled once its chunks stop (each
    checks the flag before and after embedding). A finished job is returned unchanged. `actor`: who
    asked, when not the job's client (an operator), for its history."""
    if job.status not in (Status.QUEUED, Status.RUNNING):
        return job
    job_store(job).cancel()
    EmbeddingJob.objects.filter(pk=job.pk, status__in=(Status.QUEUED, Status.RUNNING)).update(
        status=Status.CANCELLING
    )
    job.refresh_from_db()
    _publish(job, force=True, detail=f"asked by {actor}" if actor else "")
    return job


def job_delete(*, job: EmbeddingJob) -> None:
    """Delete a job: a running one is cancelled first (its reservation settled), then its Redis data
    and its row go (a later GET is 404; usage already recorded stays)."""
    if job.status in ACTIVE:
        job_store(job).cancel()
        EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(status=Status.CANCELLING)
        job_finalize(job_id=job.pk, status=Status.CANCELLED, publish=False)
    job_data_delete(job)
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
        job_data_delete(job)
        if (
            EmbeddingJob.objects.filter(pk=job.pk)
            .exclude(status=Status.EXPIRED)
            .update(status=Status.EXPIRED)
        ):
            expired += 1
    return expired


# --- The engine: one chunk -------------------------------------------------------------------------


def _publish(job: EmbeddingJob, *, force: bool = False, detail: str = "") -> None:
    """Publish the job's state, at most every EVENT_INTERVAL_S per job unless forced (a change of
    status: start, cancel, end), which its history keeps too."""
    if force:
        job_event_keep(job_store(job), event=job.status, detail=detail)
    elif not job_store(job).event_due(EVENT_INTERVAL_S):
        return
    job_event_publish(public_id=job.public_id, job=job_object(job))


def _mark_started(job: EmbeddingJob) -> None:
    now = timezone.now()
    if EmbeddingJob.objects.filter(pk=job.pk, status=Status.QUEUED).update(
        status=Status.RUNNING, started_at=now
    ):
        job.status, job.started_at = Status.RUNNING, now
        _publish(job, force=True)


def job_chunk_run(*, job_id: int, chunk: int) -> None:
    """Embed one chunk of a job and write it once; hand out the job's next chunk.

    Runs under the chunk's lease (ChunkLease: renewed by a heartbeat while it embeds, so a long
    chunk is never re-sent while its worker lives). Triton errors (TritonUnavailable, TritonTimeout,
    ...) propagate: the Celery task retries them and calls job_chunk_give_up after the last. A
    chunk that ran before (redelivered, or re-sent by the watchdog) writes and counts nothing
    again, and hands out no second successor. The job's kind embeds and writes the chunk
    (kinds.py: vectors for /v1/jobs, OpenAI's output lines for a batch).
    """
    # The tenant too: its chunks' embedding cache scope is read from its row (kinds.job_cache_scope).
    job = EmbeddingJob.objects.select_related("model", "tenant").filter(pk=job_id).first()
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
            write = job_kind(job.kind).chunk_embed(job, texts)
            if store.is_cancelled():
                _finish_cancelled(job)
                return
            write(store, chunk)
        # Also when the chunk was done before: its first run may have died before counting.
        _count_usage(store, chunk)
        _after_chunk(job, store, chunk)


def job_chunk_retry_scheduled(*, job_id: int, chunk: int, delay_s: float, error: str = "") -> None:
    """A chunk's Celery retry is due in `delay_s`: the stall timer counts from then, so the watchdog
    does not re-send a chunk that is waiting out its backoff; `error` (why) is its last error."""
    job = EmbeddingJob.objects.filter(pk=job_id).first()
    if job is not None and job.status in ACTIVE:
        chunk_mark_sent(job_store(job), chunk=chunk, delay_s=delay_s, error=error)


def _after_chunk(job: EmbeddingJob, store: JobStore, chunk: int) -> None:
    progress = store.progress()
    if progress.chunks_done >= job.chunks:
        job_finalize(job_id=job.pk, status=Status.FAILED if progress.failed else Status.COMPLETED)
        return
    next_chunk = chunk_hand_off(store, chunk=chunk, chunks=job.chunks)
    if 0 <= next_chunk < job.chunks:
        chunk_send(job.pk, next_chunk)
    job_progress_mirror(job, progress)
    _publish(job)


def job_chunk_fail(*, job_id: int, chunk: int, code: str, message: str) -> None:
    """A chunk failed in a way a retry would repeat (the model answered wrongly, refused an input):
    its inputs count failed (once), the job goes on with the other chunks and ends `failed`."""
    job = EmbeddingJob.objects.select_related("model").filter(pk=job_id).first()
    if job is None or job.status not in ACTIVE:
        return
    EmbeddingJob.objects.filter(pk=job.pk, error_code="").update(error_code=code, error_message=message)
    store = job_store(job)
    rows = chunk_rows(job)[chunk]
    usage = job_kind(job.kind).chunk_usage(job, "failed", started=time.perf_counter())
    if store.fail_chunk(chunk, rows=rows, usage=usage, error=f"{code}: {message}"):
        job_event_keep(store, event="chunk_failed", detail=f"chunk {chunk}: {code}: {message}")
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
    rows_in = chunk_rows(job)
    kind = job_kind(job.kind)
    stopped = f"not run: the job stopped when chunk {chunk} failed for good ({code})"
    job_event_keep(store, event="chunk_given_up", detail=f"chunk {chunk}: {code}: {message}")
    for number in range(job.chunks):
        usage = kind.chunk_usage(job, "failed", started=time.perf_counter())
        error = f"{code}: {message}" if number == chunk else stopped
        store.fail_chunk(number, rows=rows_in[number], usage=usage, error=error)
    job_finalize(job_id=job.pk, status=Status.FAILED)


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
    _settle(job, store, progress)
    now = timezone.now()
    won = EmbeddingJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
        status=status,
        finished_at=now,
        completed=progress.completed,
        failed=progress.failed,
        prompt_tokens=progress.tokens,
        cached_tokens=progress.cached_tokens,
    )
    if not won:
        return False
    _free_inputs(job, store, progress.completed, failed_chunks_kept=status == Status.FAILED)
    job.refresh_from_db()
    if status == Status.FAILED and not job.error_code:
        job.error_code, job.error_message = "embedding_failed", "Some inputs could not be embedded"
        job.save(update_fields=["error_code", "error_message"])
    if publish:
        _publish(
            job,
            force=True,
            detail=f"{job.completed:,} of {job.total:,} inputs embedded, {job.failed:,} failed",
        )
    job_kind(job.kind).ended(job)
    if job.callback_url:
        try:
            current_app.send_task(CALLBACK_TASK, args=[job.pk])
        except Exception as error:  # the job is done either way; the callback is best effort
            logger.warning("could not enqueue the callback of job %s: %s", job.public_id, error)
    return True


def _free_inputs(job: EmbeddingJob, store: JobStore, completed: int, *, failed_chunks_kept: bool) -> None:
    """An ended job's texts go now (ids and results stay until expiry) and it holds only what it
    keeps; those of its failed chunks stay, held, where `failed_chunks_kept` and its kind allows an
    operator to run them again (operator.py job_retry_failed_chunks). A failure here leaves them
    stored and counted until expiry."""
    kept: set[int] = set()
    try:
        if failed_chunks_kept and job_kind(job.kind).chunks_retryable:
            kept = store.failed_chunks()
        store.delete_inputs(chunk for chunk in range(job.chunks) if chunk not in kept)
        kept_bytes = store.input_bytes(kept)
    except redis.RedisError as error:
        logger.warning("job %s: inputs not freed (they expire with the job): %s", job.public_id, error)
        return
    job_storage_settle(
        public_id=job.public_id,
        completed=completed,
        total=job.total,
        kept_input_bytes=kept_bytes,
        kept_input_keys=len(kept),
    )


def _settle(job: EmbeddingJob, store: JobStore, progress: JobProgress) -> None:
    """Give back what the reservation held beyond the tokens used, once (a marker in the script,
    run on the critical Redis that holds the token counters). With EMBEDDING_CACHE_COUNT_HITS off,
    the tokens the embedding cache answered were not used: given back too.

    Each retry round an operator started (operator.py job_retry_failed_chunks) reserved its own
    tokens and is settled the same way, once, under its own marker: it used the tokens counted
    between its start and the next round's (or now). The submission's reservation used those
    counted before the first round; settled at the job's first end, its marker makes it a no-op at
    a retried job's next one."""
    rounds = store.retry_rounds()
    # Where the job's token counts stood at each round's start, and now.
    marks = [(retry.tokens_before, retry.cached_before) for retry in rounds.values()]
    marks.append((progress.tokens, progress.cached_tokens))

    def used(start: tuple[int, int], end: tuple[int, int]) -> int:
        tokens, cached = end[0] - start[0], end[1] - start[1]
        return tokens if settings.EMBEDDING_CACHE_COUNT_HITS else tokens - cached

    submitted = job.reserved_tokens - sum(retry.reserved for retry in rounds.values())
    refund = max(0, submitted - used((0, 0), marks[0]))
    keys = store.reservation()
    if keys and refund:
        quota_refund_once(job_id=store.job_id, counters=keys, tokens=refund, ttl_s=store.ttl_s)
    for index, (number, retry) in enumerate(rounds.items()):
        refund = max(0, retry.reserved - used(marks[index], marks[index + 1]))
        if retry.counters and refund:
            owner = job_retry_settlement(store.job_id, number)
            quota_refund_once(job_id=owner, counters=retry.counters, tokens=refund, ttl_s=store.ttl_s)


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
        chunk_send(job.pk, chunk, RESENT_CHUNK_PRIORITY)
    fresh = []
    if scan.in_flight == 0:  # nothing handed out (data from before leases, or lost): start again
        for _ in range(settings.JOB_CHUNKS_IN_FLIGHT):
            chunk = chunk_take_next(store, chunks=job.chunks)
            if chunk < job.chunks:
                chunk_send(job.pk, chunk, RESENT_CHUNK_PRIORITY)
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
        job_event_keep(store, event="watchdog", detail=f"chunks {done}")
    return bool(done)
