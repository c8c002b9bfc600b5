"""/v1/jobs: submit an asynchronous embedding job, follow it, cancel or delete it, download its results.

Thin views over the job engine (embeddings/services/jobs/), whose functions are synchronous
(database and blocking Redis): each request calls them in one `sync_to_async` hop. Downloads
stream chunk by chunk, each chunk's Redis read in a worker thread, so a million-vector download
holds one chunk in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiRequest,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import model_for_request
from embeddings.api.base import ApiView, list_page
from embeddings.api.docs import (
    AUTH_ERRORS,
    ERRORS,
    EXAMPLE_VECTOR,
    EmbeddingVectorField,
    ListPageSerializer,
    error_response,
)
from embeddings.api.forms import form_fields
from embeddings.api.rendering import MultipartUploadParser, OrjsonParser, in_threads, refuse_non_utf8
from embeddings.callers import Caller
from embeddings.contracts.embeddings_request import (
    TEXT_SCHEMA,
    StringListField,
    input_type_field,
    output_type_field,
)
from embeddings.contracts.fields import (
    INT32_MAX,
    MetadataField,
    QueryIntegerField,
    StrictBooleanField,
    StrictCharField,
    cursor_field,
    dimensions_field,
    id_schema,
    validated,
)
from embeddings.errors.answers import (
    IdempotencyKeyReused,
    InsufficientQuota,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    UnsupportedMediaType,
    ValidationFailed,
)
from embeddings.errors.service import (
    JobExpired,
    JobNotFinished,
    JobQueueUnavailable,
    JobStoreUnavailable,
    QuotaUnavailable,
)
from embeddings.model_tasks import OUTPUT_TYPES
from embeddings.models import EmbeddingJob, EmbeddingModel
from embeddings.result_dtypes import RESULT_DTYPES
from embeddings.services.jobs.callback_targets import CallbackTargetError
from embeddings.services.jobs.callbacks import callback_target_check
from embeddings.services.jobs.engine import job_cancel, job_delete
from embeddings.services.jobs.inputs import (
    JobInputs,
    job_inputs_count_check,
    job_inputs_parse,
    job_max_inputs,
)
from embeddings.services.jobs.reads import (
    JOB_ID_PATTERN,
    job_for_tenant,
    job_object,
    job_refreshed,
    job_results_download,
    jobs_for_tenant,
)
from embeddings.services.jobs.results import iter_jsonl, iter_npy, json_page, npy_size
from embeddings.services.jobs.submission import JobSpec, job_create

IDEMPOTENCY_KEY_MAX_CHARS = 255
# Content types of an uploaded file: text, JSON lines, or unlabelled bytes (curl sends a .jsonl
# file as application/octet-stream).
TEXT_UPLOAD_TYPES = {"text/plain", "application/octet-stream", ""}
JSONL_UPLOAD_TYPES = {
    "application/jsonl",
    "application/x-jsonl",
    "application/jsonlines",
    "application/x-jsonlines",
    "application/json-lines",
    "application/x-ndjson",
    "application/ndjson",
}


# As documented: text first, then JSON lines, then unlabelled bytes.
UPLOAD_CONTENT_TYPES = ("text/plain", *sorted(JSONL_UPLOAD_TYPES), "application/octet-stream")


# --- Request and response shapes -------------------------------------------------------------------


@extend_schema_field(
    {
        "type": "array",
        "items": TEXT_SCHEMA,
        "minItems": 1,
        "description": "The texts to embed, one vector each, in this order.",
        "example": ["The first document.", "The second document."],
    }
)
class JobTextsField(StringListField):
    pass


def callback_url_deliverable(url: str) -> None:
    """Refuse a callback_url the address policy refuses now (its host is resolved here: call from
    a thread, not the event loop)."""
    try:
        callback_target_check(url=url)
    except CallbackTargetError as error:
        raise serializers.ValidationError(error.reason) from error


class JobOptions(serializers.Serializer):
    """What a job asks for besides its inputs (JSON body fields, or multipart form fields)."""

    model = StrictCharField(lookup=True, help_text="A model id from GET /v1/models (or one of its aliases).")
    encoding_format = serializers.ChoiceField(
        choices=["float", "base64"],
        default="float",
        help_text="How `json` and `jsonl` results encode vectors (a download may ask for the other).",
    )
    dimensions = dimensions_field()
    normalize = StrictBooleanField(default=True, help_text="Unit-length vectors.")
    result_dtype = serializers.ChoiceField(
        choices=list(RESULT_DTYPES),
        required=False,
        allow_null=True,
        help_text="How the results are stored while they wait for download: `float16` takes half the "
        "memory, each value within 2^-11 of float32 relative to it (cosine to float32 above 0.9999). "
        "Downloads are float32 either way. Default: the model's setting (float32 unless set). "
        "For float results only: a quantised `output_dtype` is stored in its own type.",
    )
    output_dtype = output_type_field()
    input_type = input_type_field()
    metadata = MetadataField(required=False)
    callback_url = serializers.URLField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        max_length=2000,
        # The policy first, so its reason is the message; URLField's own check still follows.
        validators=[callback_url_deliverable],
        help_text="POSTed the job when it finishes, signed (HMAC-SHA256) in the Embedsite-Signature header. "
        "http or https, to a public address: a host that does not resolve, or resolves to a loopback, "
        "private, link-local or other non-public address, is refused.",
    )


class JobCreateRequest(JobOptions):
    input = JobTextsField()


class JobUploadRequest(JobOptions):
    """The multipart form: the file and the same options as form fields (metadata as a JSON object)."""

    file = serializers.FileField(
        help_text="UTF-8 text, one input per line (blank lines skipped), or JSONL: one "
        '`{"id": ..., "text": ...}` object a line, ids kept in the results. Content type text/plain, '
        "application/jsonl (or x-ndjson) or application/octet-stream."
    )


class JobListQuery(serializers.Serializer):
    limit = QueryIntegerField(min_value=1, max_value=100, default=20, help_text="1 to 100.")
    after = cursor_field(pattern=JOB_ID_PATTERN, what="a job id (`job_` and 24 lowercase letters or digits)")


# Past the last input of any job.
RESULTS_MAX_OFFSET = INT32_MAX


class JobResultsQuery(serializers.Serializer):
    format = serializers.ChoiceField(
        choices=["jsonl", "json", "npy"],
        default="jsonl",
        help_text="`jsonl`: one object a line, streamed; `npy`: one array, streamed: float32 (rows of "
        "failed inputs NaN), or the job's quantised `output_dtype` (int8/uint8 [n, d], binary/ubinary "
        "[n, d/8]; rows of failed inputs zeros); `json`: one page (`offset`, `limit`).",
    )
    encoding_format = serializers.ChoiceField(
        choices=["float", "base64"], required=False, help_text="Default: the job's encoding_format."
    )
    offset = QueryIntegerField(
        min_value=0,
        max_value=RESULTS_MAX_OFFSET,
        default=0,
        help_text="`json` only: the first input (past the last one: an empty page).",
    )
    limit = QueryIntegerField(
        min_value=1, max_value=1000, default=100, help_text="`json` only: inputs per page, 1 to 1000."
    )


class JobCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class JobPromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField(help_text="Of prompt_tokens, those the embedding cache answered")


class JobUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    prompt_tokens_details = JobPromptTokensDetailsSerializer()


class JobErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class JobObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="embedding.job")
    status = serializers.ChoiceField(
        choices=["queued", "running", "completed", "failed", "cancelling", "cancelled", "expired"]
    )
    model = serializers.CharField()
    counts = JobCountsSerializer()
    usage = JobUsageSerializer()
    created_at = serializers.IntegerField(help_text="Unix seconds")
    started_at = serializers.IntegerField(allow_null=True)
    finished_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField(allow_null=True, help_text="When the results are removed")
    error = JobErrorSerializer(allow_null=True)
    metadata = serializers.DictField(child=serializers.CharField())
    encoding_format = serializers.CharField()
    dimensions = serializers.IntegerField(allow_null=True)
    result_dtype = serializers.ChoiceField(
        choices=list(RESULT_DTYPES),
        help_text="How float results are stored; their downloads are float32",
    )
    output_dtype = serializers.ChoiceField(
        choices=list(OUTPUT_TYPES),
        help_text="The vectors' type: float, or int8/uint8/binary/ubinary, stored and downloaded in it",
    )
    input_type = serializers.CharField(allow_null=True, help_text="What the inputs are for, as asked")


class JobListSerializer(ListPageSerializer):
    data = JobObjectSerializer(many=True)


class JobDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="embedding.job.deleted")
    deleted = serializers.BooleanField()


class JobResultObjectSerializer(serializers.Serializer):
    object = serializers.CharField(default="embedding")
    index = serializers.IntegerField()
    id = serializers.CharField(required=False, help_text="The upload's id for this input (JSONL uploads)")
    embedding = EmbeddingVectorField(allow_null=True, help_text="Null when the input's chunk failed")
    error = JobErrorSerializer(required=False)


class JobResultsPageSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = JobResultObjectSerializer(many=True)
    model = serializers.CharField()
    offset = serializers.IntegerField()
    total = serializers.IntegerField()
    has_more = serializers.BooleanField()


def job_location(job: EmbeddingJob) -> str:
    return f"/v1/jobs/{job.public_id}"


def request_fingerprint(model: EmbeddingModel, options: dict, inputs: JobInputs) -> str:
    """SHA-256 of the request in a canonical form: the resolved model, every option and the inputs.

    The same texts sent as JSON or uploaded as a file give the same fingerprint.
    """
    canonical = {
        "model": model.name,
        "encoding_format": options["encoding_format"],
        "dimensions": options.get("dimensions"),
        "normalize": options["normalize"],
        "metadata": options.get("metadata") or {},
        "callback_url": options.get("callback_url") or "",
    }
    # Only when asked for: fingerprints of requests without them stay as they were.
    if options.get("result_dtype"):
        canonical["result_dtype"] = options["result_dtype"]
    if options.get("output_dtype", "float") != "float":
        canonical["output_dtype"] = options["output_dtype"]
    if options.get("input_type"):
        canonical["input_type"] = options["input_type"]
    digest = hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS))
    digest.update(orjson.dumps(inputs.texts))
    digest.update(orjson.dumps(inputs.ids))
    return digest.hexdigest()


def idempotency_key(request: Request) -> str:
    key = request.headers.get("Idempotency-Key", "")
    # Measured as sent, as the schema's maxLength measures it.
    if len(key) > IDEMPOTENCY_KEY_MAX_CHARS:
        raise ValidationFailed(
            f"Idempotency-Key: at most {IDEMPOTENCY_KEY_MAX_CHARS} characters", param="Idempotency-Key"
        )
    return key.strip()


# The job options whose schema allows null.
FORM_NULLABLE_FIELDS = tuple(name for name, field in JobOptions().fields.items() if field.allow_null)


def _upload_lines(upload: UploadedFile) -> Iterator[bytes]:
    upload.seek(0)
    # The underlying file splits on b"\n" only (UploadedFile's own iterator also splits on "\r").
    return iter(upload.file)


def upload_parse(request: Request, caller: Caller) -> tuple[dict, JobInputs]:
    """The options and inputs of a multipart upload (sync: it reads the spooled body and the file).

    The upload's size was enforced while the body arrived (embeddings/api/intake.py).
    """
    fields = form_fields(request.data, known=JobUploadRequest().fields)
    upload = fields.pop("file", None)
    if not isinstance(upload, UploadedFile):
        raise ValidationFailed("file: a multipart upload needs a `file` part", param="file")
    limit = settings.JOB_MAX_UPLOAD_BYTES
    if upload.size > limit:
        raise PayloadTooLarge(f"The file is larger than {limit} bytes.", param="file")
    content_type = (upload.content_type or "").strip().lower()
    if content_type not in TEXT_UPLOAD_TYPES | JSONL_UPLOAD_TYPES:
        raise UnsupportedMediaType(
            f"file: content type {content_type!r} is not text/plain or JSONL (application/jsonl)",
            param="file",
        )
    refuse_non_utf8(upload.charset, what="file: the file", param="file")
    if isinstance(fields.get("metadata"), str):
        try:
            fields["metadata"] = orjson.loads(fields["metadata"])
        except orjson.JSONDecodeError:
            raise ValidationFailed("metadata: must be a JSON object", param="metadata") from None
    # A form cannot send JSON null: an empty or `null` field of those that may be null means none.
    for name in FORM_NULLABLE_FIELDS:
        if fields.get(name) in ("", "null"):
            fields[name] = None
    options = validated(JobOptions, fields, form=True)
    inputs = job_inputs_parse(
        _upload_lines(upload),
        max_inputs=job_max_inputs(caller)[0],
        max_line_bytes=settings.JOB_MAX_LINE_BYTES,
        jsonl=True if content_type in JSONL_UPLOAD_TYPES else None,
    )
    return options, inputs


@sync_to_async
def _create(
    *, caller: Caller, spec: JobSpec, idempotency_key: str, fingerprint: str
) -> tuple[dict, bool, str]:
    job, created = job_create(
        tenant_id=caller.tenant_id,
        api_key_id=caller.key_id,
        spec=spec,
        idempotency_key=idempotency_key,
        fingerprint=fingerprint,
    )
    return job_object(job), created, job_location(job)


def _tenant_job(caller: Caller, job_id: str) -> EmbeddingJob:
    job = job_for_tenant(tenant_id=caller.tenant_id, public_id=job_id)
    if job is None:
        raise NotFound(f"You have no job {job_id!r}.", param="job_id", code="job_not_found")
    return job


@sync_to_async
def _job_read(caller: Caller, job_id: str) -> dict:
    return job_object(job_refreshed(_tenant_job(caller, job_id)))


@sync_to_async
def _job_list(caller: Caller, limit: int, after: str | None) -> tuple[list[dict], bool]:
    jobs, has_more = jobs_for_tenant(tenant_id=caller.tenant_id, limit=limit, after=after)
    return [job_object(job) for job in jobs], has_more


@sync_to_async
def _job_cancel(caller: Caller, job_id: str) -> dict:
    job = _tenant_job(caller, job_id)
    job_cancel(job=job)
    return job_object(job_refreshed(job))


@sync_to_async
def _job_delete(caller: Caller, job_id: str) -> str:
    job = _tenant_job(caller, job_id)
    job_delete(job=job)
    return job.public_id


@sync_to_async
def _finished_job(caller: Caller, job_id: str) -> tuple[EmbeddingJob, str, tuple]:
    """The job, its model's name and where its results are, if they can be downloaded."""
    job = job_refreshed(_tenant_job(caller, job_id))
    return job, job.model.name, job_results_download(job)


