"""The job service against the real Triton, Redis and database; chunks run in this process (the
Celery worker runs them in tests/test_job_tasks.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from django.db import transaction
from django.utils import timezone

from embeddings.errors.service import InvalidRequest, JobConflict, LimitExceeded, QuotaExceeded
from embeddings.models import EmbeddingJob, Tenant
from embeddings.redis.connections import redis_job_store, redis_sync, reset_redis_clients
from embeddings.services.inference import embedding
from embeddings.services.inference.embedding import EmbeddingOptions, EmbeddingTarget, embeddings_create_sync
from embeddings.services.jobs import engine, kinds, submission
from embeddings.services.jobs.engine import (
    job_cancel,
    job_chunk_fail,
    job_chunk_give_up,
    job_chunk_retry_scheduled,
    job_chunk_run,
    job_delete,
    job_expire_due,
    job_watchdog,
)
from embeddings.services.jobs.leases import ChunkLease, chunk_runs, live_leases
from embeddings.services.jobs.reads import (
    job_for_tenant,
    job_object,
    job_refreshed,
    job_results_source,
    jobs_for_tenant,
)
from embeddings.services.jobs.store import JobStore, job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.services.quotas.limits import quota_status_sync
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, counters_from_hash
from embeddings.tooling.triton_server import free_port
from tests.api import conftest as api_fixtures
from tests.conftest import texts_of_one_length
from tests.database_backend import wait_for_lock_waiters

# Triton, an emptied Redis, the local model and two tenants with a key each.
api_setup = api_fixtures.api_setup

TEXTS = [f"sentence number {index} about embeddings" for index in range(23)]


@pytest.fixture
def small_chunks(settings):
    settings.JOB_CHUNK_SIZE = 5
    settings.JOB_CHUNKS_IN_FLIGHT = 2


def run_all_chunks(job: EmbeddingJob) -> None:
    for chunk in range(job.chunks):
        job_chunk_run(job_id=job.pk, chunk=chunk)


def stored_vectors(job: EmbeddingJob) -> np.ndarray:
    store, rows, dims = job_results_source(job)
    blocks = [store.chunk_result(chunk, dims) for chunk in range(len(rows))]
    assert [len(block) for block in blocks] == rows
    return np.concatenate(blocks)


def test_job_runs_to_completion_with_the_synchronous_vectors(api_setup, small_chunks):
    model, alpha = api_setup["model"], api_setup["alpha"]
    spec = JobSpec(model=model, texts=TEXTS, dimensions=128, metadata={"batch": "one"})
    job, created = job_create(tenant_id=alpha.tenant.pk, api_key_id=alpha.api_key.pk, spec=spec)
    assert created and job.public_id.startswith("job_") and len(job.public_id) == 28
    assert (job.status, job.total, job.chunks, job.dims) == ("queued", 23, 5, 128)
    run_all_chunks(job)
    job.refresh_from_db()
    assert job.status == "completed"
    expected = embeddings_create_sync(
        target=EmbeddingTarget.for_model(model), texts=TEXTS, options=EmbeddingOptions(dimensions=128)
    )
    np.testing.assert_allclose(stored_vectors(job), expected.vectors, rtol=1e-5, atol=1e-6)
    body = job_object(job)
    assert body["counts"] == {"total": 23, "completed": 23, "failed": 0}
    assert body["usage"] == {
        "prompt_tokens": expected.total_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["metadata"] == {"batch": "one"} and body["dimensions"] == 128 and body["error"] is None
    assert body["finished_at"] >= body["started_at"] >= body["created_at"]
    # A chunk delivered again writes and counts nothing twice.
    job_chunk_run(job_id=job.pk, chunk=2)
    assert job_store(job).progress().completed == 23


def test_another_tenant_cannot_see_the_job(api_setup):
    alpha, beta = api_setup["alpha"], api_setup["beta"]
    spec = JobSpec(model=api_setup["model"], texts=["a", "b"])
    job, _ = job_create(tenant_id=alpha.tenant.pk, api_key_id=alpha.api_key.pk, spec=spec)
    assert job_for_tenant(tenant_id=alpha.tenant.pk, public_id=job.public_id).pk == job.pk
    assert job_for_tenant(tenant_id=beta.tenant.pk, public_id=job.public_id) is None
    assert jobs_for_tenant(tenant_id=beta.tenant.pk, limit=10) == ([], False)


def test_listing_is_newest_first_with_a_cursor(api_setup):
    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=["a"])
    made = [job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec)[0] for _ in range(5)]
    first, more = jobs_for_tenant(tenant_id=alpha.tenant.pk, limit=3)
    assert [job.pk for job in first] == [job.pk for job in made[::-1][:3]] and more
    rest, more = jobs_for_tenant(tenant_id=alpha.tenant.pk, limit=3, after=first[-1].public_id)
    assert [job.pk for job in rest] == [made[1].pk, made[0].pk] and not more


def test_idempotency_key(api_setup):
    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=["a", "b"])
    arguments = {"tenant_id": alpha.tenant.pk, "api_key_id": alpha.api_key.pk, "idempotency_key": "k1"}
    job, created = job_create(spec=spec, fingerprint="f1", **arguments)
    again, created_again = job_create(spec=spec, fingerprint="f1", **arguments)
    assert created and not created_again and again.pk == job.pk
    with pytest.raises(JobConflict):
        job_create(spec=spec, fingerprint="f2", **arguments)
    assert EmbeddingJob.objects.count() == 1
    # The key belongs to the tenant: another tenant may use it.
    beta = api_setup["beta"]
    _, created_beta = job_create(
        tenant_id=beta.tenant.pk, api_key_id=None, spec=spec, idempotency_key="k1", fingerprint="f1"
    )
    assert created_beta


def test_refusals_leave_nothing_behind(api_setup, settings):
    alpha, model = api_setup["alpha"], api_setup["model"]
    settings.JOB_MAX_INPUTS = 3
    with pytest.raises(InvalidRequest):
        job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=[]))
    with pytest.raises(InvalidRequest):
        job_create(
            tenant_id=alpha.tenant.pk,
            api_key_id=None,
            spec=JobSpec(model=model, texts=["a"], dimensions=10_000),
        )
    with pytest.raises(LimitExceeded):
        job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=["a"] * 4))
    # The tenant's own limit replaces the default.
    alpha.tenant.max_inputs_per_job = 5
    alpha.tenant.save()
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=["a"] * 5)
    )
    assert EmbeddingJob.objects.count() == 1
    assert {key.decode().split(":")[1] for key in redis_job_store().keys("job:*")} == {f"{{{job.public_id}}}"}


def test_budget_too_small_is_insufficient_quota_and_creates_nothing(api_setup):
    alpha, model = api_setup["alpha"], api_setup["model"]
    alpha.tenant.tokens_per_day = 100
    alpha.tenant.save()
    texts = ["a fairly long sentence, to need more tokens than the budget allows"] * 10
    with pytest.raises(QuotaExceeded) as refused:
        job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=texts))
    assert refused.value.reason == "insufficient_quota"
    assert EmbeddingJob.objects.count() == 0 and redis_job_store().keys("job:*") == []
    assert quota_status_sync(alpha.tenant.pk)["tenant"]["tokens_per_day"]["used"] == 0


def test_reservation_is_settled_to_the_tokens_used(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    alpha.tenant.tokens_per_month = 1_000_000
    alpha.tenant.save()
    job, _ = job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=TEXTS))
    month = lambda: quota_status_sync(alpha.tenant.pk)["tenant"]["tokens_per_month"]["used"]  # noqa: E731
    assert month() == job.reserved_tokens > 0
    run_all_chunks(job)
    job.refresh_from_db()
    assert job.status == "completed" and 0 < job.prompt_tokens < job.reserved_tokens
    assert month() == job.prompt_tokens


def test_max_concurrent_jobs_is_exact_under_concurrent_submissions(api_setup):
    alpha, model = api_setup["alpha"], api_setup["model"]
    alpha.tenant.max_concurrent_jobs = 3
    alpha.tenant.save()
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def submit():
        from django.db import connection

        barrier.wait()
        try:
            job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=["x"]))
            outcomes.append("created")
        except QuotaExceeded as refusal:
            outcomes.append(refusal.reason)
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] * 3 + ["rate_limit_exceeded"] * 5
    assert EmbeddingJob.objects.filter(tenant=alpha.tenant).count() == 3
    # A finished job frees its slot.
    job = EmbeddingJob.objects.filter(tenant=alpha.tenant).first()
    run_all_chunks(job)
    job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=["x"]))


def test_cancel_stops_the_remaining_chunks(api_setup, small_chunks):
    alpha = api_setup["alpha"]
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=api_setup["model"], texts=TEXTS)
    )
    job_chunk_run(job_id=job.pk, chunk=0)
    job = job_cancel(job=job)
    assert job.status == "cancelling"
    job_chunk_run(job_id=job.pk, chunk=1)  # the next chunk to run stops, and ends the job
    job.refresh_from_db()
    assert job.status == "cancelled" and job.completed == 5 and job.finished_at is not None
    assert job_store(job).progress().chunks_done == 1
    assert job_cancel(job=job).status == "cancelled"  # finished: unchanged


def test_expiry_deletes_the_data_and_shows_in_the_job(api_setup, small_chunks):
    alpha = api_setup["alpha"]
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=api_setup["model"], texts=TEXTS)
    )
    run_all_chunks(job)
    assert job_expire_due() == 0
    assert job_expire_due(now=timezone.now() + timedelta(days=8)) == 1
    job.refresh_from_db()
    assert job.status == "expired" and job_object(job)["status"] == "expired"
    assert redis_job_store().keys("job:*") == []


def test_delete_removes_results_and_row(api_setup, small_chunks):
    alpha = api_setup["alpha"]
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=api_setup["model"], texts=TEXTS)
    )
    run_all_chunks(job)
    job_delete(job=job)
    assert job_for_tenant(tenant_id=alpha.tenant.pk, public_id=job.public_id) is None
    assert redis_job_store().keys("job:*") == []


def test_refreshed_mirrors_progress(api_setup, small_chunks):
    alpha = api_setup["alpha"]
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=api_setup["model"], texts=TEXTS)
    )
    job_chunk_run(job_id=job.pk, chunk=3)
    stale = EmbeddingJob.objects.get(pk=job.pk)
    stale.completed = 0
    assert job_refreshed(stale).completed == 5


# --- Lost workers: leases, the watchdog ------------------------------------------------------------


@pytest.fixture
def sent_chunks(monkeypatch) -> list[tuple[int, int]]:
    """The chunks the engine hands to the broker, (job id, chunk), instead of sending them: these
    tests run chunks themselves (the Celery path is tests/reliability/test_worker_recovery.py)."""
    sent: list[tuple[int, int]] = []
    for module in (submission, engine):  # the first window, then every later chunk
        monkeypatch.setattr(
            module, "chunk_send", lambda job_id, chunk, *priority: sent.append((job_id, chunk))
        )
    return sent


def _redis_ms() -> int:
    seconds, microseconds = redis_job_store().time()  # leases are timed by the job store's clock
    return seconds * 1000 + microseconds // 1000


def _lapsed_lease(job: EmbeddingJob, chunk: int) -> None:
    """The lease a worker killed mid-chunk leaves: taken, its deadline passed, never released."""
    store = job_store(job)
    store.client.hset(store.key("lease"), chunk, f"{_redis_ms() - 1} dead-host:1")


def _submit(api_setup, texts=TEXTS) -> EmbeddingJob:
    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=texts)
    return job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec)[0]


def test_watchdog_leaves_queued_chunks_until_they_stall(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup)
    assert sent_chunks == [(job.pk, 0), (job.pk, 1)]
    assert job_watchdog() == 0 and len(sent_chunks) == 2  # queued in the broker: no lease yet
    assert job_watchdog(stall_s=0) == 1  # handed out "long ago" and never started: lost messages
    assert sent_chunks[2:] == [(job.pk, 0), (job.pk, 1)]
    assert job_watchdog(stall_s=60) == 0  # marked sent again: the stall timer starts over


def test_watchdog_resends_a_chunk_whose_worker_died_and_never_a_live_one(
    api_setup, small_chunks, sent_chunks
):
    job = _submit(api_setup)
    store = job_store(job)
    with ChunkLease(store, 1, lease_s=30):
        _lapsed_lease(job, 0)
        assert job_watchdog(stall_s=0) == 1
    assert sent_chunks[2:] == [(job.pk, 0)]  # chunk 1's lease was live: not re-sent, even at stall 0
    assert live_leases(store) == 0 and job_watchdog() == 0  # chunk 0 is queued again, not lost
    assert [(event.event, event.detail) for event in store.events()] == [
        ("watchdog", "chunks re-sent (worker lost mid-chunk): [0]")
    ]
    # The re-sent chunk runs (a late redelivery of the original too): written and counted once.
    job_chunk_run(job_id=job.pk, chunk=0)
    job_chunk_run(job_id=job.pk, chunk=0)
    assert job_store(job).progress().completed == 5
    assert chunk_runs(store).runs == {0: 1, 1: 1}  # chunk 0's dead run was set by hand: one real


def _lease_deadline_ms(store, chunk: int) -> int:
    return int(store.client.hget(store.key("lease"), chunk).split()[0])


def test_heartbeat_keeps_a_long_chunk_leased(api_setup, small_chunks, sent_chunks):
    """Checked once Redis's clock is past the lease as first taken: alive only because the heartbeat
    moved it. The heartbeat beats every third of the lease, so it lapses only if the heartbeat thread
    is late by two thirds of it (1.3 s here): a wide margin on a busy machine."""
    job = _submit(api_setup)
    store = job_store(job)
    with ChunkLease(store, 0, lease_s=2.0):
        first_deadline = _lease_deadline_ms(store, 0)
        hang_deadline = time.monotonic() + 60
        while _redis_ms() <= first_deadline:
            assert time.monotonic() < hang_deadline
            time.sleep(0.05)
        assert live_leases(store) == 1 and _lease_deadline_ms(store, 0) > first_deadline
        assert job_watchdog(stall_s=0) == 1 and sent_chunks[2:] == [(job.pk, 1)]  # only the queued one
    assert live_leases(store) == 0 and store.client.hlen(store.key("lease")) == 0


def test_watchdog_hands_out_the_successor_a_dead_worker_did_not(api_setup, small_chunks, sent_chunks):
    """Killed after writing chunk 0 and before handing out chunk 2: the watchdog hands it out, once."""
    job = _submit(api_setup)
    store = job_store(job)
    result = embeddings_create_sync(target=EmbeddingTarget.for_model(job.model), texts=store.chunk_inputs(0))
    store.finish_chunk(0, result.vectors, tokens=result.total_tokens)
    _lapsed_lease(job, 0)
    assert job_watchdog() == 1 and sent_chunks[2:] == [(job.pk, 2)]
    assert job_watchdog() == 0 and len(sent_chunks) == 3
    job_chunk_run(job_id=job.pk, chunk=0)  # the original, redelivered: no second successor
    assert len(sent_chunks) == 3


def test_watchdog_finalises_a_finished_job_and_a_cancelled_one(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup, TEXTS[:5])
    store = job_store(job)
    result = embeddings_create_sync(target=EmbeddingTarget.for_model(job.model), texts=TEXTS[:5])
    store.finish_chunk(0, result.vectors, tokens=result.total_tokens)  # the worker died right after
    assert job_watchdog() == 1
    job.refresh_from_db()
    assert (job.status, job.completed, job.prompt_tokens) == ("completed", 5, result.total_tokens)

    cancelled = job_cancel(job=_submit(api_setup))
    with ChunkLease(job_store(cancelled), 0, lease_s=30):
        assert job_watchdog() == 0  # a chunk still runs: it ends the job when it stops
    assert job_watchdog() == 1
    cancelled.refresh_from_db()
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None


class WorkerDied(Exception):
    """Stands for a worker killed at that point (the chunk's message then comes back)."""


def _die(*args, **kwargs):
    raise WorkerDied


def _job_usage_totals(tenant_id: int | None = None) -> dict[str, int]:
    """The critical Redis's live usage counters of endpoint "jobs" (of one tenant's, or all),
    summed over buckets."""
    counters, _ = counters_from_hash(redis_sync().hgetall(LIVE_USAGE_KEY), tenant_id=tenant_id)
    totals: dict[str, int] = {}
    for bucket, metrics in counters.items():
        if bucket.endpoint == "jobs":
            for metric, amount in metrics.items():
                totals[metric] = totals.get(metric, 0) + amount
    return {metric: amount for metric, amount in totals.items() if amount}


def test_a_chunks_usage_records_the_variant_that_embedded_it(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup)
    job_chunk_run(job_id=job.pk, chunk=0)
    counters, _ = counters_from_hash(redis_sync().hgetall(LIVE_USAGE_KEY), tenant_id=job.tenant_id)
    variants = {(b.endpoint, b.model, b.model_version, b.model_dtype) for b in counters}
    # The bundled model as api_setup registers it: version 1 pinned, a float32 export.
    assert variants == {("jobs", api_setup["model"].name, "1", "float32")}


def test_a_chunk_redelivered_after_its_result_was_written_counts_usage_once(
    api_setup, small_chunks, sent_chunks, monkeypatch
):
    """The result goes to the job store and the usage to the critical Redis, two servers: wherever
    a worker dies between the two, the chunk's usage is counted once, by its redelivery or by the
    job's end."""
    job = _submit(api_setup)  # 23 inputs: chunks of 5, 5, 5, 5, 3
    store = job_store(job)
    # Chunk 0's worker dies after writing its result, before counting its usage.
    with monkeypatch.context() as patch, pytest.raises(WorkerDied):
        patch.setattr(engine, "usage_count_once", _die)
        job_chunk_run(job_id=job.pk, chunk=0)
    assert store.is_chunk_done(0) and list(store.uncounted_usage()) == [0]
    assert _job_usage_totals() == {}
    # Redelivered (acks_late), twice: counted once, without embedding again.
    with monkeypatch.context() as patch:
        patch.setattr(kinds, "embeddings_create_sync", _die)
        job_chunk_run(job_id=job.pk, chunk=0)
        once = _job_usage_totals()
        assert (once["requests"], once["succeeded"], once["inputs"]) == (1, 1, 5) and once["tokens"] > 0
        job_chunk_run(job_id=job.pk, chunk=0)
    assert _job_usage_totals() == once and store.uncounted_usage() == {}
    # Chunk 1's worker dies after counting, before forgetting the increments in the job store.
    with monkeypatch.context() as patch, pytest.raises(WorkerDied):
        patch.setattr(JobStore, "forget_usage", _die)
        job_chunk_run(job_id=job.pk, chunk=1)
    assert list(store.uncounted_usage()) == [1] and _job_usage_totals()["requests"] == 2
    # The rest of the job; its end counts whatever is still pending (chunk 1's, counted already).
    for chunk in (2, 3, 4):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    assert job.status == "completed" and store.uncounted_usage() == {}
    job_chunk_run(job_id=job.pk, chunk=1)  # its message, redelivered after the end
    totals = _job_usage_totals()
    assert (totals["requests"], totals["succeeded"], totals["inputs"]) == (job.chunks, job.chunks, 23)
    assert totals["tokens"] == job.prompt_tokens == store.progress().tokens


def test_a_job_ending_before_the_redelivery_counts_the_dead_workers_chunk(
    api_setup, small_chunks, sent_chunks, monkeypatch
):
    job = _submit(api_setup, TEXTS[:10])  # two chunks
    with monkeypatch.context() as patch, pytest.raises(WorkerDied):
        patch.setattr(engine, "usage_count_once", _die)
        job_chunk_run(job_id=job.pk, chunk=0)
    job_chunk_run(job_id=job.pk, chunk=1)  # the last chunk ends the job, counting chunk 0 too
    job.refresh_from_db()
    assert job.status == "completed"
    assert _job_usage_totals()["inputs"] == 10
    job_chunk_run(job_id=job.pk, chunk=0)
    totals = _job_usage_totals()
    assert (totals["requests"], totals["inputs"], totals["tokens"]) == (2, 10, job.prompt_tokens)


def test_the_watchdog_counts_a_dead_workers_chunk_while_the_job_runs(
    api_setup, small_chunks, sent_chunks, monkeypatch
):
    job = _submit(api_setup)
    with monkeypatch.context() as patch, pytest.raises(WorkerDied):
        patch.setattr(engine, "usage_count_once", _die)
        job_chunk_run(job_id=job.pk, chunk=0)
    assert _job_usage_totals() == {}
    job_watchdog()
    job_watchdog()
    assert _job_usage_totals()["inputs"] == 5 and job_store(job).uncounted_usage() == {}
    job.refresh_from_db()
    assert job.status == "running"


def test_a_retry_waiting_out_its_backoff_is_not_stalled(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup)
    job_chunk_retry_scheduled(job_id=job.pk, chunk=0, delay_s=60, error="TritonUnavailable: refused")
    assert job_store(job).chunk_errors() == {0: "TritonUnavailable: refused"}
    # Chunk 1 was handed out a moment ago (30 s is a wide margin for "a moment"), chunk 0 is due later.
    assert job_watchdog(stall_s=30) == 0
    assert job_watchdog(stall_s=0) == 1 and sent_chunks[2:] == [(job.pk, 1)]  # chunk 0's is not due


def test_a_chunk_that_cannot_be_embedded_fails_alone(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup)
    job_chunk_fail(job_id=job.pk, chunk=1, code="embedding_failed", message="the model answered wrongly")
    assert sent_chunks[-1] == (job.pk, 2)  # the job goes on
    for chunk in (0, 2, 3, 4):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed, job.error_code) == ("failed", 18, 5, "embedding_failed")
    assert "answered wrongly" in job.error_message
    # The chunk's own error, kept beside its failure for the admin's chunk table.
    assert job_store(job).failed_chunks() == {1}
    assert job_store(job).chunk_errors() == {1: "embedding_failed: the model answered wrongly"}
    # Its history: the failure, then the state changes (progress events are not kept).
    kept = [(event.event, event.detail) for event in job_store(job).events()]
    assert kept == [
        ("chunk_failed", "chunk 1: embedding_failed: the model answered wrongly"),
        ("running", ""),
        ("failed", "18 of 23 inputs embedded, 5 failed"),
    ]


