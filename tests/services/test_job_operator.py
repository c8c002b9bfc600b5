"""What an operator does to a job (embeddings/services/jobs/operator.py), against the real Triton,
Redis pair and database; chunks run in this process (a real Celery worker runs them in
tests/admin/test_admin_jobs_engine.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest
from django.utils import timezone

from embeddings.errors.service import JobActionRefused
from embeddings.models import EmbeddingJob, JobStorageHold
from embeddings.redis import keys
from embeddings.redis.connections import redis_sync
from embeddings.services.accounts.tenants import tenant_webhook_secret_rotate
from embeddings.services.inference.embedding import EmbeddingTarget, embeddings_create_sync
from embeddings.services.jobs import engine, submission
from embeddings.services.jobs.budget import job_storage_used
from embeddings.services.jobs.callbacks import (
    SIGNATURE_HEADER,
    callback_signature_valid,
    job_callback_deliver,
)
from embeddings.services.jobs.engine import job_chunk_fail, job_chunk_give_up, job_chunk_run, job_expire_due
from embeddings.services.jobs.leases import ChunkLease
from embeddings.services.jobs.operator import (
    job_callback_resend,
    job_cancel_by_operator,
    job_extend_expiry,
    job_inspect,
    job_retry_failed_chunks,
)
from embeddings.services.jobs.store import STORE_GRACE_S, job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.services.quotas.limits import quota_status_sync
from tests.api import conftest as api_fixtures
from tests.services.test_job_callbacks import LOOPBACK, Receiver, serve
from tests.services.test_jobs import _job_usage_totals, stored_vectors

api_setup = api_fixtures.api_setup

TEXTS = [f"sentence number {index} about embeddings" for index in range(23)]
DAY = timedelta(days=1)


@pytest.fixture
def small_chunks(settings):
    settings.JOB_CHUNK_SIZE = 5
    settings.JOB_CHUNKS_IN_FLIGHT = 2


@pytest.fixture
def sent_chunks(monkeypatch) -> list[tuple[int, int]]:
    """The chunks the engine hands to the broker, (job id, chunk): the tests run them here."""
    sent: list[tuple[int, int]] = []

    def send(job_id: int, chunk: int, *priority: int) -> None:
        sent.append((job_id, chunk))

    for module in (submission, engine):
        monkeypatch.setattr(module, "chunk_send", send)
    return sent


def submit(api_setup, texts=TEXTS, **spec) -> EmbeddingJob:
    alpha = api_setup["alpha"]
    spec = JobSpec(model=api_setup["model"], texts=texts, **spec)
    return job_create(tenant_id=alpha.tenant.pk, api_key_id=None, spec=spec)[0]


def run_chunks(job: EmbeddingJob, chunks) -> EmbeddingJob:
    for chunk in chunks:
        job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    return job


def expected_vectors(job: EmbeddingJob) -> np.ndarray:
    """What the synchronous API answers for the job's texts."""
    target = EmbeddingTarget.for_model(job.model)
    return embeddings_create_sync(target=target, texts=TEXTS[: job.total]).vectors


def events(job: EmbeddingJob) -> list[tuple[str, str]]:
    return [(event.event, event.detail) for event in job_store(job).events()]


# --- Cancel ----------------------------------------------------------------------------------------


def test_an_operator_cancels_a_running_job_and_its_history_says_who(api_setup, small_chunks, sent_chunks):
    job = run_chunks(submit(api_setup), [0])
    assert job_cancel_by_operator(job=job, actor="root").status == "cancelling"
    job = run_chunks(job, [1])  # the next chunk to run sees the cancel and ends the job
    assert (job.status, job.completed) == ("cancelled", 5)
    assert events(job)[1:] == [
        ("cancelling", "asked by root"),
        ("cancelled", "5 of 23 inputs embedded, 0 failed"),
    ]
    with pytest.raises(JobActionRefused, match="is cancelled: there is nothing to cancel"):
        job_cancel_by_operator(job=job, actor="root")


# --- Extend expiry ---------------------------------------------------------------------------------


