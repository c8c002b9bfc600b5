"""OpenAI's Batch API on the job engine: a batch's life from its input file to its output files.

batch_create      the input file is the tenant's, purpose `batch`, not too large: a Batch row
                  (validating), and after the commit its validation handed to a worker.
batch_validate    (a Celery task) reads the file a line at a time: each line must be a JSON
                  object with a unique `custom_id`, `method` POST, `url` the batch's endpoint
                  and a valid embeddings request as `body` (its model known and allowed). A bad
                  line becomes an entry of `errors.data` and a line of the error file; the good
                  ones become one EmbeddingJob (embeddings.services.jobs.submission.job_create: quotas
                  reserved, job storage admitted, chunks, fair share, exactly-once), each job
                  input one line (services/openai_api/batch_lines.py). Over BATCH_MAX_REQUESTS lines or
                  BATCH_MAX_INPUTS embedding inputs, no good line, or a quota refusal: the
                  batch fails. Idempotent: the job is created under the batch's id as its
                  idempotency key, so a redelivered validation finds the same job.
the job engine    runs the chunks of the job kind "batch" (BatchJobKind: batch_lines'
                  batch_chunk_embed); when the job ends, the kind hands the batch to
batch_finalize    (a Celery task) writes the output file (the 200 answers) and the error file
                  (everything else, every other custom_id once: refused while validating,
                  answered with an error, failed, cancelled or expired) to the files storage,
                  sets the final status, then deletes the job (its Redis data and held bytes).
                  Idempotent: files are written under new names and the status changes once;
                  a loser deletes what it wrote.
batches_watch     (beat, with the job watchdog) re-sends a validation or finalisation whose
                  worker died, and finalises a batch whose job ended without handing it over.
batches_expire_due (beat) a batch not done within its completion window is stopped: what
                  finished is in the output file, the rest `batch_expired` in the error file.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import secrets
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO

import orjson
from celery import current_app
from django.conf import settings
from django.core.files import File
from django.db import transaction
from django.utils import timezone

from embeddings.contracts.embeddings_request import embeddings_request_parse
from embeddings.errors.service import (
    EmptyFile,
    InvalidRequest,
    LimitExceeded,
    QuotaExceeded,
    StorageBudgetExceeded,
    UnsupportedByModel,
)
from embeddings.models import Batch, EmbeddingJob, EmbeddingModel, StoredFile, Tenant
from embeddings.services.inference.embedding import (
    EmbeddingOptions,
    EmbeddingTarget,
    dimensions_check,
    embedding_model_check,
    output_type_check,
)
from embeddings.services.jobs.engine import job_cancel, job_delete
from embeddings.services.jobs.kinds import ChunkWrite, JobKind, job_cache_scope
from embeddings.services.jobs.reads import job_refreshed
from embeddings.services.jobs.store import JobStore, job_store
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.services.openai_api.batch_lines import (
    LineRequest,
    batch_chunk_embed,
    error_line,
    line_error_render,
    line_output_bytes_estimate,
    line_token_estimate,
)
from embeddings.services.openai_api.files import (
    file_create,
    file_delete,
    file_open,
    files_storage,
    has_a_line,
)
from embeddings.services.pages import creation_page

logger = logging.getLogger(__name__)

Status = Batch.Status
ACTIVE = EmbeddingJob.ACTIVE
ENDPOINTS = ("/v1/embeddings",)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
VALIDATE_TASK = "embeddings.tasks.batch_validate_task"
FINALIZE_TASK = "embeddings.tasks.batch_finalize_task"
PUBLIC_ID_ALPHABET = string.ascii_lowercase + string.digits
# Every id _new_public_id draws: any other string names no batch, and is not looked up (PostgreSQL
# refuses a query with a NUL in it).
BATCH_ID_PATTERN = r"batch_[a-z0-9]{24}"
# errors.data keeps the first this many problems (every one is in the error file).
BATCH_MAX_ERRORS_KEPT = 1000
FINAL = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)
# What batch_cancel stops; a cancelling, finalising or final batch it returns as it is.
CANCELLABLE = (Status.VALIDATING, Status.IN_PROGRESS)


def _new_public_id() -> str:
    return "batch_" + "".join(secrets.choice(PUBLIC_ID_ALPHABET) for _ in range(24))


def _send(task: str, batch: Batch) -> None:
    Batch.objects.filter(pk=batch.pk).update(handed_out_at=timezone.now())
    current_app.send_task(task, args=[batch.pk])


# --- Create, read, cancel --------------------------------------------------------------------------


def batch_create(
    *,
    tenant_id: int,
    api_key_id: int | None,
    input_file: StoredFile,
    endpoint: str,
    completion_window: str,
    metadata: dict | None,
) -> Batch:
    """A new batch of `input_file` (the tenant's, read by the caller through file_for_tenant),
    validating; its validation is handed to a worker after the commit."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequest(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}", param="completion_window"
        )
    if input_file.purpose != StoredFile.Purpose.BATCH:
        raise InvalidRequest(
            f"The file {input_file.public_id!r} has purpose {input_file.purpose!r}; a batch's input "
            "file must have purpose 'batch'.",
            param="input_file_id",
        )
    if input_file.bytes > settings.BATCH_MAX_INPUT_FILE_BYTES:
        raise LimitExceeded(
            f"The input file has {input_file.bytes} bytes; a batch's may have at most "
            f"{settings.BATCH_MAX_INPUT_FILE_BYTES}.",
            param="input_file_id",
        )
    # Uploads without a line are refused, but files stored before that rule may have none.
    try:
        with file_open(input_file) as handle:
            empty = not has_a_line(handle)
    except OSError:  # unreadable: validation fails the batch, saying so (file_unreadable)
        empty = False
    if empty:
        raise EmptyFile(
            f"The input file {input_file.public_id!r} has no lines; a batch runs one request a line.",
            param="input_file_id",
        )
    now = timezone.now()
    batch = Batch(
        public_id=_new_public_id(),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        input_file=input_file,
        input_file_public_id=input_file.public_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=metadata,
        created_at=now,
        expires_at=now + timedelta(seconds=COMPLETION_WINDOWS[completion_window]),
        handed_out_at=now,
    )
    with transaction.atomic():
        batch.save(force_insert=True)
        transaction.on_commit(lambda: current_app.send_task(VALIDATE_TASK, args=[batch.pk]))
    return batch