def test_a_chunk_given_up_fails_the_rest_each_with_its_reason(api_setup, small_chunks, sent_chunks):
    job = _submit(api_setup)
    job_chunk_run(job_id=job.pk, chunk=0)
    job_chunk_give_up(job_id=job.pk, chunk=1, code="model_unavailable", message="Triton down")
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed) == ("failed", 5, 18)
    store = job_store(job)
    assert store.failed_chunks() == {1, 2, 3, 4}
    errors = store.chunk_errors()
    assert errors[1] == "model_unavailable: Triton down"
    assert errors[3] == "not run: the job stopped when chunk 1 failed for good (model_unavailable)"
    assert 0 not in errors
    assert [event.event for event in store.events()] == ["running", "chunk_given_up", "failed"]


def test_the_same_idempotency_key_submitted_concurrently_makes_one_job(api_setup, postgresql_only):
    """Submission A has inserted its job and waits at its commit (the deferred check of its tenant
    foreign key waits for our lock on the tenant row); B, with the same Idempotency-Key, finds no
    job yet, inserts and waits for A on the unique key. Once A commits, B's INSERT fails: B answers
    with A's job and takes back what it had reserved and stored."""
    alpha, model = api_setup["alpha"], api_setup["model"]
    alpha.tenant.tokens_per_month = 1_000_000
    alpha.tenant.save()
    spec = JobSpec(model=model, texts=["one text", "and another"])
    outcomes: dict[str, object] = {}

    def submit(name: str):
        from django.db import connection

        try:
            outcomes[name] = job_create(
                tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec, idempotency_key="same", fingerprint="f"
            )
        except Exception as error:
            outcomes[name] = error
        finally:
            connection.close()

    first, second = (threading.Thread(target=submit, args=(name,)) for name in ("a", "b"))
    with transaction.atomic():
        Tenant.objects.select_for_update().get(pk=alpha.tenant.pk)
        first.start()
        wait_for_lock_waiters(1)
        second.start()
        wait_for_lock_waiters(2)
    first.join(timeout=60)
    second.join(timeout=60)
    # A is arranged to commit first; PostgreSQL may still wake B first at the tenant's row lock.
    # Either way, one submission makes the job and the other answers with it.
    answers = [outcomes["a"], outcomes["b"]]
    assert all(isinstance(answer, tuple) for answer in answers), answers
    assert sorted(created for _, created in answers) == [False, True], answers
    job = next(job for job, created in answers if created)
    assert all(answered.pk == job.pk for answered, _ in answers)
    assert EmbeddingJob.objects.filter(tenant=alpha.tenant).count() == 1
    assert {key.decode().split(":")[1] for key in redis_job_store().keys("job:*")} == {f"{{{job.public_id}}}"}
    assert quota_status_sync(alpha.tenant.pk)["tenant"]["tokens_per_month"]["used"] == job.reserved_tokens


