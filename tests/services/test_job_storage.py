"""Admission by bytes (embeddings/services/jobs/budget.py) with the real Triton, Redis and database:
refusals that store nothing, bytes given back as jobs end, races for the last bytes (PostgreSQL),
and what is held against what Redis itself reports (MEMORY USAGE)."""

from __future__ import annotations

import threading
from datetime import timedelta

import orjson
import pytest
from django.db import connection, transaction
from django.utils import timezone

from embeddings.errors.service import StorageBudgetExceeded
from embeddings.models import EmbeddingJob, JobStorageHold
from embeddings.redis.connections import redis_job_store
from embeddings.services.jobs.budget import (
    BOOKKEEPING_BYTES_PER_CHUNK,
    BOOKKEEPING_BYTES_PER_JOB,
    KEY_OVERHEAD_BYTES,
    STORAGE_MARGIN,
    StorageNeed,
    job_storage_admit,
    job_storage_need,
    job_storage_sweep,
    job_storage_used,
)
from embeddings.services.jobs.engine import (
    job_cancel,
    job_chunk_fail,
    job_chunk_run,
    job_delete,
    job_expire_due,
)
from embeddings.services.jobs.store import inputs_encode, job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.services.quotas.limits import quota_status_sync
from tests.api import conftest as api_fixtures
from tests.database_backend import wait_for_lock_waiters

api_setup = api_fixtures.api_setup

TEXTS = [f"sentence number {index} about embeddings" for index in range(23)]
CHUNK_SIZE = 5


@pytest.fixture
def small_chunks(settings):
    settings.JOB_CHUNK_SIZE = CHUNK_SIZE


def need_of(
    texts: list[str], dims: int, ids: list[str] | None = None, chunk_size: int = CHUNK_SIZE
) -> StorageNeed:
    """What job_create admits for these inputs: chunked and encoded as they are stored."""

    def chunked(items):
        return [items[start : start + chunk_size] for start in range(0, len(items), chunk_size)]

    inputs = inputs_encode(chunked(texts), None if ids is None else chunked(ids))
    return job_storage_need(inputs=inputs, rows=len(texts), dims=dims, result_dtype="float32")


def job_keys(job: EmbeddingJob | None = None) -> list[str]:
    pattern = "job:*" if job is None else f"job:{{{job.public_id}}}:*"
    return sorted(key.decode() for key in redis_job_store().keys(pattern))


def redis_memory_usage(keys: list[str]) -> int:
    """Redis's own count of the keys' bytes (SAMPLES 0: every element of a set or hash)."""
    client = redis_job_store()
    return sum(client.memory_usage(key, samples=0) for key in keys)


def submit(tenant_with_key, model, texts=TEXTS, **spec) -> EmbeddingJob:
    job, created = job_create(
        tenant_id=tenant_with_key.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=texts, **spec)
    )
    assert created
    return job


@pytest.mark.unit
def test_the_need_counts_inputs_as_stored_and_results_per_dimension():
    # A control character is stored as six bytes (\u0001): counting UTF-8 bytes would undercount.
    hostile = "\x01" * 100
    inputs = inputs_encode([["a", hostile], ["b"]], [["id-1", "id-2"], ["id-3"]])
    need = job_storage_need(inputs=inputs, rows=3, dims=384, result_dtype="float32")
    stored_texts = len(orjson.dumps(["a", hostile])) + len(orjson.dumps(["b"]))
    assert stored_texts > 600
    assert need.input_bytes == stored_texts + 2 * KEY_OVERHEAD_BYTES
    assert need.result_bytes == 3 * 384 * 4 + 2 * KEY_OVERHEAD_BYTES
    stored_ids = len(orjson.dumps(["id-1", "id-2"])) + len(orjson.dumps(["id-3"]))
    bookkeeping = BOOKKEEPING_BYTES_PER_JOB + 2 * BOOKKEEPING_BYTES_PER_CHUNK
    assert need.kept_bytes == stored_ids + 2 * KEY_OVERHEAD_BYTES + bookkeeping
    assert need.total == need.input_bytes + need.kept_bytes + need.result_bytes