def test_extending_the_expiry_keeps_every_key_past_it(api_setup, small_chunks, sent_chunks, settings):
    job = run_chunks(submit(api_setup), [0, 1])
    store = job_store(job)
    before = store.ttls(job.chunks)
    assert max(before.values()) <= settings.JOB_RESULT_TTL_S + STORE_GRACE_S
    previous = job.expires_at

    extension = job_extend_expiry(job=job, by=timedelta(days=10), actor="root")

    job.refresh_from_db()
    assert extension.previous == previous and extension.expires_at == job.expires_at == previous + 10 * DAY
    assert not extension.capped
    after = store.ttls(job.chunks)
    assert set(after) == set(before)  # no key made, none lost
    outlive = (job.expires_at - timezone.now()).total_seconds() + STORE_GRACE_S
    rate_limit = keys.job_key(job.public_id, "event")
    for name, ttl in after.items():
        if name != rate_limit:  # the progress events' rate limit keeps its half second
            assert outlive - 60 < ttl <= outlive + 1, name
    # The once-markers in the critical Redis live as long: a late redelivery still counts once.
    assert redis_sync().ttl(keys.usage_counted(job.public_id)) > outlive - 60
    # Later writes keep the longer life: a chunk finishing now writes its keys for as long.
    run_chunks(job, [2])
    assert store.client.ttl(store.key("out", 2)) > outlive - 60
    assert events(job)[-1][0] == "expiry_extended" and events(job)[-1][1].endswith(" by root")
    # The results are still there on the old expiry's day, and go on the new one.
    assert job_expire_due(now=previous + timedelta(minutes=1)) == 0
    assert job_expire_due(now=job.expires_at + timedelta(minutes=1)) == 1


def test_an_expiry_stops_at_the_longest_retention(api_setup, small_chunks, sent_chunks, settings):
    settings.JOB_MAX_RETENTION_S = 10 * 86400  # submission + 7 days, at most 3 more
    job = submit(api_setup)
    extension = job_extend_expiry(job=job, by=timedelta(days=5))
    assert extension.capped and extension.expires_at == job.created_at + 10 * DAY
    with pytest.raises(JobActionRefused, match="the latest allowed: 10 days after its submission"):
        job_extend_expiry(job=job, by=DAY)


def test_no_extension_for_an_expired_job_or_a_tenant_over_its_budget(api_setup, small_chunks, sent_chunks):
    job = submit(api_setup)
    tenant = api_setup["alpha"].tenant
    tenant.job_storage_budget_bytes = job_storage_used(tenant_id=tenant.pk) - 1  # lowered since
    tenant.save()
    with pytest.raises(JobActionRefused, match="more than its job storage budget"):
        job_extend_expiry(job=job, by=DAY)
    tenant.job_storage_budget_bytes = None
    tenant.save()
    job_expire_due(now=job.expires_at + timedelta(minutes=1))
    with pytest.raises(JobActionRefused, match="has expired"):
        job_extend_expiry(job=job, by=DAY)


# --- The callback ----------------------------------------------------------------------------------


@pytest.fixture
def receiver(settings) -> Iterator[Receiver]:
    settings.JOB_CALLBACK_ALLOWED_NETWORKS = LOOPBACK
    yield from serve(Receiver())


def test_a_callback_is_sent_again_signed(api_setup, small_chunks, sent_chunks, receiver):
    secret = tenant_webhook_secret_rotate(tenant=api_setup["alpha"].tenant)
    job = submit(api_setup, texts=TEXTS[:10], callback_url=receiver.url())
    with pytest.raises(JobActionRefused, match="is queued: its callback is sent when it finishes"):
        job_callback_resend(job=job)
    job = run_chunks(job, [0, 1])
    job_callback_deliver(job_id=job.pk)  # what the task the job's end sent does
    assert len(receiver.received) == 1 and delivered_at(job) is not None

    job = job_callback_resend(job=job, actor="root")
    assert job.callback_delivered_at is None and job.callback_error == ""
    job_callback_deliver(job_id=job.pk)  # what the task the operator sent does
    assert len(receiver.received) == 2 and delivered_at(job) is not None
    _, headers, body = receiver.received[1]
    assert callback_signature_valid(body, headers[SIGNATURE_HEADER], secret=secret)
    assert ("callback_resent", f"to {receiver.url()} by root") in events(job)


def delivered_at(job: EmbeddingJob):
    job.refresh_from_db()
    return job.callback_delivered_at


def test_no_callback_to_send_again_without_a_url(api_setup, small_chunks, sent_chunks):
    job = run_chunks(submit(api_setup, texts=TEXTS[:5]), [0])
    with pytest.raises(JobActionRefused, match="has no callback_url"):
        job_callback_resend(job=job)


def test_a_batchs_job_is_left_to_its_batch(api_setup, small_chunks, sent_chunks):
    job = submit(api_setup)
    EmbeddingJob.objects.filter(pk=job.pk).update(kind="batch")
    for action in (job_cancel_by_operator, job_callback_resend):
        with pytest.raises(JobActionRefused, match="runs a batch: act on it through its batch"):
            action(job=job)
    with pytest.raises(JobActionRefused, match="through its batch"):
        job_extend_expiry(job=job, by=DAY)


# --- Retry failed chunks ---------------------------------------------------------------------------