# --- Result storage dtype (result_dtypes.py) --------------------------------------------


def test_results_are_stored_as_the_job_asks_else_as_its_model_says(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    as_float32, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=TEXTS)
    )
    asked, _ = job_create(
        tenant_id=alpha.tenant.pk,
        api_key_id=None,
        spec=JobSpec(model=model, texts=TEXTS, result_dtype="float16"),
    )
    model.result_dtype = "float16"
    model.save(update_fields=["result_dtype"])
    by_model, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=TEXTS)
    )
    overridden, _ = job_create(
        tenant_id=alpha.tenant.pk,
        api_key_id=None,
        spec=JobSpec(model=model, texts=TEXTS, result_dtype="float32"),
    )
    jobs_made = {"float32": as_float32, "asked": asked, "by_model": by_model, "overridden": overridden}
    dtypes = {name: EmbeddingJob.objects.get(pk=job.pk).result_dtype for name, job in jobs_made.items()}
    assert dtypes == {
        "float32": "float32",
        "asked": "float16",
        "by_model": "float16",
        "overridden": "float32",
    }
    assert job_object(by_model)["result_dtype"] == "float16"
    # The job keeps its dtype when the model's setting changes later: its stored bytes stay readable.
    model.result_dtype = "float32"
    model.save(update_fields=["result_dtype"])
    for job in jobs_made.values():
        run_all_chunks(job)
    redis = redis_job_store()
    for name, job in jobs_made.items():
        job.refresh_from_db()
        stored = sum(redis.strlen(job_store(job).key("out", chunk)) for chunk in range(job.chunks))
        assert stored == job.total * job.dims * (2 if dtypes[name] == "float16" else 4), name
    full, half = stored_vectors(as_float32), stored_vectors(by_model)
    assert full.dtype == half.dtype == np.float32
    np.testing.assert_array_equal(half, full.astype(np.float16).astype(np.float32))