JOB_EXAMPLE = {
    "id": "job_6f1c2d9a8b7e4f30a1b2c3d4",
    "object": "embedding.job",
    "status": "running",
    "model": "all-MiniLM-L6-v2",
    "counts": {"total": 100000, "completed": 25600, "failed": 0},
    "usage": {"prompt_tokens": 312000, "prompt_tokens_details": {"cached_tokens": 41000}},
    "created_at": 1767225600,
    "started_at": 1767225601,
    "finished_at": None,
    "expires_at": 1767830400,
    "error": None,
    "metadata": {"corpus": "wiki-2026-11"},
    "encoding_format": "float",
    "dimensions": None,
    "result_dtype": "float32",
    "output_dtype": "float",
    "input_type": None,
}
JOB_ID_PARAMETER = OpenApiParameter(
    "job_id",
    id_schema(JOB_ID_PATTERN),
    OpenApiParameter.PATH,
    description="The job's id (any other string is no job: 404).",
)
JOB_NOT_FOUND = error_response(
    "No job of yours has this id (another tenant's job is not found either)",
    NotFound("You have no job 'job_0123'.", param="job_id", code="job_not_found"),
)
JOB_RESPONSE_EXAMPLE = OpenApiExample(
    "A running job", value=JOB_EXAMPLE, response_only=True, status_codes=["200"]
)