def batch_for_tenant(*, tenant_id: int, public_id: str) -> Batch | None:
    """The tenant's batch with this id; None for an unknown id or another tenant's batch."""
    if not re.fullmatch(BATCH_ID_PATTERN, public_id):
        return None
    return Batch.objects.select_related("job").filter(tenant_id=tenant_id, public_id=public_id).first()


def batches_for_tenant(*, tenant_id: int, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    """The tenant's batches, newest first, `limit` of them after the batch `after`; has_more."""
    batches = Batch.objects.select_related("job").filter(tenant_id=tenant_id)
    return creation_page(batches, tenant_id=tenant_id, limit=limit, after=after, what="batch")


def batch_cancel(*, batch: Batch, actor: str = "") -> Batch:
    """Stop a batch: cancelling until the chunks in progress end, then cancelled with what finished
    in its output file. A batch that has finished (or is finalising) is returned unchanged. `actor`:
    who asked, when not the batch's client (an operator), for its job's history."""
    now = timezone.now()
    if Batch.objects.filter(pk=batch.pk, status__in=CANCELLABLE).update(
        status=Status.CANCELLING, cancelling_at=now
    ):
        batch.refresh_from_db()
        if batch.job is not None:
            job_cancel(job=batch.job, actor=actor)
    return batch


@dataclass(frozen=True)
class BatchCounts:
    """OpenAI's request_counts (total, completed, failed) and the batch's tokens so far."""

    total: int
    completed: int
    failed: int
    tokens: int


def batch_counts(batch: Batch) -> BatchCounts:
    """The batch's own counts once it is final; before, its job's as its row holds them (the lines
    refused while validating counted failed). Reads no Redis: batch_object refreshes the job first."""
    if batch.status in FINAL or batch.job is None:
        return BatchCounts(batch.total, batch.completed, batch.failed, batch.prompt_tokens)
    job = batch.job
    return BatchCounts(batch.total, job.completed, batch.invalid_lines + job.failed, job.prompt_tokens)


def _timestamp(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_object(batch: Batch) -> dict:
    """The API representation of a batch (OpenAI's Batch), with live counts while its job runs."""
    if batch.status not in FINAL and batch.job is not None:
        job_refreshed(batch.job)  # its counters from the job store, onto batch.job
    counts = batch_counts(batch)
    errors = None
    if batch.errors:
        errors = {"object": "list", "data": batch.errors}
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": errors,
        "input_file_id": batch.input_file_public_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file.public_id if batch.output_file_id else None,
        "error_file_id": batch.error_file.public_id if batch.error_file_id else None,
        "created_at": _timestamp(batch.created_at),
        "in_progress_at": _timestamp(batch.in_progress_at),
        "expires_at": _timestamp(batch.expires_at),
        "finalizing_at": _timestamp(batch.finalizing_at),
        "completed_at": _timestamp(batch.completed_at),
        "failed_at": _timestamp(batch.failed_at),
        "expired_at": _timestamp(batch.expired_at) if batch.status == Status.EXPIRED else None,
        "cancelling_at": _timestamp(batch.cancelling_at),
        "cancelled_at": _timestamp(batch.cancelled_at),
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "usage": {
            "input_tokens": counts.tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.tokens,
        },
        "metadata": batch.metadata,
    }


# --- Validation (a worker) -------------------------------------------------------------------------


class _LineProblem(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.custom_id: str | None = None  # the line's, when it has a usable one


class _Models:
    """The enabled models by name or alias, and whether the batch's tenant may use each."""

    def __init__(self, tenant: Tenant) -> None:
        self.enabled = list(EmbeddingModel.objects.filter(enabled=True))
        self.allow_all = tenant.allow_all_models
        self.allowed = set() if self.allow_all else set(tenant.allowed_models.values_list("pk", flat=True))

    def resolve(self, name: str) -> EmbeddingModel:
        model = next((model for model in self.enabled if model.answers_to(name)), None)
        if model is None:
            raise _LineProblem(
                "model_not_found",
                f"The model {name!r} does not exist or you do not have access to it.",
                "model",
            )
        if not (self.allow_all or model.pk in self.allowed):
            raise _LineProblem("model_not_allowed", f"This API key may not use the model {name!r}.", "model")
        try:
            embedding_model_check(model)
        except UnsupportedByModel as error:
            raise _LineProblem("unsupported_by_model", error.message, "model") from None
        return model


def _lines(handle: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of the file, never holding more than one line's limit at once; an
    overlong line comes back as None (and is refused as too long)."""
    number = 0
    while True:
        raw = handle.readline(max_line_bytes + 2)
        if not raw:
            return
        number += 1
        if len(raw) > max_line_bytes + 1 and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # skip the rest of the overlong line
                raw = handle.readline(1 << 20)
            yield number, None
            continue
        yield number, raw


def _parse_line(raw: bytes | None, *, endpoint: str, models: _Models) -> tuple[LineRequest, EmbeddingModel]:
    if raw is None or len(raw.rstrip(b"\r\n")) > settings.MAX_REQUEST_BODY_BYTES:
        raise _LineProblem(
            "line_too_long", f"The line is longer than {settings.MAX_REQUEST_BODY_BYTES} bytes."
        )
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _LineProblem("invalid_json_line", "The line is not valid JSON.") from None
    if not isinstance(record, dict):
        raise _LineProblem("invalid_json_line", "The line must be a JSON object.")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineProblem("missing_custom_id", "custom_id must be a non-empty string.", "custom_id")
    if len(custom_id) > 512:
        raise _LineProblem("invalid_custom_id", "custom_id may have at most 512 characters.", "custom_id")
    try:
        return _parse_request(
            record,
            endpoint=endpoint,
            models=models,
            custom_id=custom_id,
        )
    except _LineProblem as problem:
        problem.custom_id = custom_id
        raise


def _parse_request(
    record: dict,
    *,
    endpoint: str,
    models: _Models,
    custom_id: str,
) -> tuple[LineRequest, EmbeddingModel]:
    if record.get("method") != "POST":
        raise _LineProblem("invalid_method", "method must be 'POST'.", "method")
    if record.get("url") != endpoint:
        raise _LineProblem(
            "invalid_url",
            f"url must be this batch's endpoint {endpoint!r}, got {record.get('url')!r}.",
            "url",
        )
    body = record.get("body")
    if not isinstance(body, dict):
        raise _LineProblem("invalid_body", "body must be a JSON object (an embeddings request).", "body")
    try:
        request = embeddings_request_parse(body)
        if request["long_inputs"] == "chunk":
            raise _LineProblem(
                "invalid_value",
                "long_inputs 'chunk' is not available in batches (only on POST /v1/embeddings); "
                "truncate or refuse long inputs here.",
                "body.long_inputs",
            )
        model = models.resolve(request["model"])
        dimensions_check(dimensions=request.get("dimensions"), model_dimensions=model.dimensions)
        if request["output_type"] != "float":
            # A type the model cannot give is refused now, as POST /v1/embeddings refuses it.
            options = EmbeddingOptions(
                dimensions=request.get("dimensions"), output_type=request["output_type"]
            )
            output_type_check(EmbeddingTarget.for_model(model), options)
    except _LineProblem:
        raise
    except Exception as error:  # what the synchronous API would refuse this body with
        _, answer = line_error_render(error)
        detail = answer.get("error", {})
        raise _LineProblem(
            detail.get("code") or "invalid_request", detail.get("message") or str(error), detail.get("param")
        ) from None
    line = LineRequest(
        custom_id=custom_id,
        model=model.name,
        texts=request.get("texts"),
        token_ids=request.get("token_ids"),
        dimensions=request.get("dimensions"),
        encoding_format=request["encoding_format"],
        output_type=request["output_type"],
        input_type=request.get("input_type"),
    )
    return line, model


def _invalid_name(batch: Batch) -> str:
    return f"tenant-{batch.tenant_id}/{batch.public_id}.invalid.jsonl"


def _fail(batch: Batch, errors: list[dict]) -> None:
    Batch.objects.filter(pk=batch.pk, status__in=(Status.VALIDATING, Status.CANCELLING)).update(
        status=Status.FAILED, failed_at=timezone.now(), errors=errors[:BATCH_MAX_ERRORS_KEPT]
    )


def _refusal(code: str, message: str) -> dict:
    return {"code": code, "message": _storable(message), "param": None, "line": None}


def _storable(text: str | None) -> str | None:
    """Text a tenant's line may have put in an error message, as PostgreSQL's JSONB stores it
    (which refuses NUL)."""
    return None if text is None else text.replace("\x00", "\\u0000")


def batch_validate(*, batch_id: int) -> None:
    """Validate a batch's lines and start its job (see the module docstring)."""
    batch = Batch.objects.select_related("input_file", "tenant").filter(pk=batch_id).first()
    if (
        batch is None
        or batch.job_id is not None
        or batch.status not in (Status.VALIDATING, Status.CANCELLING)
    ):
        return
    if batch.status == Status.CANCELLING:
        Batch.objects.filter(pk=batch.pk, status=Status.CANCELLING).update(
            status=Status.CANCELLED, cancelled_at=timezone.now()
        )
        return
    if batch.input_file is None:
        _fail(
            batch, [_refusal("file_not_found", f"The input file {batch.input_file_public_id!r} was deleted.")]
        )
        return
    models = _Models(batch.tenant)
    lines: list[LineRequest] = []
    line_models: dict[str, EmbeddingModel] = {}
    tokens = output_bytes = inputs = 0
    seen: set[str] = set()
    errors: list[dict] = []
    try:
        handle = file_open(batch.input_file)
    except OSError as error:  # deleted from the storage under its row, or the storage unreadable
        logger.warning("batch %s: input file unreadable: %s", batch.public_id, error)
        _fail(batch, [_refusal("file_unreadable", "The input file could not be read; upload it again.")])
        return
    invalid = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    try:
        with handle:
            for number, raw in _lines(handle, settings.MAX_REQUEST_BODY_BYTES):
                if raw is not None and not raw.strip():
                    continue
                if len(lines) + len(errors) >= settings.BATCH_MAX_REQUESTS:
                    message = f"The batch has more than {settings.BATCH_MAX_REQUESTS} requests."
                    _fail(batch, [_refusal("too_many_requests", message)])
                    return
                try:
                    line, model = _parse_line(
                        raw,
                        endpoint=batch.endpoint,
                        models=models,
                    )
                    if line.custom_id in seen:
                        problem = _LineProblem(
                            "duplicate_custom_id", f"custom_id {line.custom_id!r} appears twice.", "custom_id"
                        )
                        problem.custom_id = line.custom_id
                        raise problem
                except _LineProblem as problem:
                    errors.append(
                        {
                            "code": _storable(problem.code),
                            "message": _storable(problem.message),
                            "param": _storable(problem.param),
                            "line": number,
                        }
                    )
                    invalid.write(
                        error_line(problem.custom_id, problem.code, f"line {number}: {problem.message}")
                    )
                    continue
                seen.add(line.custom_id)
                lines.append(line)
                line_models[line.model] = model
                inputs += line.inputs
                tokens += line_token_estimate(line, model)
                output_bytes += line_output_bytes_estimate(line, model)
        if inputs > settings.BATCH_MAX_INPUTS:
            limit = settings.BATCH_MAX_INPUTS
            message = f"The batch has {inputs} embedding inputs; a batch may have at most {limit}."
            _fail(batch, [_refusal("too_many_inputs", message)])
            return
        if not lines:
            _fail(batch, errors or [_refusal("empty_file", "The input file has no requests.")])
            return
        if errors:
            invalid.seek(0)
            files_storage().save(_invalid_name(batch), File(invalid))
        _start(
            batch,
            lines,
            line_models,
            tokens=tokens,
            output_bytes=output_bytes,
            inputs=inputs,
            errors=errors,
        )
    finally:
        invalid.close()


def _start(
    batch: Batch,
    lines: list[LineRequest],
    line_models: dict[str, EmbeddingModel],
    *,
    tokens: int,
    output_bytes: int,
    inputs: int,
    errors: list[dict],
) -> None:
    # Chunks of about JOB_CHUNK_SIZE embedding inputs, whatever each line holds.
    lines_per_chunk = max(1, math.floor(settings.JOB_CHUNK_SIZE * len(lines) / max(1, inputs)))
    first_model = line_models[lines[0].model]
    spec = JobSpec(
        kind=BATCH_JOB_KIND.name,
        model=first_model,
        texts=[line.encode() for line in lines],
        ids=[line.custom_id for line in lines],
        token_estimate=tokens,
        chunk_size=lines_per_chunk,
        result_bytes_per_input=math.ceil(output_bytes / len(lines)),
    )
    try:
        job, _ = job_create(
            tenant_id=batch.tenant_id,
            api_key_id=batch.api_key_id,
            spec=spec,
            idempotency_key=batch.public_id,
            fingerprint=batch.public_id,
        )
    except (QuotaExceeded, StorageBudgetExceeded, LimitExceeded, InvalidRequest) as error:
        # Refused as a job submission would be (a quota, the job storage budget): the batch fails.
        detail = line_error_render(error)[1].get("error", {})
        _fail(batch, [_refusal(detail.get("code") or "invalid_request", detail.get("message") or str(error))])
        return
    now = timezone.now()
    started = Batch.objects.filter(pk=batch.pk, status=Status.VALIDATING).update(
        job=job,
        status=Status.IN_PROGRESS,
        in_progress_at=now,
        total=len(lines) + len(errors),
        invalid_lines=len(errors),
        errors=errors[:BATCH_MAX_ERRORS_KEPT],
        model=first_model.name,
    )
    if not started:  # cancelled while validating: the job stops too
        Batch.objects.filter(pk=batch.pk).update(
            job=job, in_progress_at=now, total=len(lines) + len(errors), invalid_lines=len(errors),
            errors=errors[:BATCH_MAX_ERRORS_KEPT], model=first_model.name,
        )  # fmt: skip
        job_cancel(job=job)


# --- Finalisation (a worker) -----------------------------------------------------------------------


class BatchJobKind(JobKind):
    """A batch's job on the engine: each input is one request line (LineRequest), a chunk's lines
    become OpenAI output lines, and the ended job hands its batch over to be finalised."""

    name = "batch"
    # A batch's lines count under its own endpoint, failed chunks included.
    usage_endpoint = "batches"
    # A batch ends with its output and error files written: its lines are not run again.
    chunks_retryable = False

    def chunk_embed(self, job: EmbeddingJob, texts: list[str]) -> ChunkWrite:
        lines = [LineRequest.decode(text) for text in texts]
        names = {line.model for line in lines}
        models = {model.name: model for model in EmbeddingModel.objects.filter(name__in=names)}
        output = batch_chunk_embed(
            lines=lines,
            models=models,
            tenant_id=job.tenant_id,
            api_key_id=job.api_key_id,
            cache_scope=functools.partial(job_cache_scope, job),
        )

        def write(store: JobStore, chunk: int) -> None:
            store.finish_chunk_lines(
                chunk,
                output.payload,
                rows=output.succeeded,
                tokens=output.tokens,
                cached_tokens=output.cached_tokens,
                usage=output.usage,
            )

        return write

    def ended(self, job: EmbeddingJob) -> None:
        """Its batch's output files are written next (batch_finalize); the batch watchdog hands it
        over if this message is lost."""
        batch = Batch.objects.filter(job_id=job.pk).only("pk").first()
        if batch is None:
            return
        try:
            _send(FINALIZE_TASK, batch)
        except Exception as error:  # the batch watchdog sends it again
            logger.warning("could not enqueue the finalisation of job %s's batch: %s", job.public_id, error)


# settings.JOB_KINDS names it.
BATCH_JOB_KIND = BatchJobKind()


def _unfinished_code(batch: Batch) -> tuple[str, str]:
    if batch.expired_at is not None:
        return "batch_expired", "The batch expired before this request was run."
    return "batch_cancelled", "The batch was cancelled before this request was run."


def _write_lines(batch: Batch, job: EmbeddingJob, output: IO[bytes], error: IO[bytes]) -> tuple[int, int]:
    """Every line of the batch into the output file (200 answers) or the error file; (succeeded, failed)."""
    succeeded = failed = 0
    storage = files_storage()
    if batch.invalid_lines and storage.exists(_invalid_name(batch)):
        with storage.open(_invalid_name(batch), "rb") as invalid:
            while piece := invalid.read(1 << 20):
                error.write(piece)
        failed += batch.invalid_lines
    store = job_store(job)
    unfinished = _unfinished_code(batch)
    chunk_failed = (
        job.error_code or "embedding_failed",
        job.error_message or "The request could not be run.",
    )
    for chunk in range(job.chunks):
        payload = store.chunk_lines(chunk)
        if payload is not None:
            for raw in payload.splitlines(keepends=True):
                if orjson.loads(raw)["response"]["status_code"] == 200:
                    output.write(raw)
                    succeeded += 1
                else:
                    error.write(raw)
                    failed += 1
            continue
        code, message = chunk_failed if store.is_chunk_done(chunk) else unfinished
        for custom_id in store.chunk_ids(chunk) or []:
            error.write(error_line(custom_id, code, message))
            failed += 1
    return succeeded, failed


def _stored(batch: Batch, content: IO[bytes], suffix: str) -> StoredFile | None:
    if content.tell() == 0:
        return None
    content.seek(0)
    return file_create(
        tenant_id=batch.tenant_id,
        purpose=StoredFile.Purpose.BATCH_OUTPUT,
        filename=f"{batch.public_id}_{suffix}.jsonl",
        content=content,
        expires_at=timezone.now() + timedelta(seconds=settings.BATCH_OUTPUT_TTL_S),
    )


def batch_finalize(*, batch_id: int) -> None:
    """Write a batch's output and error files once its job has ended, and give it its final status."""
    batch = Batch.objects.select_related("job").filter(pk=batch_id).first()
    if batch is None or batch.status in FINAL or batch.status == Status.VALIDATING:
        return
    job = batch.job
    if job is None:  # its job was deleted under it (an operator): nothing is left to write
        message = "The batch's job was deleted before it finished."
        Batch.objects.filter(pk=batch.pk).exclude(status__in=FINAL).update(
            status=Status.FAILED, failed_at=timezone.now(), errors=[_refusal("batch_job_lost", message)]
        )
        return
    if job.status in ACTIVE:
        return  # its job_finalize hands the batch over again
    now = timezone.now()
    Batch.objects.filter(pk=batch.pk, status__in=(Status.IN_PROGRESS, Status.CANCELLING)).update(
        status=Status.FINALIZING, finalizing_at=now, handed_out_at=now
    )
    batch.refresh_from_db()
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as error:
        succeeded, failed = _write_lines(batch, job, output, error)
        output_file, error_file = _stored(batch, output, "output"), _stored(batch, error, "error")
    if batch.expired_at is not None:
        status, moment = Status.EXPIRED, {"expired_at": batch.expired_at}
    elif batch.cancelling_at is not None:
        status, moment = Status.CANCELLED, {"cancelled_at": timezone.now()}
    else:
        status, moment = Status.COMPLETED, {"completed_at": timezone.now()}
    won = Batch.objects.filter(pk=batch.pk, status=Status.FINALIZING).update(
        status=status,
        output_file=output_file,
        error_file=error_file,
        completed=succeeded,
        failed=failed,
        prompt_tokens=job.prompt_tokens,
        **moment,
    )
    if not won:  # another finaliser got there first: its files stand
        for stored in (output_file, error_file):
            if stored is not None:
                file_delete(stored=stored)
        return
    # The lines are in the files now: the job's Redis data and held bytes go.
    job_delete(job=job)
    files_storage().delete(_invalid_name(batch))


# --- Expiry and the watchdog (beat) ----------------------------------------------------------------


def batches_expire_due(*, now: datetime | None = None) -> int:
    """Stop the batches past their completion window; how many."""
    now = now or timezone.now()
    expired = 0
    for batch in Batch.objects.select_related("job").filter(
        expires_at__lte=now, expired_at__isnull=True, status__in=(Status.VALIDATING, Status.IN_PROGRESS)
    ):
        Batch.objects.filter(pk=batch.pk).update(expired_at=now)
        if batch.job is None:
            Batch.objects.filter(pk=batch.pk, status=Status.VALIDATING).update(status=Status.EXPIRED)
        else:
            job_cancel(job=batch.job)
        expired += 1
    return expired


def batches_watch(*, stall_s: float | None = None) -> int:
    """Re-send the validations and finalisations whose worker died (their batch has not moved for
    BATCH_STALL_S), and finalise the batches whose job ended without handing them over."""
    stall_s = settings.BATCH_STALL_S if stall_s is None else stall_s
    stale = timezone.now() - timedelta(seconds=stall_s)
    touched = 0
    for batch in Batch.objects.select_related("job").exclude(status__in=FINAL):
        if batch.handed_out_at is not None and batch.handed_out_at > stale:
            continue
        if batch.status == Status.VALIDATING or (batch.status == Status.CANCELLING and batch.job is None):
            _send("embeddings.tasks.batch_validate_task", batch)
        elif batch.job is None or batch.job.status not in ACTIVE:
            _send(FINALIZE_TASK, batch)
        else:
            continue
        touched += 1
    return touched
