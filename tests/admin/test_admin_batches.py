"""Batches and files in the admin (embeddings/admin_batches.py), in process against the real Triton,
Redis pair and database: the lists and their filters, a batch's and a file's page, the download, the
cancel and delete actions and their history, staff who may only view, and others refused. The
actions' effect on a real Celery worker: tests/admin/test_admin_batches_engine.py; what a browser
draws: tests/admin/test_browser_batches.py."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from embeddings.models import Batch, EmbeddingJob, StoredFile
from embeddings.redis.connections import reset_redis_clients
from embeddings.services.jobs.store import job_store
from embeddings.services.openai_api.batches import batch_object
from embeddings.tooling.triton_server import free_port
from tests.batch_api import test_batch_operator as scene_fixtures

api_setup = scene_fixtures.api_setup
small_chunks = scene_fixtures.small_chunks
sent_chunks = scene_fixtures.sent_chunks
files_dir = scene_fixtures.files_dir
batch_scene = scene_fixtures.batch_scene
BATCHES = "admin:embeddings_batch_changelist"
FILES = "admin:embeddings_storedfile_changelist"


@pytest.fixture
def viewer(client, transactional_db) -> User:
    """Staff who may view batches and files (and jobs), not change or delete them; logged in."""
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            codename__in=["view_batch", "view_storedfile", "view_embeddingjob"],
            content_type__app_label="embeddings",
        )
    )
    client.force_login(user)
    return user


def batch_url(batch: Batch) -> str:
    return reverse("admin:embeddings_batch_change", args=[batch.pk])


def cancel_url(batch: Batch) -> str:
    return reverse("admin:embeddings_batch_act", args=[batch.pk, "cancel"])


def file_url(stored: StoredFile) -> str:
    return reverse("admin:embeddings_storedfile_change", args=[stored.pk])


def download_url(stored: StoredFile) -> str:
    return reverse("admin:embeddings_storedfile_download", args=[stored.pk])


def delete_url(stored: StoredFile) -> str:
    return reverse("admin:embeddings_storedfile_delete", args=[stored.pk])


def rows_of(page: str, prefix: str = "batch_") -> list[str]:
    """The public ids the list shows, in order."""
    return re.findall(rf'<th class="field-public_id"><a href="[^"]+">({prefix}[A-Za-z0-9]+)</a>', page)


def row_of(page: str, public_id: str) -> str:
    """The list's row of `public_id`, its non-breaking spaces (Django's "4\xa0weeks") plain."""
    return page[page.index(f">{public_id}</a>") :].split("</tr>")[0].replace("\xa0", " ")


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def downloaded(response) -> bytes:
    return b"".join(response)  # the admin's async pieces, read as a sync client would


# --- The batches list ------------------------------------------------------------------------------


def test_the_batches_list_shows_progress_counts_job_and_files(admin_client, batch_scene):
    scene = batch_scene
    page = admin_client.get(reverse(BATCHES)).content.decode()
    newest_first = [scene.validating, scene.failed, scene.completed, scene.running]
    assert rows_of(page) == [batch.public_id for batch in newest_first]
    running = row_of(page, scene.running.public_id)
    # 5 of 12 lines answered (41.67 %), then 2 refused while validating (16.67 %).
    assert 'class="job-progress-completed" style="width: 41.67%"' in running
    assert 'class="job-progress-failed" style="width: 16.67%"' in running
    assert "7 / 12 (2 failed)" in running
    assert '<td class="field-invalid_lines">2</td>' in running
    assert f"{scene.running.job.prompt_tokens:,}" in running
    job_page = reverse("admin:embeddings_embeddingjob_change", args=[scene.running.job_id])
    assert f'<a href="{job_page}" title="{scene.running.job.public_id}">running</a>' in running
    assert f'href="{file_url(scene.running.input_file)}"' in running
    assert re.search(r">window: in (23 hours|1 day)</span>", running)
    completed = row_of(page, scene.completed.public_id)
    assert "4 / 4 (1 failed)" in completed and 'style="width: 75.00%"' in completed
    for role in ("input", "output", "error"):
        stored = getattr(scene.completed, f"{role}_file")
        assert f'class="batch-file-{role}" href="{file_url(stored)}"' in completed
    assert ">files: in 4 weeks</span>" in completed  # BATCH_OUTPUT_TTL_S: 30 days
    assert "deleted once its files were written" in completed  # its job, gone after finalising
    # Failed while validating: no request counted, as the API reports it (its errors on its page).
    assert "0 / 0" in row_of(page, scene.failed.public_id)


def test_the_batches_list_filters_and_finds_by_id(admin_client, batch_scene, api_setup):
    scene = batch_scene
    changelist = reverse(BATCHES)

    def shown(query: str) -> set[str]:
        return set(rows_of(admin_client.get(f"{changelist}?{query}").content.decode()))

    ids = {name: getattr(scene, name).public_id for name in ("running", "completed", "failed", "validating")}
    assert shown(f"tenant__id__exact={api_setup['beta'].tenant.pk}") == {ids["failed"], ids["validating"]}
    assert shown("status=active") == {ids["running"], ids["validating"]}
    assert shown("status=completed") == {ids["completed"]}
    assert shown("endpoint=/v1/embeddings") == set(ids.values())
    assert shown("model=all-MiniLM-L6-v2") == {ids["running"], ids["completed"]}  # validated ones
    today = timezone.now()
    assert shown(f"created_at__year={today.year}&created_at__month={today.month}") == set(ids.values())
    assert shown(f"created_at__year={today.year - 1}") == set()
    assert shown(f"q={ids['running']}") == {ids["running"]}
    assert shown(f"q={scene.running.job.public_id}") == {ids["running"]}
    assert shown(f"q={scene.completed.error_file.public_id}") == {ids["completed"]}
    assert shown(f"q={scene.failed.input_file_public_id}") == {ids["failed"]}


def test_the_batches_list_reads_no_redis_and_a_fixed_number_of_queries(admin_client, batch_scene, settings):
    """Many batches cost no more queries than a few (tenant, job and files joined), and the job store
    is not read: the list renders with it unreachable."""
    changelist = reverse(BATCHES)
    admin_client.get(changelist)  # the session and the user, read once
    with CaptureQueriesContext(connection) as few:
        assert admin_client.get(changelist).status_code == 200
    completed = batch_scene.completed
    job = EmbeddingJob.objects.create(
        public_id="job_bulk",
        tenant=completed.tenant,
        model=batch_scene.running.job.model,
        total=4,
        kind="batch",
    )
    Batch.objects.bulk_create(
        Batch(
            public_id=f"batch_bulk{index:020d}",
            tenant=completed.tenant,
            job=job if index == 0 else None,
            input_file=completed.input_file,
            input_file_public_id=completed.input_file.public_id,
            output_file=completed.output_file,
            error_file=completed.error_file,
            endpoint="/v1/embeddings",
            completion_window="24h",
            status="completed" if index else "in_progress",
            total=4,
            completed=3,
            failed=1,
        )
        for index in range(40)
    )
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    with CaptureQueriesContext(connection) as many:
        response = admin_client.get(changelist)
    assert response.status_code == 200 and len(rows_of(response.content.decode())) == 44
    assert len(many) == len(few), [query["sql"] for query in many]


# --- A batch's page ---------------------------------------------------------------------------------


def test_a_batchs_page_shows_its_errors_files_job_and_timeline(admin_client, batch_scene):
    running = batch_scene.running
    response = admin_client.get(batch_url(running))
    page = response.content.decode()
    assert response.status_code == 200
    errors = [(row["line"], row["code"], row["param"]) for row in response.context["error_rows"]]
    assert errors == [(4, "invalid_method", "method"), (12, "duplicate_custom_id", "custom_id")]
    assert '<td class="error-message">custom_id &#x27;r-0&#x27; appears twice.</td>' in page
    assert "2 kept; every refused line goes to the error file." in page
    job_page = reverse("admin:embeddings_embeddingjob_change", args=[running.job_id])
    assert f'<a href="{job_page}">{running.job.public_id}</a> (running, 5 / 10)' in page
    (input_row,) = response.context["file_rows"]
    assert input_row["role"] == "input" and input_row["download_url"] == download_url(running.input_file)
    assert f"({running.input_file.bytes:,} bytes)" in input_row["size"]
    assert "yet: they are written when its job ends" in page
    timeline = [label for label, _ in response.context["timeline_rows"]]
    assert timeline == ["created (validating)", "in progress (validated, its job started)"]
    assert "completion window ends (24h)" in page
    assert "&quot;purpose&quot;: &quot;running.jsonl&quot;" in page  # its metadata, as JSON
    assert response.context["cancel_refusal"] is None and f'action="{cancel_url(running)}"' in page
    # Read-only: no field to edit, no save or delete button.
    assert 'name="_save"' not in page and "deletelink" not in page and '<input type="text"' not in page


def test_a_finished_batchs_page_links_its_three_files(admin_client, batch_scene):
    completed = batch_scene.completed
    response = admin_client.get(batch_url(completed))
    rows = {row["role"]: row for row in response.context["file_rows"]}
    assert list(rows) == ["input", "output", "error"]
    for role, row in rows.items():
        stored = getattr(completed, f"{role}_file")
        assert row["url"] == file_url(stored) and row["download_url"] == download_url(stored)
    labels = [label for label, _ in response.context["timeline_rows"]]
    assert labels == [
        "created (validating)",
        "in progress (validated, its job started)",
        "finalizing (its job ended; files being written)",
        "completed",
    ]
    assert response.context["cancel_refusal"] == "it is completed: there is nothing to cancel"
    page = response.content.decode()
    assert "Not now: it is completed: there is nothing to cancel." in page
    assert re.search(r'value="Cancel the batch" disabled', page)


def test_nothing_is_saved_added_or_deleted_on_batches(admin_client, batch_scene):
    running = batch_scene.running
    assert admin_client.post(batch_url(running), {"status": "completed"}).status_code == 405
    assert admin_client.get(reverse("admin:embeddings_batch_add")).status_code == 403
    assert admin_client.post(reverse("admin:embeddings_batch_delete", args=[running.pk])).status_code == 403
    assert admin_client.get(reverse("admin:embeddings_storedfile_add")).status_code == 403
    running.refresh_from_db()
    assert running.status == "in_progress"


# --- Cancel -----------------------------------------------------------------------------------------


def test_cancel_from_the_batchs_page_is_logged(admin_client, batch_scene):
    running = batch_scene.running
    response = admin_client.post(cancel_url(running), follow=True)
    said = (
        f"Batch {running.public_id} is cancelling: it stops once its running chunks have; what finished "
        "goes to its output file, the rest to its error file (batch_cancelled)."
    )
    assert messages_of(response) == [said]
    running.refresh_from_db()
    assert running.status == "cancelling" and running.job.status == "cancelling"
    entry = LogEntry.objects.get(object_id=str(running.pk))
    assert entry.user.username == "admin" and entry.change_message == said
    history = reverse("admin:embeddings_batch_history", args=[running.pk])
    assert "is cancelling" in admin_client.get(history).content.decode()
    assert ("cancelling", "asked by admin") in [(e.event, e.detail) for e in job_store(running.job).events()]
    again = admin_client.post(cancel_url(running), follow=True)
    assert messages_of(again) == [
        f"Batch {running.public_id}: it is cancelling already: it stops once its running chunks have."
    ]
    assert LogEntry.objects.count() == 1


def test_a_cancel_the_job_store_cannot_take_says_so(admin_client, batch_scene, settings):
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_TIMEOUT_S = 0.5
    reset_redis_clients()
    running = batch_scene.running
    (said,) = messages_of(admin_client.post(cancel_url(running), follow=True))
    assert said.startswith(f"Batch {running.public_id}: Redis, the job store or the broker did not answer (")
    assert not LogEntry.objects.exists()


def test_bulk_cancel_acts_on_each_batch_and_says_which_were_refused(admin_client, batch_scene):
    scene = batch_scene
    selected = [scene.running.pk, scene.validating.pk, scene.completed.pk]
    response = admin_client.post(
        reverse(BATCHES), {"action": "cancel_batches", "_selected_action": selected}, follow=True
    )
    assert messages_of(response) == [
        "2 of 3 batches: cancelling.",
        f"Batch {scene.completed.public_id}: it is completed: there is nothing to cancel.",
    ]
    statuses = dict(Batch.objects.filter(pk__in=selected).values_list("public_id", "status"))
    assert statuses == {
        scene.running.public_id: "cancelling",
        scene.validating.public_id: "cancelling",
        scene.completed.public_id: "completed",
    }
    assert LogEntry.objects.count() == 2


# --- Files ------------------------------------------------------------------------------------------


def test_the_files_list_shows_sizes_expiry_and_the_batches_using_each(admin_client, batch_scene):
    scene = batch_scene
    page = admin_client.get(reverse(FILES)).content.decode()
    completed = scene.completed
    newest_first = [
        scene.lone_file,
        scene.validating.input_file,
        scene.failed.input_file,
        completed.error_file,
        completed.output_file,
        completed.input_file,
        scene.running.input_file,
    ]
    assert rows_of(page, "file-") == [stored.public_id for stored in newest_first]
    output = row_of(page, completed.output_file.public_id)
    assert f'<span title="{completed.output_file.bytes:,} bytes">' in output and "Batch Output" in output
    assert f'<a href="{batch_url(completed)}">{completed.public_id}</a> (output, completed)' in output
    assert ">in 4 weeks</span>" in output
    assert f"{completed.public_id}</a> (error, completed)" in row_of(page, completed.error_file.public_id)
    assert f"{completed.public_id}</a> (input, completed)" in row_of(page, completed.input_file.public_id)
    assert '<td class="field-used_by">-</td>' in row_of(page, scene.lone_file.public_id)
    assert "never" in row_of(page, scene.lone_file.public_id)  # an upload without expires_after


def test_the_files_list_filters_and_reads_uses_in_one_query(admin_client, batch_scene, api_setup):
    scene = batch_scene
    changelist = reverse(FILES)

    def shown(query: str) -> set[str]:
        return set(rows_of(admin_client.get(f"{changelist}?{query}").content.decode(), "file-"))

    outputs = {scene.completed.output_file.public_id, scene.completed.error_file.public_id}
    assert shown("purpose__exact=batch_output") == outputs
    beta_files = {scene.failed.input_file.public_id, scene.validating.input_file.public_id}
    assert shown(f"tenant__id__exact={api_setup['beta'].tenant.pk}") == beta_files | {
        scene.lone_file.public_id
    }
    StoredFile.objects.filter(pk=scene.lone_file.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    assert shown("expired=yes") == {scene.lone_file.public_id}
    assert scene.lone_file.public_id not in shown("expired=no") and outputs <= shown("expired=no")
    assert shown(f"q={scene.lone_file.public_id}") == {scene.lone_file.public_id}
    assert shown("q=lone.js") == {scene.lone_file.public_id}
    lone_row = row_of(admin_client.get(changelist).content.decode(), scene.lone_file.public_id)
    assert '<span class="file-expired"' in lone_row and "expired 1 minute ago" in lone_row

    admin_client.get(changelist)
    with CaptureQueriesContext(connection) as few:
        admin_client.get(changelist)
    for index in range(30):  # more files, each named by a batch: still one query for the uses
        Batch.objects.create(
            public_id=f"batch_more{index:020d}",
            tenant=scene.completed.tenant,
            input_file=scene.completed.input_file,
            input_file_public_id=scene.completed.input_file.public_id,
            output_file=StoredFile.objects.create(
                public_id=f"file-more{index:020d}",
                tenant=scene.completed.tenant,
                purpose="batch_output",
                filename="out.jsonl",
                storage_name=f"more/{index}",
            ),
            endpoint="/v1/embeddings",
            completion_window="24h",
            status="completed",
        )
    with CaptureQueriesContext(connection) as many:
        page = admin_client.get(changelist).content.decode()
    assert len(rows_of(page, "file-")) == 37 and "… and 28 more" in page  # the shared input file
    assert len(many) == len(few), [query["sql"] for query in many]


def test_a_files_page_shows_its_download_and_what_deleting_it_does(admin_client, batch_scene):
    completed = batch_scene.completed
    response = admin_client.get(file_url(completed.output_file))
    page = response.content.decode()
    assert f'href="{download_url(completed.output_file)}"' in page
    assert f"Download {completed.output_file.filename}" in page
    assert f'<a href="{batch_url(completed)}">{completed.public_id}</a>' in page
    assert "its output_file_id becomes null (its 3 answered lines go with the file)" in page
    assert 'name="_save"' not in page and "deletelink" in page  # deleting, not editing


def test_the_download_streams_the_files_bytes(admin_client, batch_scene, files_dir):
    output = batch_scene.completed.output_file
    response = admin_client.get(download_url(output))
    assert response.status_code == 200 and response.streaming
    body = downloaded(response)
    assert body == (files_dir / output.storage_name).read_bytes() and len(body) == output.bytes
    assert response["Content-Length"] == str(output.bytes)
    assert response["Content-Disposition"] == (
        f'attachment; filename="{output.public_id}_{batch_scene.completed.public_id}_output.jsonl"'
    )
    assert response["Content-Type"] == "application/octet-stream"
    assert "no-cache" in response["Cache-Control"]  # admin_view: never cached
    assert [line.count(b'"custom_id"') for line in body.splitlines()] == [1, 1, 1]


def test_an_expired_files_download_is_refused(admin_client, batch_scene):
    stored = batch_scene.lone_file
    StoredFile.objects.filter(pk=stored.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    response = admin_client.get(download_url(stored))
    assert response.status_code == 404 and b"it expired at" in response.content
    assert "Not served: it expired at" in admin_client.get(file_url(stored)).content.decode()


def test_deleting_an_output_file_keeps_the_batch_says_so_and_logs_it(admin_client, batch_scene, files_dir):
    completed = batch_scene.completed
    output = completed.output_file
    confirmation = admin_client.get(delete_url(output)).content.decode()
    assert "Its bytes are deleted from the files storage, as DELETE /v1/files does." in confirmation
    assert f"{completed.public_id}</a> (output, completed): its output_file_id becomes null" in confirmation

    response = admin_client.post(delete_url(output), {"post": "yes"}, follow=True)
    effect = (
        f"Batch {completed.public_id} (output file {output.public_id}): its output_file_id becomes null "
        "(its 3 answered lines go with the file)."
    )
    said = messages_of(response)  # what it did to the batch, then Django's own
    assert said == [effect, f"The file “{output}” was deleted successfully."]
    assert not StoredFile.objects.filter(pk=output.pk).exists()
    assert not (files_dir / output.storage_name).exists()
    completed.refresh_from_db()
    assert completed.output_file_id is None and batch_object(completed)["output_file_id"] is None
    deletion = LogEntry.objects.get(action_flag=DELETION)
    assert deletion.object_id == str(output.pk) and deletion.user.username == "admin"
    assert deletion.change_message == (
        f"File {output.public_id} ({output.filename}, {output.bytes:,} bytes) and its bytes deleted. {effect}"
    )
    in_batch = LogEntry.objects.get(object_id=str(completed.pk))
    assert in_batch.change_message == (
        f"Its output file {output.public_id} was deleted: its output_file_id becomes null "
        "(its 3 answered lines go with the file)."
    )
    assert admin_client.get(download_url(output)).status_code == 404
    assert "(deleted)" not in admin_client.get(reverse(BATCHES)).content.decode()  # input still there
    assert "No output or error file" not in admin_client.get(batch_url(completed)).content.decode()


def test_bulk_delete_deletes_each_file_through_the_service(admin_client, batch_scene, files_dir):
    scene = batch_scene
    selected = [scene.lone_file, scene.running.input_file]
    confirmation = admin_client.post(
        reverse(FILES), {"action": "delete_selected", "_selected_action": [stored.pk for stored in selected]}
    ).content.decode()
    assert "Their bytes are deleted from the files storage" in confirmation
    assert "nothing changes: it has read its lines already" in confirmation
    response = admin_client.post(
        reverse(FILES),
        {"action": "delete_selected", "_selected_action": [stored.pk for stored in selected], "post": "yes"},
        follow=True,
    )
    said = messages_of(response)
    assert said[0].startswith(f"Batch {scene.running.public_id} (input file ")
    assert said[1:] == ["Successfully deleted 2 files."]
    for stored in selected:
        assert not (files_dir / stored.storage_name).exists()
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 2
    page = admin_client.get(reverse(BATCHES)).content.decode()
    assert f'<span title="{scene.running.input_file_public_id}">input (deleted)</span>' in page
    # Found by its deleted input file's id, which it keeps.
    found = admin_client.get(f"{reverse(BATCHES)}?q={scene.running.input_file_public_id}").content.decode()
    assert rows_of(found) == [scene.running.public_id]


# --- Who may see and act ----------------------------------------------------------------------------


def test_staff_who_may_only_view_see_and_download_but_cannot_act(client, viewer, batch_scene, files_dir):
    scene = batch_scene
    changelist = client.get(reverse(BATCHES)).content.decode()
    assert len(rows_of(changelist)) == 4 and "cancel_batches" not in changelist
    running = client.get(batch_url(scene.running)).content.decode()
    assert "You may view batches, not act on them" in running and cancel_url(scene.running) not in running
    assert "duplicate_custom_id" in running
    files = client.get(reverse(FILES)).content.decode()
    assert len(rows_of(files, "file-")) == 7 and "delete_selected" not in files
    output = scene.completed.output_file
    page = client.get(file_url(output)).content.decode()
    assert "deletelink" not in page and f'href="{download_url(output)}"' in page
    # Reading a tenant's file is viewing it: the view permission is enough.
    download = client.get(download_url(output))
    assert (
        download.status_code == 200 and downloaded(download) == (files_dir / output.storage_name).read_bytes()
    )
    # Acting anyway is refused, through every door, and changes nothing.
    assert client.post(cancel_url(scene.running)).status_code == 403
    assert (
        client.post(
            reverse(BATCHES), {"action": "cancel_batches", "_selected_action": [scene.running.pk]}
        ).status_code
        == 403
    )
    assert client.post(delete_url(output), {"post": "yes"}).status_code == 403
    refused = client.post(
        reverse(FILES), {"action": "delete_selected", "_selected_action": [output.pk], "post": "yes"}
    )
    assert refused.status_code == 403
    scene.refreshed()
    assert scene.running.status == "in_progress" and StoredFile.objects.filter(pk=output.pk).exists()
    assert (files_dir / output.storage_name).exists() and not LogEntry.objects.exists()


def test_others_get_no_batch_and_no_file(client, batch_scene):
    output = batch_scene.completed.output_file
    client.force_login(User.objects.create_user("tenant-user", password="pw"))  # not staff
    refused = client.get(download_url(output))
    assert refused.status_code == 302 and refused["Location"].startswith(reverse("admin:login"))
    assert b"custom_id" not in refused.content
    staff = User.objects.create_user("other-staff", password="pw", is_staff=True)
    client.force_login(staff)  # staff without the permissions
    assert client.get(download_url(output)).status_code == 403
    assert client.get(reverse(BATCHES)).status_code == 403
    assert client.get(file_url(output)).status_code == 403
    assert client.post(cancel_url(batch_scene.running)).status_code == 403
