"""Jobs in the admin (embeddings/admin_jobs.py), in process against the real Triton, Redis pair and
database: the list and its filters, a job's page (chunks, events, sizes), the actions and their
history, and staff who may only view. The actions' effect on a real Celery worker:
tests/admin/test_admin_jobs_engine.py; what a browser draws: tests/admin/test_browser.py."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from embeddings.models import EmbeddingJob
from embeddings.redis.connections import reset_redis_clients
from embeddings.services.jobs.engine import job_chunk_fail, job_chunk_run
from embeddings.services.jobs.leases import ChunkLease
from embeddings.services.jobs.store import job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.tooling.triton_server import free_port
from tests.api import conftest as api_fixtures
from tests.services import test_job_operator as operator_tests

api_setup = api_fixtures.api_setup
# Chunks of 5, two in flight; the chunks handed to the broker recorded, run by the tests here.
small_chunks = operator_tests.small_chunks
sent_chunks = operator_tests.sent_chunks

TEXTS = [f"sentence number {index} about embeddings" for index in range(23)]
CHANGELIST = "admin:embeddings_embeddingjob_changelist"


@pytest.fixture
def jobs(api_setup, small_chunks, sent_chunks) -> dict[str, EmbeddingJob]:
    """Alpha's failed job (chunks 1 and 4 failed), running job (chunk 0 done) and queued job with
    a callback; Beta's completed job."""
    alpha, beta, model = api_setup["alpha"], api_setup["beta"], api_setup["model"]

    def submit(who, texts=TEXTS, idempotency_key="", **spec) -> EmbeddingJob:
        spec = JobSpec(model=model, texts=texts, **spec)
        return job_create(
            tenant_id=who.tenant.pk, api_key_id=None, spec=spec, idempotency_key=idempotency_key
        )[0]

    failed = submit(alpha)
    for chunk in range(failed.chunks):
        if chunk in (1, 4):
            job_chunk_fail(job_id=failed.pk, chunk=chunk, code="embedding_failed", message="wrong answer")
        else:
            job_chunk_run(job_id=failed.pk, chunk=chunk)
    running = submit(alpha)
    job_chunk_run(job_id=running.pk, chunk=0)
    queued = submit(
        alpha,
        TEXTS[:4],
        idempotency_key="nightly-2026-11",
        callback_url="https://hooks.example.com/embedsite",
    )
    completed = submit(beta, texts=TEXTS[:10])
    for chunk in range(completed.chunks):
        job_chunk_run(job_id=completed.pk, chunk=chunk)
    for job in (failed, running, queued, completed):
        job.refresh_from_db()
    return {"failed": failed, "running": running, "queued": queued, "completed": completed}


@pytest.fixture
def viewer(client, transactional_db) -> User:
    """Staff who may view jobs (and tenants, models), not change them; logged in on `client`."""
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            codename__in=["view_embeddingjob", "view_tenant", "view_embeddingmodel"],
            content_type__app_label="embeddings",
        )
    )
    client.force_login(user)
    return user


def job_url(job: EmbeddingJob) -> str:
    return reverse("admin:embeddings_embeddingjob_change", args=[job.pk])


def act_url(job: EmbeddingJob, action: str) -> str:
    return reverse("admin:embeddings_embeddingjob_act", args=[job.pk, action])


def rows_of(page: str) -> list[str]:
    """The public ids the list shows, in order."""
    return re.findall(r'<th class="field-public_id"><a href="[^"]+">(job_[a-z0-9]+)</a>', page)


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# --- The list ---------------------------------------------------------------------------------------


def test_the_list_shows_every_job_with_progress_storage_and_callback(admin_client, jobs):
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    newest_first = [jobs[name].public_id for name in ("completed", "queued", "running", "failed")]
    assert rows_of(page) == newest_first
    # The failed job's bar: 15 of 23 completed (65.22 %), then 8 failed (34.78 %).
    failed_row = page[page.index(jobs["failed"].public_id) :].split("</tr>")[0]
    assert 'class="job-progress-completed" style="width: 65.22%"' in failed_row
    assert 'class="job-progress-failed" style="width: 34.78%"' in failed_row
    assert "23 / 23 (8 failed)" in failed_row
    assert f"{jobs['failed'].prompt_tokens:,}" in failed_row
    assert re.search(r'<span title="[\d,]+ bytes">[\d.]+ KiB</span>', failed_row)
    queued_row = page[page.index(jobs["queued"].public_id) :].split("</tr>")[0]
    assert 'style="width: 0.00%"' in queued_row and "0 / 4" in queued_row
    assert "sent when it finishes" in queued_row
    running_row = page[page.index(jobs["running"].public_id) :].split("</tr>")[0]
    assert "5 / 23" in running_row and 'style="width: 21.74%"' in running_row