class JobListCreateView(ApiView):
    endpoint = "jobs"
    parser_classes = [OrjsonParser, MultipartUploadParser]

    @extend_schema(
        operation_id="create_job",
        summary="Submit an embedding job",
        description=(
            "A JSON body with `input` (an array of texts), or a multipart/form-data upload with a "
            '`file` part (one text a line, or JSONL `{"id", "text"}` lines whose ids come back '
            "with the results) and the options as form fields (`metadata` as a JSON object). "
            "Tokens for the whole job are reserved against your quotas now, and the bytes it will hold "
            "(inputs, and inputs x the bytes of one stored vector: dimensions x 4 for float32, x 2 "
            "for float16, x 1 for int8/uint8, / 8 for binary/ubinary) against your job storage budget. "
            "An `Idempotency-Key` header makes retries safe: the same key with the same request "
            "answers the job it created (200), with another request 409."
        ),
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                {"type": "string", "maxLength": IDEMPOTENCY_KEY_MAX_CHARS},
                OpenApiParameter.HEADER,
                description=f"Up to {IDEMPOTENCY_KEY_MAX_CHARS} characters of your choice, unique per job.",
            )
        ],
        request={
            "application/json": JobCreateRequest,
            "multipart/form-data": OpenApiRequest(
                JobUploadRequest, encoding={"file": {"contentType": ", ".join(UPLOAD_CONTENT_TYPES)}}
            ),
        },
        responses={
            202: OpenApiResponse(JobObjectSerializer, description="Created; `Location` is the job's URL."),
            200: OpenApiResponse(
                JobObjectSerializer,
                description="An Idempotency-Key already used with this same request: the job it created.",
            ),
            400: ERRORS[400],
            **AUTH_ERRORS,
            404: ERRORS[404],
            409: error_response(
                "The Idempotency-Key was used with a different request", IdempotencyKeyReused()
            ),
            413: error_response(
                "More inputs than your max per job, a line or the upload too long, or a job larger than "
                "your whole job storage budget (job_storage_budget_exceeded)",
                PayloadTooLarge("more than 1000000 inputs (at line 1000001)", param="file"),
            ),
            415: error_response(
                "A body that is neither JSON nor multipart, or a file neither text nor JSONL",
                UnsupportedMediaType(
                    "file: content type 'image/png' is not text/plain or JSONL (application/jsonl)",
                    param="file",
                ),
            ),
            422: error_response(
                "Invalid fields (a refused `callback_url` among them), a form field sent twice, or a file "
                "that cannot be read (not UTF-8, empty, a bad JSONL line)",
                ValidationFailed("line 3: not UTF-8 (byte 7)", param="file"),
                ValidationFailed("metadata: may have at most 16 pairs", param="metadata"),
            ),
            429: error_response(
                "The job's tokens do not fit your budget, its bytes do not fit what your job storage "
                "budget has free (job_storage_budget_exceeded), or too many jobs running at once",
                InsufficientQuota(
                    "You exceeded this tenant's quota of tokens per month: limit 1000000, used 990000, "
                    "requested 312000. It resets in 190h0m0s."
                ),
                RateLimited(
                    "This tenant already runs 2 jobs, its max_concurrent_jobs.", limit_type="requests"
                ),
            ),
            503: error_response(
                "Not submitted, nothing kept: quotas cannot be checked (Redis down), the job queue "
                "refused it, or the job store is full or down. Retry after the Retry-After header's seconds.",
                QuotaUnavailable(
                    "Rate limiting is unavailable, so the request was not served; retry shortly."
                ),
                JobQueueUnavailable(
                    "The job queue is unavailable, so the job was not submitted; retry shortly."
                ),
                JobStoreUnavailable("The job store is full, so the job was not submitted; retry later."),
            ),
        },
        examples=[
            OpenApiExample(
                "Two texts",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "input": ["The first document.", "The second document."],
                    "metadata": {"corpus": "wiki-2026-11"},
                },
                request_only=True,
                media_type="application/json",
            ),
            OpenApiExample(
                "A text file, one input a line",
                value={"model": "all-MiniLM-L6-v2", "file": "The first document.\nThe second document.\n"},
                request_only=True,
                media_type="multipart/form-data",
            ),
            OpenApiExample(
                "Queued",
                value={
                    **JOB_EXAMPLE,
                    "status": "queued",
                    "counts": {"total": 2, "completed": 0, "failed": 0},
                    "usage": {"prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}},
                    "started_at": None,
                },
                response_only=True,
                status_codes=["202"],
            ),
        ],
        tags=["jobs"],
    )
    async def post(self, request: Request) -> Response:
        caller: Caller = request.user
        key = idempotency_key(request)
        if request.content_type.startswith("multipart/form-data"):
            options, inputs = await sync_to_async(upload_parse)(request, caller)
        else:
            # In a thread: validating callback_url resolves its host (a blocking lookup).
            options = await sync_to_async(validated)(JobCreateRequest, request.data)
            inputs = JobInputs(texts=options.pop("input"), ids=None)
            job_inputs_count_check(count=len(inputs.texts), caller=caller)
        model = await model_for_request(self, options["model"])
        spec = JobSpec(
            model=model,
            texts=inputs.texts,
            ids=inputs.ids,
            encoding_format=options["encoding_format"],
            dimensions=options.get("dimensions"),
            normalize=options["normalize"],
            metadata=options.get("metadata") or {},
            callback_url=options.get("callback_url") or "",
            result_dtype=options.get("result_dtype"),
            output_type=options["output_dtype"],
            input_type=options.get("input_type") or None,
        )
        fingerprint = request_fingerprint(model, options, inputs) if key else ""
        body, created, location = await _create(
            caller=caller, spec=spec, idempotency_key=key, fingerprint=fingerprint
        )
        return Response(body, status=202 if created else 200, headers={"Location": location})

    @extend_schema(
        operation_id="list_jobs",
        summary="Your jobs, newest first",
        parameters=[JobListQuery],
        responses={
            200: JobListSerializer,
            **AUTH_ERRORS,
            404: error_response(
                "`after` names no job of yours",
                NotFound("You have no job 'job_0123...' to list after.", param="after", code="job_not_found"),
            ),
            422: error_response(
                "A bad limit or `after`",
                ValidationFailed("limit: Ensure this value is less than or equal to 100.", param="limit"),
            ),
        },
        examples=[
            OpenApiExample(
                "One page",
                value={
                    "object": "list",
                    "data": [JOB_EXAMPLE],
                    "first_id": JOB_EXAMPLE["id"],
                    "last_id": JOB_EXAMPLE["id"],
                    "has_more": True,
                },
                response_only=True,
                status_codes=["200"],
            )
        ],
        tags=["jobs"],
    )
    async def get(self, request: Request) -> Response:
        params = validated(JobListQuery, request.query_params.dict())
        data, has_more = await _job_list(request.user, params["limit"], params.get("after") or None)
        return Response(list_page(data, has_more))


