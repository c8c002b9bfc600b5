"""What an operator does to a batch or a file (embeddings/services/openai_api/operator.py), against the
real Triton, Redis pair and database, the batches validated and their chunks run in this process (a
real Celery worker runs them in tests/admin/test_admin_batches_engine.py). The scene here is shared
with the admin's in-process tests (tests/admin/test_admin_batches.py)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import timedelta

import orjson
import pytest
from django.db import transaction
from django.utils import timezone

from embeddings.errors.service import BatchActionRefused
from embeddings.models import Batch, EmbeddingJob, StoredFile
from embeddings.services.jobs.engine import job_chunk_run
from embeddings.services.jobs.store import job_store
from embeddings.services.openai_api.batches import (
    batch_counts,
    batch_create,
    batch_finalize,
    batch_object,
    batch_validate,
)
from embeddings.services.openai_api.files import file_create, file_delete, files_storage
from embeddings.services.openai_api.operator import (
    batch_cancel_by_operator,
    file_delete_by_operator,
    file_download_refusal,
    files_uses,
)
from tests.api import conftest as api_fixtures
from tests.services import test_job_operator as operator_tests

api_setup = api_fixtures.api_setup
# Chunks of 5 inputs; the chunks handed to the broker recorded, run by the tests here.
small_chunks = operator_tests.small_chunks
sent_chunks = operator_tests.sent_chunks

MODEL = "all-MiniLM-L6-v2"


def request_line(custom_id: str, text: str, **changes) -> bytes:
    body = {"model": MODEL, "input": text}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body, **changes}
    return orjson.dumps(line) + b"\n"


@dataclass
class BatchScene:
    running: Batch  # Alpha's: 12 lines, 2 refused while validating, chunk 0 (5 lines) run
    completed: Batch  # Alpha's: 3 lines answered (output file) and 1 refused (error file)
    failed: Batch  # Beta's: no valid line
    validating: Batch  # Beta's: not validated yet
    lone_file: StoredFile  # Beta's, named by no batch

    def refreshed(self) -> BatchScene:
        for batch in (self.running, self.completed, self.failed, self.validating):
            batch.refresh_from_db()
        return self


@pytest.fixture
def files_dir(settings, tmp_path):
    """The files storage in the test's own directory (never the checkout's .run/files)."""
    settings.STORAGES = {
        **settings.STORAGES,
        "files": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "files")},
        },
    }
    return tmp_path / "files"


@pytest.fixture
def batch_scene(api_setup, small_chunks, sent_chunks, files_dir) -> BatchScene:
    alpha, beta = api_setup["alpha"].tenant, api_setup["beta"].tenant

    def upload(tenant, lines: list[bytes], name: str = "requests.jsonl") -> StoredFile:
        return file_create(
            tenant_id=tenant.pk,
            purpose=StoredFile.Purpose.BATCH,
            filename=name,
            content=io.BytesIO(b"".join(lines)),
        )

    def batch_of(tenant, lines: list[bytes], name: str, *, validate: bool = True) -> Batch:
        batch = batch_create(
            tenant_id=tenant.pk,
            api_key_id=None,
            input_file=upload(tenant, lines, name),
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"purpose": name},
        )
        if validate:
            batch_validate(batch_id=batch.pk)
        batch.refresh_from_db()
        return batch

    running_lines = [request_line(f"r-{index}", f"running line {index}") for index in range(10)]
    running_lines.insert(3, request_line("r-bad-method", "x", method="GET"))
    running_lines.append(request_line("r-0", "the same custom_id again"))
    running = batch_of(alpha, running_lines, "running.jsonl")
    job_chunk_run(job_id=running.job_id, chunk=0)

    completed_lines = [request_line(f"c-{index}", f"completed line {index}") for index in range(3)]
    completed = batch_of(alpha, [*completed_lines, b"not json\n"], "completed.jsonl")
    job = completed.job
    for chunk in range(job.chunks):
        job_chunk_run(job_id=job.pk, chunk=chunk)
    batch_finalize(batch_id=completed.pk)  # as the task the job's end sends would

    failed = batch_of(beta, [b"[1, 2]\n", request_line("f-1", "x", url="/v1/rerank")], "failed.jsonl")
    validating = batch_of(beta, [request_line("v-1", "waiting")], "validating.jsonl", validate=False)
    lone = upload(beta, [request_line("l-1", "alone")], "lone.jsonl")
    return BatchScene(running, completed, failed, validating, lone).refreshed()


def test_the_scene_is_what_the_tests_rely_on(batch_scene):
    scene = batch_scene
    assert (scene.running.status, scene.running.total, scene.running.invalid_lines) == ("in_progress", 12, 2)
    assert scene.completed.status == "completed" and scene.completed.job is None
    assert (scene.completed.completed, scene.completed.failed) == (3, 1)
    assert scene.completed.output_file.bytes > 0 and scene.completed.error_file.bytes > 0
    assert scene.failed.status == "failed" and [error["code"] for error in scene.failed.errors] == [
        "invalid_json_line",
        "invalid_url",
    ]
    assert scene.validating.status == "validating"


def test_batch_counts_are_the_jobs_while_it_runs_and_its_own_once_final(batch_scene):
    running = batch_scene.running
    counts = batch_counts(running)
    assert (counts.total, counts.completed, counts.failed) == (12, 5, 2)
    assert counts.tokens == running.job.prompt_tokens > 0
    api = batch_object(running)["request_counts"]
    assert api == {"total": 12, "completed": 5, "failed": 2}
    completed = batch_counts(batch_scene.completed)
    assert (completed.total, completed.completed, completed.failed) == (4, 3, 1)
    assert completed.tokens == batch_scene.completed.prompt_tokens > 0


def test_an_operator_cancels_a_running_batch_its_job_history_naming_them(batch_scene):
    running = batch_scene.running
    cancelled = batch_cancel_by_operator(batch=running, actor="root")
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    job = EmbeddingJob.objects.get(pk=running.job_id)
    assert job.status == "cancelling"
    assert ("cancelling", "asked by root") in [
        (event.event, event.detail) for event in job_store(job).events()
    ]
    with pytest.raises(BatchActionRefused, match="is cancelling already: it stops once its running chunks"):
        batch_cancel_by_operator(batch=running, actor="root")


@pytest.mark.parametrize(
    ("which", "refusal"),
    [
        ("completed", "is completed: there is nothing to cancel"),
        ("failed", "is failed: there is nothing to cancel"),
    ],
)
def test_a_finished_batch_is_not_cancelled(batch_scene, which, refusal):
    batch = getattr(batch_scene, which)
    with pytest.raises(BatchActionRefused, match=refusal):
        batch_cancel_by_operator(batch=batch)
    batch_scene.refreshed()
    assert getattr(batch_scene, which).status == which


def test_a_finalizing_batch_says_its_files_are_being_written(batch_scene):
    Batch.objects.filter(pk=batch_scene.running.pk).update(status="finalizing")
    with pytest.raises(BatchActionRefused, match="is finalizing: its job has ended and its output"):
        batch_cancel_by_operator(batch=batch_scene.running)


def test_a_validating_batch_cancelled_ends_before_its_lines_run(batch_scene):
    validating = batch_scene.validating
    assert batch_cancel_by_operator(batch=validating).status == "cancelling"
    batch_validate(batch_id=validating.pk)  # the validation task, arriving after
    validating.refresh_from_db()
    assert validating.status == "cancelled" and validating.job_id is None


def test_files_uses_names_each_batch_and_role_in_one_query(batch_scene, django_assert_num_queries):
    scene = batch_scene
    files = [
        scene.running.input_file,
        scene.completed.input_file,
        scene.completed.output_file,
        scene.completed.error_file,
        scene.lone_file,
    ]
    with django_assert_num_queries(1):
        uses = files_uses(files)
    roles = {file_id: [(use.batch.public_id, use.role) for use in found] for file_id, found in uses.items()}
    completed = scene.completed.public_id
    assert roles == {
        scene.running.input_file_id: [(scene.running.public_id, "input")],
        scene.completed.input_file_id: [(completed, "input")],
        scene.completed.output_file_id: [(completed, "output")],
        scene.completed.error_file_id: [(completed, "error")],
        scene.lone_file.pk: [],
    }
    (output_use,) = uses[scene.completed.output_file_id]
    assert output_use.deletion_effect == (
        "its output_file_id becomes null (its 3 answered lines go with the file)"
    )
    (running_use,) = uses[scene.running.input_file_id]
    assert running_use.deletion_effect.startswith("nothing changes: it has read its lines already")


def test_deleting_an_output_file_keeps_the_batch_without_it(batch_scene, files_dir):
    completed = batch_scene.completed
    output = completed.output_file
    assert (files_dir / output.storage_name).exists()
    (use,) = file_delete_by_operator(stored=output)
    assert (use.batch.pk, use.role) == (completed.pk, "output")
    assert not StoredFile.objects.filter(pk=output.pk).exists()
    assert not (files_dir / output.storage_name).exists()
    completed.refresh_from_db()
    assert completed.status == "completed" and completed.output_file_id is None
    described = batch_object(completed)
    assert (
        described["output_file_id"] is None and described["error_file_id"] == completed.error_file.public_id
    )


def test_deleting_a_validating_batchs_input_file_fails_its_validation(batch_scene):
    validating = batch_scene.validating
    (use,) = file_delete_by_operator(stored=validating.input_file)
    assert use.deletion_effect == "it fails (file_not_found) unless its validation has read the file already"
    batch_validate(batch_id=validating.pk)
    validating.refresh_from_db()
    assert validating.status == "failed"
    assert [error["code"] for error in validating.errors] == ["file_not_found"]
    assert batch_object(validating)["input_file_id"] == validating.input_file_public_id


def test_a_file_deleted_in_a_transaction_keeps_its_bytes_until_it_commits(batch_scene, files_dir):
    """The admin's delete view runs in a transaction: a rollback leaves row and bytes, never a row
    without bytes."""
    stored = batch_scene.lone_file
    on_disk = files_dir / stored.storage_name
    with pytest.raises(RuntimeError), transaction.atomic():
        file_delete(stored=stored)
        assert on_disk.exists()
        raise RuntimeError("the view failed after the deletion")
    assert StoredFile.objects.filter(pk=stored.pk).exists() and on_disk.exists()
    with transaction.atomic():
        file_delete(stored=stored)
        assert on_disk.exists()
    assert not on_disk.exists()


def test_an_expired_or_missing_file_is_not_served(batch_scene, files_dir):
    stored = batch_scene.lone_file
    assert file_download_refusal(stored) is None
    stored.expires_at = timezone.now() + timedelta(hours=1)
    assert file_download_refusal(stored) is None
    in_two_hours = timezone.now() + timedelta(hours=2)
    assert file_download_refusal(stored, now=in_two_hours).startswith("it expired at ")
    files_storage().delete(stored.storage_name)
    assert file_download_refusal(stored) == "its bytes are not in the files storage"