def test_the_list_filters_by_tenant_status_model_and_date(admin_client, jobs, api_setup):
    changelist = reverse(CHANGELIST)
    beta = api_setup["beta"].tenant

    def shown(query: str) -> set[str]:
        return set(rows_of(admin_client.get(f"{changelist}?{query}").content.decode()))

    ids = {name: job.public_id for name, job in jobs.items()}
    assert shown(f"tenant__id__exact={beta.pk}") == {ids["completed"]}
    assert shown("status=active") == {ids["running"], ids["queued"]}
    assert shown("status=failed") == {ids["failed"]}
    assert shown(f"model__id__exact={api_setup['model'].pk}") == set(ids.values())
    today = timezone.now()
    assert shown(f"created_at__year={today.year}&created_at__month={today.month}") == set(ids.values())
    assert shown(f"created_at__year={today.year - 1}") == set()
    assert shown(f"q={ids['running']}") == {ids["running"]}
    assert shown("q=nightly-2026-11") == {ids["queued"]} and shown("q=nightly") == set()  # exact only
    EmbeddingJob.objects.filter(pk=jobs["queued"].pk).update(kind="batch")
    assert shown("kind=batch") == {ids["queued"]}
    assert shown("kind=embeddings") == set(ids.values()) - {ids["queued"]}


def test_the_list_reads_no_redis_and_a_fixed_number_of_queries(admin_client, jobs, api_setup, settings):
    """Many jobs cost no more queries than a few (tenant, model and the storage held joined), and
    the job store is not read: the list renders with it unreachable."""
    changelist = reverse(CHANGELIST)
    admin_client.get(changelist)  # the session and the user, read once
    with CaptureQueriesContext(connection) as few:
        assert admin_client.get(changelist).status_code == 200
    alpha, model = api_setup["alpha"].tenant, api_setup["model"]
    EmbeddingJob.objects.bulk_create(
        EmbeddingJob(
            public_id=f"job_bulk{index:020d}", tenant=alpha, model=model, total=10, completed=index % 10
        )
        for index in range(40)
    )
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    with CaptureQueriesContext(connection) as many:
        response = admin_client.get(changelist)
    assert response.status_code == 200 and len(rows_of(response.content.decode())) == 44
    assert len(many) == len(few), [query["sql"] for query in many]


# --- A job's page ---------------------------------------------------------------------------------


def test_a_jobs_page_shows_its_chunks_events_and_sizes(admin_client, jobs):
    job = jobs["failed"]
    response = admin_client.get(job_url(job))
    page = response.content.decode()
    assert response.status_code == 200
    inspection = response.context["inspection"]
    assert inspection.chunks_by_state == {"failed": 2, "done": 3}
    states = {
        row["chunk"]: (row["state"], row["attempts"], row["error"]) for row in response.context["chunk_rows"]
    }
    assert states == {
        1: ("failed", 0, "embedding_failed: wrong answer"),
        4: ("failed", 0, "embedding_failed: wrong answer"),
        0: ("done", 1, ""),
        2: ("done", 1, ""),
        3: ("done", 1, ""),
    }
    assert [row["chunk"] for row in response.context["chunk_rows"]] == [1, 4, 0, 2, 3]  # failed first
    assert "2 failed, 3 done" in page
    events = [(row["event"], row["detail"]) for row in response.context["event_rows"]]
    assert events[0] == ("failed", "15 of 23 inputs embedded, 8 failed")  # latest first
    assert ("chunk_failed", "chunk 4: embedding_failed: wrong answer") in events
    # The .npy download: a 128-byte header and 23 x 384 float32.
    assert f"({128 + 23 * 384 * 4:,} bytes)" in page
    assert "held now" in page
    # What applies now: retry; not cancel (it has ended); extend; no callback to re-send.
    actions = {button["action"]: button["refusal"] for button in response.context["action_buttons"]}
    assert actions == {
        "cancel": "it is failed",
        "extend": None,
        "retry": None,
        "resend_callback": "it has no callback_url",
    }
    # Read-only: no field to edit, no save or delete button.
    assert 'name="_save"' not in page and "deletelink" not in page and '<input type="text"' not in page