class JobDetailView(ApiView):
    endpoint = "job"

    @extend_schema(
        operation_id="retrieve_job",
        summary="One job: status, counts, usage",
        parameters=[JOB_ID_PARAMETER],
        responses={200: JobObjectSerializer, **AUTH_ERRORS, 404: JOB_NOT_FOUND},
        examples=[JOB_RESPONSE_EXAMPLE],
        tags=["jobs"],
    )
    async def get(self, request: Request, job_id: str) -> Response:
        return Response(await _job_read(request.user, job_id))

    @extend_schema(
        operation_id="delete_job",
        summary="Delete a job and its results",
        description="Cancels it if it still runs and removes its inputs and results; "
        "downloading its results answers 410 from then on.",
        parameters=[JOB_ID_PARAMETER],
        responses={200: JobDeletedSerializer, **AUTH_ERRORS, 404: JOB_NOT_FOUND},
        examples=[
            OpenApiExample(
                "Deleted",
                value={"id": JOB_EXAMPLE["id"], "object": "embedding.job.deleted", "deleted": True},
                response_only=True,
                status_codes=["200"],
            )
        ],
        tags=["jobs"],
    )
    async def delete(self, request: Request, job_id: str) -> Response:
        public_id = await _job_delete(request.user, job_id)
        return Response({"id": public_id, "object": "embedding.job.deleted", "deleted": True})


