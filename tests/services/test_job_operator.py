"""What an operator does to a job (embeddings/services/jobs/operator.py), against the real Triton,
Redis pair and database; chunks run in this process (a real Celery worker runs them in
tests/admin/test_admin_jobs_engine.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from embeddings.errors.service import JobActionRefused
from embeddings.models import EmbeddingJob
from embeddings.redis import keys
from embeddings.redis.connections import redis_sync
from embeddings.services.accounts.tenants import tenant_webhook_secret_rotate
from embeddings.services.jobs import engine, submission
from embeddings.services.jobs.budget import job_storage_used
from embeddings.services.jobs.callbacks import (
    SIGNATURE_HEADER,
    callback_signature_valid,
    job_callback_deliver,
)
from embeddings.services.jobs.engine import job_chunk_run, job_expire_due
from embeddings.services.jobs.operator import (
    job_callback_resend,
    job_cancel_by_operator,
    job_extend_expiry,
)
from embeddings.services.jobs.store import STORE_GRACE_S, job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from tests.api import conftest as api_fixtures
from tests.services.test_job_callbacks import LOOPBACK, Receiver, serve

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