def test_a_running_chunk_shows_its_lease_holder(admin_client, jobs):
    job = jobs["running"]
    with ChunkLease(job_store(job), 1, lease_s=30):
        rows = {row["chunk"]: row for row in admin_client.get(job_url(job)).context["chunk_rows"]}
    assert rows[1]["state"] == "running" and re.fullmatch(r".+:\d+", rows[1]["lease_owner"])
    assert re.fullmatch(r"until \d+ s from now", rows[1]["lease"])
    assert (rows[0]["state"], rows[2]["state"], rows[3]["state"]) == ("done", "sent", "queued")


def test_a_jobs_page_renders_without_the_job_store(admin_client, jobs, settings):
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_TIMEOUT_S = 0.5
    reset_redis_clients()
    response = admin_client.get(job_url(jobs["failed"]))
    assert response.status_code == 200
    assert "The job store did not answer" in response.content.decode()
    assert jobs["failed"].public_id in response.content.decode()


def test_nothing_is_saved_added_or_deleted_here(admin_client, jobs):
    job = jobs["running"]
    assert admin_client.post(job_url(job), {"status": "completed"}).status_code == 405
    assert admin_client.get(reverse("admin:embeddings_embeddingjob_add")).status_code == 403
    assert (
        admin_client.post(reverse("admin:embeddings_embeddingjob_delete", args=[job.pk])).status_code == 403
    )
    job.refresh_from_db()
    assert job.status == "running"


# --- Actions ----------------------------------------------------------------------------------------


def test_cancel_from_the_jobs_page_is_logged(admin_client, jobs):
    job = jobs["running"]
    response = admin_client.post(act_url(job, "cancel"), follow=True)
    assert messages_of(response) == [
        f"Job {job.public_id} is cancelling: it stops once its running chunks have."
    ]
    job.refresh_from_db()
    assert job.status == "cancelling"
    entry = LogEntry.objects.get(object_id=str(job.pk))
    assert entry.user.username == "admin" and "is cancelling" in entry.change_message
    # The history page lists it, and the job's events name who asked.
    history = reverse("admin:embeddings_embeddingjob_history", args=[job.pk])
    assert "is cancelling" in admin_client.get(history).content.decode()
    assert ("cancelling", "asked by admin") in [(e.event, e.detail) for e in job_store(job).events()]


def test_extend_the_expiry_by_days_from_the_jobs_page(admin_client, jobs):
    job = jobs["completed"]
    before = job.expires_at
    response = admin_client.post(act_url(job, "extend"), {"days": "3"}, follow=True)
    job.refresh_from_db()
    assert job.expires_at == before + timedelta(days=3)
    assert messages_of(response) == [
        f"Job {job.public_id} now expires at {job.expires_at:%Y-%m-%d %H:%M:%S} UTC."
    ]
    refused = admin_client.post(act_url(job, "extend"), {"days": "0"}, follow=True)
    assert messages_of(refused) == ["Extend by 1 to 365 days."]


def test_retry_failed_chunks_from_the_jobs_page(admin_client, jobs, sent_chunks):
    job = jobs["failed"]
    response = admin_client.post(act_url(job, "retry"), follow=True)
    assert messages_of(response)[0].startswith(
        f"Job {job.public_id} is running again: 2 failed chunk(s), 8 inputs"
    )
    assert sent_chunks[-2:] == [(job.pk, 1), (job.pk, 4)]
    for chunk in (1, 4):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    page = admin_client.get(job_url(job))
    assert page.context["inspection"].chunks_by_state == {"done": 5}
    job.refresh_from_db()
    assert (job.status, job.completed, job.failed) == ("completed", 23, 0)
    # Done once: a second retry says why not.
    again = admin_client.post(act_url(job, "retry"), follow=True)
    assert messages_of(again) == [
        f"Job {job.public_id} is completed: only a failed job's failed chunks can be run again."
    ]
    assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1