@pytest.fixture
def monthly_quota(api_setup):
    """Alpha with a monthly token budget: what a job reserves and settles shows in its counter."""
    tenant = api_setup["alpha"].tenant
    tenant.tokens_per_month = 1_000_000
    tenant.save()
    return lambda: quota_status_sync(tenant.pk)["tenant"]["tokens_per_month"]["used"]


def failed_job(api_setup, failing=(1, 4)) -> EmbeddingJob:
    """23 inputs in chunks of 5, 5, 5, 5, 3; the `failing` chunks failed (the model answered
    wrongly), the others embedded: the job ended failed."""
    job = submit(api_setup)
    for chunk in range(job.chunks):
        if chunk in failing:
            job_chunk_fail(job_id=job.pk, chunk=chunk, code="embedding_failed", message="wrong answer")
        else:
            job_chunk_run(job_id=job.pk, chunk=chunk)
    job.refresh_from_db()
    assert (job.status, job.failed) == ("failed", sum(5 if chunk < 4 else 3 for chunk in failing))
    return job


def test_retried_chunks_run_and_the_job_completes_counted_once(
    api_setup, small_chunks, sent_chunks, monthly_quota
):
    job = failed_job(api_setup)
    hold_before = JobStorageHold.objects.get(public_id=job.public_id).stored_bytes
    assert monthly_quota() == job.prompt_tokens  # the submission's reservation settled

    started = job_retry_failed_chunks(job=job, actor="root")

    assert (started.chunks, started.inputs) == ([1, 4], 8) and started.reserved_tokens > 0
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed, job.error_code, job.finished_at) == (
        "running",
        15,
        0,
        "",
        None,
    )
    assert sent_chunks[-2:] == [(job.pk, 1), (job.pk, 4)]  # the window: both, JOB_CHUNKS_IN_FLIGHT is 2
    assert monthly_quota() == job.prompt_tokens + started.reserved_tokens
    hold = JobStorageHold.objects.get(public_id=job.public_id)
    assert hold.stored_bytes == hold_before + started.held_bytes
    assert job_store(job).failed_chunks() == set()

    job = run_chunks(job, [1, 4])
    assert (job.status, job.completed, job.failed, job.total) == ("completed", 23, 0, 23)
    np.testing.assert_allclose(stored_vectors(job), expected_vectors(job), atol=1e-5)
    # Each chunk's usage counted once per run: five chunks embedded, two of them failed once before.
    totals = _job_usage_totals()
    assert (totals["requests"], totals["succeeded"], totals["failed"], totals["inputs"]) == (7, 5, 2, 23)
    assert totals["tokens"] == job.prompt_tokens
    # Both reservations settled: the month holds the tokens used, no more.
    assert monthly_quota() == job.prompt_tokens
    # It holds what a job that completed at once holds: its results, no inputs.
    hold.refresh_from_db()
    assert hold.stored_bytes == hold.kept_bytes + hold.result_bytes
    assert job_store(job).input_bytes(range(job.chunks)) == 0
    # A late redelivery of a retried chunk writes and counts nothing more.
    job_chunk_run(job_id=job.pk, chunk=1)
    assert _job_usage_totals() == totals and monthly_quota() == job.prompt_tokens
    kept = events(job)
    assert (
        "retrying",
        f"round 1: chunks [1, 4] (8 inputs) run again by root; {started.reserved_tokens:,} tokens reserved",
    ) in kept
    assert kept[-1] == ("completed", "23 of 23 inputs embedded, 0 failed")


def test_a_given_up_job_runs_its_chunks_again_with_its_fair_share(api_setup, small_chunks, sent_chunks):
    """Triton was down: chunk 1 gave up, the chunks after it count failed, unrun. Run again, they
    are handed out JOB_CHUNKS_IN_FLIGHT at a time, each finished one handing out the next."""
    job = run_chunks(submit(api_setup), [0])
    job_chunk_give_up(job_id=job.pk, chunk=1, code="model_unavailable", message="Triton down")
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed) == ("failed", 5, 18)
    sent_before = len(sent_chunks)

    assert job_retry_failed_chunks(job=job).chunks == [1, 2, 3, 4]
    assert sent_chunks[sent_before:] == [(job.pk, 1), (job.pk, 2)]
    job = run_chunks(job, [1])
    assert sent_chunks[-1] == (job.pk, 3)  # chunk 1's successor
    job = run_chunks(job, [2, 3])
    assert sent_chunks[-1] == (job.pk, 4) and len(sent_chunks) == sent_before + 4
    assert job.status == "running"  # the give-up's cancel flag went with the retry
    job = run_chunks(job, [4])
    assert (job.status, job.completed, job.failed) == ("completed", 23, 0)