def test_an_unknown_result_dtype_is_refused_with_nothing_stored(api_setup):
    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=["a"], result_dtype="float64")
    with pytest.raises(InvalidRequest) as refused:
        job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec)
    assert refused.value.param == "result_dtype" and "'float32', 'float16'" in refused.value.message
    assert EmbeddingJob.objects.count() == 0 and redis_job_store().keys("job:*") == []


def test_a_vector_float16_cannot_hold_fails_its_chunk_not_the_worker(api_setup, small_chunks, monkeypatch):
    """Unnormalised vectors beyond ±65504 (the model here is faked: MiniLM's never are): the chunk
    is refused before anything is written, and the Celery task counts its inputs failed at once."""
    from embeddings.tasks import job_chunk_task

    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=TEXTS[:5], normalize=False, result_dtype="float16")
    job, _ = job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec)
    real = kinds.embeddings_create_sync

    def huge(**arguments):
        result = real(**arguments)
        return dataclasses.replace(result, vectors=result.vectors * 1e6)

    monkeypatch.setattr(kinds, "embeddings_create_sync", huge)
    job_chunk_task.apply(args=[job.pk, 0])
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed, job.error_code) == ("failed", 0, 5, "embedding_failed")
    assert "beyond float16's range" in job.error_message and "result_dtype float32" in job.error_message
    assert redis_job_store().exists(job_store(job).key("out", 0)) == 0