def test_resend_the_callback_from_the_jobs_page(admin_client, jobs):
    job = jobs["queued"]
    refused = admin_client.post(act_url(job, "resend_callback"), follow=True)
    assert messages_of(refused) == [f"Job {job.public_id} is queued: its callback is sent when it finishes."]
    EmbeddingJob.objects.filter(pk=job.pk).update(
        status="completed", callback_attempts=7, callback_error="the receiver answered 500"
    )
    response = admin_client.post(act_url(job, "resend_callback"), follow=True)
    assert messages_of(response) == [
        f"Job {job.public_id}'s callback is sent again to https://hooks.example.com/embedsite."
    ]
    job.refresh_from_db()
    assert (job.callback_error, job.callback_delivered_at) == ("", None)


def test_an_action_the_job_store_cannot_take_says_so_and_is_not_logged(admin_client, jobs, settings):
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_TIMEOUT_S = 0.5
    reset_redis_clients()
    job = jobs["running"]
    (said,) = messages_of(admin_client.post(act_url(job, "cancel"), follow=True))
    assert said.startswith(f"Job {job.public_id}: Redis, the job store or the broker did not answer (")
    job.refresh_from_db()
    assert job.status == "running" and not LogEntry.objects.exists()


def test_bulk_actions_act_on_each_job_and_say_which_were_refused(admin_client, jobs):
    selected = [jobs[name].pk for name in ("running", "queued", "completed")]
    response = admin_client.post(
        reverse(CHANGELIST), {"action": "cancel_jobs", "_selected_action": selected}, follow=True
    )
    assert messages_of(response) == [
        "2 of 3 jobs: done.",
        f"Job {jobs['completed'].public_id} is completed: there is nothing to cancel.",
    ]
    statuses = dict(EmbeddingJob.objects.filter(pk__in=selected).values_list("public_id", "status"))
    assert statuses == {
        jobs["running"].public_id: "cancelling",
        jobs["queued"].public_id: "cancelling",
        jobs["completed"].public_id: "completed",
    }
    assert LogEntry.objects.count() == 2
    before = {job.pk: job.expires_at for job in EmbeddingJob.objects.filter(pk__in=selected)}
    admin_client.post(reverse(CHANGELIST), {"action": "extend_expiry", "_selected_action": selected})
    for job in EmbeddingJob.objects.filter(pk__in=selected):
        assert job.expires_at == before[job.pk] + timedelta(days=7)


# --- Staff who may only view ----------------------------------------------------------------------


def test_staff_who_may_only_view_see_jobs_and_cannot_act(client, viewer, jobs):
    changelist = client.get(reverse(CHANGELIST))
    page = changelist.content.decode()
    assert changelist.status_code == 200 and len(rows_of(page)) == 4
    for action in ("cancel_jobs", "extend_expiry", "retry_failed_chunks", "resend_callbacks"):
        assert action not in page
    job = jobs["failed"]
    detail = client.get(job_url(job))
    assert detail.status_code == 200 and "embedding_failed: wrong answer" in detail.content.decode()
    assert "You may view jobs, not act on them" in detail.content.decode()
    assert act_url(job, "retry") not in detail.content.decode()
    # Acting anyway is refused, through either door, and changes nothing.
    for action in ("cancel", "extend", "retry", "resend_callback"):
        assert client.post(act_url(jobs["running"], action)).status_code == 403
    refused = client.post(
        reverse(CHANGELIST), {"action": "cancel_jobs", "_selected_action": [jobs["running"].pk]}
    )
    assert refused.status_code == 403
    jobs["running"].refresh_from_db()
    job.refresh_from_db()
    assert (jobs["running"].status, job.status) == ("running", "failed")
    assert not LogEntry.objects.exists()


def test_staff_without_the_view_permission_see_no_job(client, jobs):
    user = User.objects.create_user("other", password="pw", is_staff=True)
    client.force_login(user)
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.get(job_url(jobs["failed"])).status_code == 403
    assert client.post(act_url(jobs["running"], "cancel")).status_code == 403