def test_a_job_over_its_tenants_budget_is_refused_with_nothing_stored(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    need = need_of(TEXTS, model.dimensions)
    alpha.tenant.tokens_per_month = 1_000_000
    alpha.tenant.job_storage_budget_bytes = need.total - 1
    alpha.tenant.save()
    with pytest.raises(StorageBudgetExceeded) as refusal:
        submit(alpha, model)
    assert (refusal.value.budget, refusal.value.fits_when_empty) == ("tenant", False)
    assert "this tenant's job storage budget" in refusal.value.message
    # Nothing stored: no job, no bytes held, no Redis key, no tokens reserved.
    assert not EmbeddingJob.objects.exists() and not JobStorageHold.objects.exists()
    assert job_keys() == []
    assert quota_status_sync(alpha.tenant.pk)["tenant"]["tokens_per_month"]["used"] == 0

    # A budget of exactly the need admits it; then a job of any size waits for room.
    alpha.tenant.job_storage_budget_bytes = need.total
    alpha.tenant.save()
    job = submit(alpha, model)
    assert job_storage_used(tenant_id=alpha.tenant.pk) == need.total
    with pytest.raises(StorageBudgetExceeded) as refusal:
        submit(alpha, model, texts=["one more"])
    assert (refusal.value.budget, refusal.value.fits_when_empty) == ("tenant", True)
    assert list(EmbeddingJob.objects.values_list("pk", flat=True)) == [job.pk]
    assert {key.split(":")[1] for key in job_keys()} == {f"{{{job.public_id}}}"}


def test_the_global_budget_counts_every_tenant(api_setup, small_chunks, settings):
    alpha, beta, model = api_setup["alpha"], api_setup["beta"], api_setup["model"]
    need = need_of(TEXTS, model.dimensions)
    settings.JOB_STORAGE_GLOBAL_BUDGET_BYTES = 2 * need.total - 1
    submit(alpha, model)
    with pytest.raises(StorageBudgetExceeded) as refusal:
        submit(beta, model)
    assert (refusal.value.budget, refusal.value.fits_when_empty) == ("global", True)
    # Another tenant's usage is not told.
    assert "global job storage budget" in refusal.value.message
    assert str(need.total) not in refusal.value.message.replace(",", "")
    assert job_storage_used(tenant_id=beta.tenant.pk) == 0 and job_storage_used() == need.total


def test_a_finished_job_frees_its_inputs_and_keeps_its_results(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    ids = [f"doc-{index}" for index in range(len(TEXTS))]
    job, _ = job_create(
        tenant_id=alpha.tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=TEXTS, ids=ids)
    )
    need = need_of(TEXTS, model.dimensions, ids=ids)
    assert JobStorageHold.objects.get(public_id=job.public_id).stored_bytes == need.total
    for chunk in range(job.chunks):
        assert job_store(job).chunk_inputs(chunk) is not None
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    assert job.status == "completed"
    # The last chunk written: no texts left, the ids and the results stay.
    assert [key for key in job_keys(job) if ":in:" in key] == []
    assert len([key for key in job_keys(job) if ":ids:" in key]) == job.chunks
    assert len([key for key in job_keys(job) if ":out:" in key]) == job.chunks
    assert job_storage_used(tenant_id=alpha.tenant.pk) == need.kept_bytes + need.result_bytes


@pytest.mark.parametrize("chunk_size, count", [(CHUNK_SIZE, 23), (256, 300)])
def test_the_bytes_held_for_a_finished_job_match_redis_memory_usage(api_setup, settings, chunk_size, count):
    """MEMORY USAGE of the job's keys lies within STORAGE_MARGIN of what is held for it (small
    chunks, and the default chunk of 256 inputs whose 384 KiB results jemalloc rounds up most)."""
    settings.JOB_CHUNK_SIZE = chunk_size
    alpha, model = api_setup["alpha"], api_setup["model"]
    texts = [f"document {index}: {'some words about embeddings ' * (index % 5)}" for index in range(count)]
    job = submit(alpha, model, texts=texts)
    hold = JobStorageHold.objects.get(public_id=job.public_id)
    before = redis_memory_usage(job_keys(job))
    assert (1 - STORAGE_MARGIN) * hold.stored_bytes <= before + hold.result_bytes
    for chunk in range(job.chunks):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    hold.refresh_from_db()
    assert job.status == "completed" and hold.stored_bytes == hold.kept_bytes + hold.result_bytes
    reported = redis_memory_usage(job_keys(job))
    print(f"chunk {chunk_size}, {count} inputs: held {hold.stored_bytes}, MEMORY USAGE {reported}")
    assert (1 - STORAGE_MARGIN) * hold.stored_bytes <= reported <= (1 + STORAGE_MARGIN) * hold.stored_bytes


def test_cancel_delete_and_expiry_give_the_bytes_back(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    need = need_of(TEXTS, model.dimensions)
    # Cancelled after two of five chunks (a third failed): it keeps those chunks' results, nothing
    # else (a cancelled job is not retried: no texts are kept).
    cancelled = submit(alpha, model)
    for chunk in range(2):
        job_chunk_run(job_id=cancelled.pk, chunk=chunk)
    job_chunk_fail(job_id=cancelled.pk, chunk=4, code="embedding_failed", message="wrong answer")
    job_cancel(job=cancelled)
    job_chunk_run(job_id=cancelled.pk, chunk=2)  # sees the cancel and ends the job
    cancelled.refresh_from_db()
    assert (cancelled.status, cancelled.completed, cancelled.failed) == ("cancelled", 10, 3)
    held = JobStorageHold.objects.get(public_id=cancelled.public_id).stored_bytes
    assert held == need.kept_bytes + need.result_bytes * 10 // 23
    assert [key for key in job_keys(cancelled) if ":in:" in key] == []

    deleted = submit(alpha, model)
    job_delete(job=deleted)
    assert not JobStorageHold.objects.filter(public_id=deleted.public_id).exists()

    assert job_expire_due(now=timezone.now() + timedelta(days=8)) == 1
    assert job_storage_used() == 0 and job_keys() == []


def test_a_failed_job_keeps_its_failed_chunks_inputs_held_until_expiry(api_setup, small_chunks):
    """For an operator's retry (the admin): a failed chunk's texts stay, and stay counted, while
    the rest of the job's texts go as before."""
    alpha, model = api_setup["alpha"], api_setup["model"]
    need = need_of(TEXTS, model.dimensions)
    job = submit(alpha, model)  # 23 inputs: chunks of 5, 5, 5, 5, 3
    for chunk in (0, 2, 3):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job_chunk_fail(job_id=job.pk, chunk=1, code="embedding_failed", message="wrong answer")
    job_chunk_fail(job_id=job.pk, chunk=4, code="embedding_failed", message="wrong answer")
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed) == ("failed", 15, 8)
    assert [key for key in job_keys(job) if ":in:" in key] == [
        f"job:{{{job.public_id}}}:in:1",
        f"job:{{{job.public_id}}}:in:4",
    ]
    store = job_store(job)
    assert store.chunk_inputs(1) == TEXTS[5:10] and store.chunk_inputs(4) == TEXTS[20:]
    kept_texts = len(orjson.dumps(TEXTS[5:10])) + len(orjson.dumps(TEXTS[20:]))
    held = JobStorageHold.objects.get(public_id=job.public_id).stored_bytes
    assert held == need.kept_bytes + kept_texts + 2 * KEY_OVERHEAD_BYTES + need.result_bytes * 15 // 23
    assert job_expire_due(now=timezone.now() + timedelta(days=8)) == 1
    assert job_storage_used() == 0 and job_keys() == []


def test_the_sweep_gives_back_holds_whose_submission_died(api_setup, small_chunks):
    alpha, model = api_setup["alpha"], api_setup["model"]
    job = submit(alpha, model)
    need = need_of(["x"], model.dimensions)
    job_storage_admit(tenant=alpha.tenant, public_id="job_diedbeforeitsrow000000", need=need)
    job_storage_admit(tenant=alpha.tenant, public_id="job_stillsubmitting0000000", need=need)
    an_hour_ago = timezone.now() - timedelta(hours=1, minutes=1)
    JobStorageHold.objects.exclude(public_id="job_stillsubmitting0000000").update(created_at=an_hour_ago)
    assert job_storage_sweep() == 1
    remaining = set(JobStorageHold.objects.values_list("public_id", flat=True))
    assert remaining == {job.public_id, "job_stillsubmitting0000000"}


@pytest.mark.parametrize("budget", ["tenant", "global"])
def test_two_submissions_racing_for_the_last_bytes_admit_one(api_setup, settings, budget, postgresql_only):
    """Both submissions wait at the admission lock (held here) with room for one job between them;
    released together, one is admitted and the other refused: never both."""
    alpha, beta, model = api_setup["alpha"], api_setup["beta"], api_setup["model"]
    need = need_of(["racing text"], model.dimensions, chunk_size=settings.JOB_CHUNK_SIZE)
    if budget == "tenant":
        alpha.tenant.job_storage_budget_bytes = need.total
        alpha.tenant.save()
        racers = [alpha, alpha]
    else:
        settings.JOB_STORAGE_GLOBAL_BUDGET_BYTES = need.total
        racers = [alpha, beta]
    outcomes: list[object] = []

    def race(tenant_with_key):
        try:
            outcomes.append(submit(tenant_with_key, model, texts=["racing text"]))
        except Exception as error:
            outcomes.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(racer,)) for racer in racers]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {JobStorageHold._meta.db_table} IN SHARE ROW EXCLUSIVE MODE")
        for thread in threads:
            thread.start()
        wait_for_lock_waiters(2)
    for thread in threads:
        thread.join(timeout=60)
    admitted = [outcome for outcome in outcomes if isinstance(outcome, EmbeddingJob)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, StorageBudgetExceeded)]
    assert (len(admitted), len(refused)) == (1, 1), outcomes
    assert refused[0].budget == budget
    assert job_storage_used() == need.total
    assert list(EmbeddingJob.objects.values_list("public_id", flat=True)) == [admitted[0].public_id]


def test_many_concurrent_submissions_never_overshoot_the_budget(api_setup, settings, postgresql_only):
    alpha, model = api_setup["alpha"], api_setup["model"]
    need = need_of(["x"], model.dimensions, chunk_size=settings.JOB_CHUNK_SIZE)
    alpha.tenant.job_storage_budget_bytes = 3 * need.total
    alpha.tenant.save()
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def race():
        barrier.wait()
        try:
            submit(alpha, model, texts=["x"])
            outcomes.append("admitted")
        except StorageBudgetExceeded as refusal:
            outcomes.append(refusal.budget)
        finally:
            connection.close()

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["admitted"] * 3 + ["tenant"] * 5
    assert job_storage_used(tenant_id=alpha.tenant.pk) == 3 * need.total
    assert EmbeddingJob.objects.count() == 3