class JobCancelView(ApiView):
    endpoint = "job_cancel"

    @extend_schema(
        operation_id="cancel_job",
        summary="Cancel a job",
        description="No new chunks start; the job is `cancelling` until the chunks in progress end, "
        "then `cancelled`, and the tokens it did not use go back to your quota. "
        "A finished job is answered as it is.",
        request=None,
        parameters=[JOB_ID_PARAMETER],
        responses={200: JobObjectSerializer, **AUTH_ERRORS, 404: JOB_NOT_FOUND},
        examples=[
            OpenApiExample(
                "Cancelling",
                value={**JOB_EXAMPLE, "status": "cancelling"},
                response_only=True,
                status_codes=["200"],
            )
        ],
        tags=["jobs"],
    )
    async def post(self, request: Request, job_id: str) -> Response:
        return Response(await _job_cancel(request.user, job_id))


RESULT_LINES_EXAMPLE = (
    '{"object":"embedding","index":0,"id":"doc-1","embedding":[0.0123,-0.0456,0.0789]}\n'
    '{"object":"embedding","index":1,"id":"doc-2","embedding":null,'
    '"error":{"code":"embedding_failed","message":"this input\'s chunk failed after retries"}}\n'
)


class JobResultsView(ApiView):
    endpoint = "job_results"

    @extend_schema(
        operation_id="retrieve_job_results",
        summary="Download a finished job's vectors",
        description=(
            "`jsonl` and `npy` stream the whole result, in input order; `json` returns a page of "
            "`limit` inputs from `offset`. Inputs whose chunk failed are NaN rows in `npy` and "
            "objects with `embedding: null` and an `error` in `jsonl` and `json`. 409 while the job "
            "runs, 410 once its results expired or were deleted."
        ),
        parameters=[JOB_ID_PARAMETER, JobResultsQuery],
        responses={
            (200, "application/json"): JobResultsPageSerializer,
            (200, "application/jsonl"): OpenApiResponse(
                OpenApiTypes.STR,
                description="One JSON object a line",
                examples=[
                    OpenApiExample("Two lines, one failed", value=RESULT_LINES_EXAMPLE, response_only=True)
                ],
            ),
            (200, "application/x-npy"): OpenApiResponse(
                OpenApiTypes.BINARY,
                description="A NumPy .npy file: float32, shape (inputs, dimensions); for a quantised "
                "output_dtype int8/uint8 (inputs, dimensions) or binary/ubinary (inputs, dimensions / 8)",
            ),
            **AUTH_ERRORS,
            404: JOB_NOT_FOUND,
            409: error_response(
                "The job has not finished",
                JobNotFinished("The job has not finished; its results can be downloaded once it has."),
            ),
            410: error_response(
                "The results expired or were deleted",
                JobExpired("The job's results have expired or were deleted."),
            ),
            422: error_response(
                "A bad format, offset or limit",
                ValidationFailed('format: "csv" is not a valid choice.', param="format"),
            ),
        },
        examples=[
            OpenApiExample(
                "A page (format=json)",
                value={
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "id": "doc-1", "embedding": EXAMPLE_VECTOR}],
                    "model": "all-MiniLM-L6-v2",
                    "offset": 0,
                    "total": 2,
                    "has_more": True,
                },
                response_only=True,
                status_codes=["200"],
                media_type="application/json",
            )
        ],
        tags=["jobs"],
    )
    async def get(self, request: Request, job_id: str):
        params = validated(JobResultsQuery, request.query_params.dict())
        job, model_name, (store, rows_per_chunk, dims) = await _finished_job(request.user, job_id)
        encoding = params.get("encoding_format") or job.encoding_format
        total = sum(rows_per_chunk)
        if params["format"] == "json":
            offset, limit = params["offset"], params["limit"]
            data = await sync_to_async(json_page, thread_sensitive=False)(
                store, rows_per_chunk, dims, encoding=encoding, offset=offset, limit=limit
            )
            return Response(
                {
                    "object": "list",
                    "data": data,
                    "model": model_name,
                    "offset": offset,
                    "total": total,
                    "has_more": offset + limit < total,
                }
            )
        if params["format"] == "npy":
            response = StreamingHttpResponse(
                in_threads(lambda: iter_npy(store, rows_per_chunk, dims)), content_type="application/x-npy"
            )
            response["Content-Length"] = str(npy_size(store, total, dims))
        else:
            response = StreamingHttpResponse(
                in_threads(lambda: iter_jsonl(store, rows_per_chunk, dims, encoding=encoding)),
                content_type="application/jsonl",
            )
        response["Content-Disposition"] = f'attachment; filename="{job.public_id}.{params["format"]}"'
        return response