# --- The embedding cache (services/inference/vector_cache.py) --------------------------------------


@pytest.fixture
def rows_computed(monkeypatch) -> list[int]:
    """The rows each embedding call of a chunk sent to Triton (the blocking path's)."""
    sent: list[int] = []
    infer_rows = embedding._infer_rows_sync

    def counted(target, spec, texts, batch, **options):
        sent.append(len(batch))
        return infer_rows(target, spec, texts, batch, **options)

    monkeypatch.setattr(embedding, "_infer_rows_sync", counted)
    return sent


def _run_job(who, model, texts) -> EmbeddingJob:
    """A job of `who`'s (results as float32) with every chunk run; the job as it ended."""
    spec = JobSpec(model=model, texts=texts, result_dtype="float32")
    job, _ = job_create(tenant_id=who.tenant.pk, api_key_id=None, spec=spec)
    run_all_chunks(job)
    job.refresh_from_db()
    assert job.status == "completed"
    return job


def test_a_job_embeds_only_what_its_tenant_did_not_before(
    api_setup, embedding_cache, small_chunks, rows_computed
):
    """Texts of one length (conftest.texts_of_one_length), in chunks of 5: 5, 5 and 2 rows a call,
    so the computed rows and the cached ones can be compared bit for bit."""
    alpha, beta, model = api_setup["alpha"], api_setup["beta"], api_setup["model"]
    texts = texts_of_one_length(12)
    first = _run_job(alpha, model, texts[:5])
    uncached = _run_job(beta, model, texts)  # beta reads none of alpha's entries
    assert rows_computed == [5, 5, 5, 2]
    repeated = _run_job(alpha, model, texts)
    assert rows_computed[4:] == [5, 2]  # the first chunk's texts were alpha's hits
    assert np.array_equal(stored_vectors(repeated), stored_vectors(uncached))
    assert repeated.prompt_tokens == uncached.prompt_tokens  # every input's tokens, cached or not
    usage = _job_usage_totals(alpha.tenant.pk)
    assert (usage["inputs"], usage["tokens"]) == (17, first.prompt_tokens + repeated.prompt_tokens)
    assert (usage["cached_inputs"], usage["cached_tokens"]) == (5, first.prompt_tokens)
    assert "cached_inputs" not in _job_usage_totals(beta.tenant.pk)
    again = _run_job(alpha, model, texts)  # from another job's entries: nothing sent
    assert len(rows_computed) == 6 and np.array_equal(stored_vectors(again), stored_vectors(uncached))
    assert _job_usage_totals(alpha.tenant.pk)["cached_tokens"] == first.prompt_tokens + again.prompt_tokens