def test_a_chunk_failing_again_fails_the_job_again_and_a_second_round_settles_too(
    api_setup, small_chunks, sent_chunks, monthly_quota
):
    job = failed_job(api_setup, failing=(1, 4))
    first = job_retry_failed_chunks(job=job)
    job_chunk_fail(job_id=job.pk, chunk=4, code="embedding_failed", message="wrong again")
    job = run_chunks(job, [1])
    assert (job.status, job.completed, job.failed) == ("failed", 20, 3)
    assert job_store(job).chunk_inputs(4) == TEXTS[20:]  # kept for another try
    assert monthly_quota() == job.prompt_tokens  # round 1 settled at this end

    second = job_retry_failed_chunks(job=job)
    assert second.chunks == [4] and second.reserved_tokens < first.reserved_tokens
    job = run_chunks(job, [4])
    assert (job.status, job.completed, job.failed) == ("completed", 23, 0)
    assert monthly_quota() == job.prompt_tokens == _job_usage_totals()["tokens"]
    assert sorted(job_store(job).retry_rounds()) == [1, 2]


def test_a_retry_the_quota_cannot_take_is_refused_and_changes_nothing(
    api_setup, small_chunks, sent_chunks, monthly_quota
):
    job = failed_job(api_setup)
    tenant = api_setup["alpha"].tenant
    tenant.tokens_per_month = monthly_quota() + 10  # far less than chunks 1 and 4 may need
    tenant.save()
    hold = JobStorageHold.objects.get(public_id=job.public_id).stored_bytes
    used, sent = monthly_quota(), len(sent_chunks)
    with pytest.raises(JobActionRefused, match=r"Tenant alpha's quota cannot take the [\d,]+ tokens"):
        job_retry_failed_chunks(job=job)
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed) == ("failed", 15, 8)
    assert job_store(job).failed_chunks() == {1, 4} and job_store(job).retry_rounds() == {}
    assert JobStorageHold.objects.get(public_id=job.public_id).stored_bytes == hold
    assert monthly_quota() == used and len(sent_chunks) == sent


def test_a_retry_whose_results_do_not_fit_the_storage_budget_is_refused(api_setup, small_chunks, sent_chunks):
    job = failed_job(api_setup)
    tenant = api_setup["alpha"].tenant
    tenant.job_storage_budget_bytes = job_storage_used(tenant_id=tenant.pk) + 100
    tenant.save()
    with pytest.raises(
        JobActionRefused, match=r"Running this job's failed chunks again needs .* of job storage"
    ):
        job_retry_failed_chunks(job=job)
    job.refresh_from_db()
    assert job.status == "failed" and job_store(job).failed_chunks() == {1, 4}


def test_only_a_failed_jobs_failed_chunks_run_again(api_setup, small_chunks, sent_chunks):
    job = submit(api_setup)
    with pytest.raises(JobActionRefused, match="is queued: only a failed job's failed chunks"):
        job_retry_failed_chunks(job=job)
    job = failed_job(api_setup)
    job_retry_failed_chunks(job=job)
    with pytest.raises(JobActionRefused, match="is running: only a failed job's"):
        job_retry_failed_chunks(job=job)


# --- What an operator reads ------------------------------------------------------------------------


def test_inspecting_a_job_reads_each_chunks_state_and_what_applies(api_setup, small_chunks, sent_chunks):
    job = run_chunks(submit(api_setup), [0])
    job_chunk_fail(job_id=job.pk, chunk=3, code="embedding_failed", message="wrong answer")
    with ChunkLease(job_store(job), 1, lease_s=30):
        inspection = job_inspect(job=job)
    states = {state.chunk: state.state for state in inspection.chunks}
    assert states == {0: "done", 1: "running", 2: "sent", 3: "failed", 4: "queued"}
    assert [state.chunk for state in inspection.chunks] == [1, 2, 3, 4, 0]  # the most telling first
    assert inspection.chunks_by_state == {"running": 1, "sent": 1, "failed": 1, "queued": 1, "done": 1}
    running = inspection.chunks[0]
    assert running.attempts == 1 and running.lease_owner and running.lease_deadline_ms > inspection.clock_ms
    assert inspection.chunks[2].error == "embedding_failed: wrong answer"
    assert inspection.download_bytes == 128 + 23 * 384 * 4
    assert inspection.actions == {
        "cancel": None,
        "extend": None,
        "retry": "only a failed job's failed chunks run again",
        "resend_callback": "it has no callback_url",
    }
    # Ended failed: the retry applies, the cancel no longer.
    job = run_chunks(job, [1, 2, 4])
    inspection = job_inspect(job=job)
    assert job.status == "failed" and inspection.actions["retry"] is None
    assert inspection.actions["cancel"] == "it is failed"