@pytest.mark.parametrize("count_hits", [True, False])
def test_a_jobs_hits_are_given_back_to_its_quota_unless_they_count(
    api_setup, embedding_cache, small_chunks, settings, count_hits
):
    alpha, model = api_setup["alpha"], api_setup["model"]
    alpha.tenant.tokens_per_month = 1_000_000
    alpha.tenant.save()
    settings.EMBEDDING_CACHE_COUNT_HITS = count_hits
    month = lambda: quota_status_sync(alpha.tenant.pk)["tenant"]["tokens_per_month"]["used"]  # noqa: E731
    texts = texts_of_one_length(8)
    first = _run_job(alpha, model, texts[:4])
    assert month() == first.prompt_tokens
    second = _run_job(alpha, model, texts)  # half of it hits
    hits = first.prompt_tokens
    assert month() == first.prompt_tokens + second.prompt_tokens - (0 if count_hits else hits)
    assert job_store(second).progress().cached_tokens == hits


def test_a_jobs_scope_is_its_tenants_and_models_as_its_chunks_run(
    api_setup, embedding_cache, small_chunks, rows_computed, sent_chunks
):
    """Read when a chunk runs, not when the job was submitted: an opt-in (or out) applies to the
    jobs already queued, as it applies to requests within API_KEY_CACHE_SECONDS."""
    alpha, beta, model = api_setup["alpha"], api_setup["beta"], api_setup["model"]
    texts = texts_of_one_length(4)
    alpha.tenant.shared_embedding_cache = True
    alpha.tenant.save(update_fields=["shared_embedding_cache"])
    _run_job(alpha, model, texts)
    assert rows_computed == [4]
    queued, _ = job_create(tenant_id=beta.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=texts))
    beta.tenant.shared_embedding_cache = True
    beta.tenant.save(update_fields=["shared_embedding_cache"])
    run_all_chunks(queued)
    assert rows_computed == [4]  # beta opted in after submitting: its chunk read the shared scope
    beta.tenant.shared_embedding_cache = False
    beta.tenant.save(update_fields=["shared_embedding_cache"])
    _run_job(beta, model, texts)
    assert rows_computed == [4, 4]  # opted out again: its own scope
    model.shared_embedding_cache = True
    model.save(update_fields=["shared_embedding_cache"])
    _run_job(beta, model, texts)
    assert rows_computed == [4, 4]  # the model opted in: every tenant's jobs share its entries


def test_an_unreachable_cache_costs_a_job_nothing_but_misses(
    api_setup, embedding_cache, small_chunks, rows_computed, settings
):
    alpha, model = api_setup["alpha"], api_setup["model"]
    texts = texts_of_one_length(7)
    settings.EMBEDDING_CACHE = False
    uncached = _run_job(alpha, model, texts)
    settings.EMBEDDING_CACHE = True
    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.EMBEDDING_CACHE_LOCAL_ENTRIES = 0
    reset_redis_clients()
    for _ in range(2):
        job = _run_job(alpha, model, texts)
        assert np.array_equal(stored_vectors(job), stored_vectors(uncached))
    assert rows_computed == [5, 2] * 3
    assert "cached_inputs" not in _job_usage_totals(alpha.tenant.pk)
