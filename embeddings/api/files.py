"""/v1/files: OpenAI's Files API (upload, list, retrieve, download, delete) over services/openai_api/files.py.

The upload's size is enforced while it arrives (embeddings/api/intake.py: FILES_MAX_UPLOAD_BYTES
for this route), spooled to disk, then copied to the files storage a piece at a time.
"""

from __future__ import annotations

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

from embeddings.api.base import ApiView, list_page
from embeddings.api.docs import AUTH_ERRORS, ListPageSerializer, error_response
from embeddings.api.forms import form_fields
from embeddings.api.rendering import MultipartUploadParser, OrjsonParser, in_threads
from embeddings.callers import Caller
from embeddings.contracts.fields import DECIMAL_INTEGER, QueryIntegerField, cursor_field, id_schema, validated
from embeddings.errors.answers import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
)
from embeddings.models import StoredFile
from embeddings.services.openai_api.files import (
    FILE_ID_PATTERN,
    expires_after_seconds,
    file_create,
    file_delete,
    file_object,
    file_of_tenant,
    file_pieces,
    files_for_tenant,
)

# What a client may upload: batch input files (the other purposes OpenAI knows have no use here).
UPLOAD_PURPOSES = (StoredFile.Purpose.BATCH,)
# OpenAI's bounds for expires_after.seconds: an hour to 30 days.
EXPIRES_AFTER_MIN_S, EXPIRES_AFTER_MAX_S = 3600, 30 * 24 * 3600


class FileObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text='Always "file".')
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField()
    expires_at = serializers.IntegerField(allow_null=True)
    filename = serializers.CharField()
    purpose = serializers.CharField(help_text="`batch` (uploaded) or `batch_output` (a batch's results).")
    status = serializers.ChoiceField(choices=["processed"])
    status_details = serializers.CharField(allow_null=True)


class FileListSerializer(ListPageSerializer):
    data = FileObjectSerializer(many=True)


class FileDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text='Always "file".')
    deleted = serializers.BooleanField()


@extend_schema_field({"type": "string", "format": "binary", "minLength": 1})
class BatchInputFileField(serializers.FileField):
    """Documentation only (the view reads the form): a file with a line (services/openai_api/files.py)."""


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "anchor": {"type": "string", "enum": ["created_at"]},
            "seconds": {"type": "integer", "minimum": EXPIRES_AFTER_MIN_S, "maximum": EXPIRES_AFTER_MAX_S},
        },
        "required": ["anchor", "seconds"],
        "additionalProperties": False,
    }
)
class ExpiresAfterField(serializers.JSONField):
    """Documentation only: read by _expires_after."""


class FileUploadRequest(serializers.Serializer):
    """The form of POST /v1/files; a field it does not name is refused (400), as OpenAI does."""

    file = BatchInputFileField(help_text="JSONL: one batch request a line (a file without one: 400).")
    purpose = serializers.ChoiceField(choices=list(UPLOAD_PURPOSES))
    expires_after = ExpiresAfterField(
        required=False,
        help_text="When the file expires: `seconds` after its creation. As form fields "
        "`expires_after[anchor]` and `expires_after[seconds]` (as the SDKs send it), or one JSON field.",
    )


class FileListQuery(serializers.Serializer):
    purpose = serializers.ChoiceField(
        choices=StoredFile.Purpose.values, required=False, allow_blank=True, help_text="Empty: every purpose."
    )
    limit = QueryIntegerField(min_value=1, max_value=10000, default=10000)
    order = serializers.ChoiceField(choices=["asc", "desc"], default="desc")
    after = cursor_field(pattern=FILE_ID_PATTERN, what="a file id (`file-` and 24 letters or digits)")


FILE_EXAMPLE = {
    "id": "file-9Xc2mQ4RkTz8LpA1bYv3Wn0e",
    "object": "file",
    "bytes": 120000,
    "created_at": 1767225600,
    "expires_at": None,
    "filename": "requests.jsonl",
    "purpose": "batch",
    "status": "processed",
    "status_details": None,
}
FILE_ID_PARAMETER = OpenApiParameter(
    "file_id",
    id_schema(FILE_ID_PATTERN),
    OpenApiParameter.PATH,
    description="The file's id (any other string is no file: 404).",
)
FILE_NOT_FOUND = error_response(
    "No file of yours has this id (another tenant's file is not found either)",
    NotFound("You have no file 'file-0123'.", param="file_id", code="file_not_found"),
)


def _expires_after(fields: dict) -> int | None:
    """The seconds of `expires_after`, sent as form fields `expires_after[anchor]` and
    `expires_after[seconds]` (as the SDKs send it) or as one JSON field."""
    anchor, seconds = fields.pop("expires_after[anchor]", None), fields.pop("expires_after[seconds]", None)
    whole = fields.pop("expires_after", None)
    if whole is not None:
        try:
            parsed = orjson.loads(whole) if isinstance(whole, str) else whole
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or set(parsed) - {"anchor", "seconds"}:
            raise BadRequest(
                'expires_after must be a JSON object {"anchor": "created_at", "seconds": ...}',
                param="expires_after",
            )
        anchor, seconds = parsed.get("anchor"), parsed.get("seconds")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BadRequest("expires_after.anchor must be 'created_at'", param="expires_after.anchor")
    # An integer in JSON (3600.0 is one), or decimal digits in a form field.
    integral_float = isinstance(seconds, float) and seconds.is_integer()
    if integral_float or (isinstance(seconds, str) and DECIMAL_INTEGER.fullmatch(seconds)):
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise BadRequest("expires_after.seconds must be an integer", param="expires_after.seconds")
    value = seconds
    if not EXPIRES_AFTER_MIN_S <= value <= EXPIRES_AFTER_MAX_S:
        raise BadRequest(
            f"expires_after.seconds must be between {EXPIRES_AFTER_MIN_S} and {EXPIRES_AFTER_MAX_S}",
            param="expires_after.seconds",
        )
    return value


# What _upload reads; any other field is refused.
FORM_FIELDS = ("file", "purpose", "expires_after", "expires_after[anchor]", "expires_after[seconds]")


def _printable(name: str | None) -> str:
    """The client's file name without control characters (PostgreSQL refuses NUL; logs and
    terminals are better without the others)."""
    return "".join(character for character in name or "" if character.isprintable())[:255]


def _upload(request: Request, caller: Caller) -> dict:
    """Check the form and store its file (sync: it copies the spooled upload to the storage)."""
    fields = form_fields(request.data, known=FORM_FIELDS)
    upload = fields.pop("file", None)
    purpose = fields.pop("purpose", None)
    if purpose not in UPLOAD_PURPOSES:
        allowed = ", ".join(repr(str(p)) for p in UPLOAD_PURPOSES)
        raise BadRequest(
            f"purpose must be one of {allowed}, got {purpose!r}", param="purpose", code="invalid_purpose"
        )
    if not isinstance(upload, UploadedFile):
        raise BadRequest("file: the upload needs a `file` part", param="file")
    expires_s = _expires_after(fields)
    if fields:
        raise BadRequest(f"Unknown form field(s): {', '.join(sorted(fields))}", param=sorted(fields)[0])
    if upload.size > settings.BATCH_MAX_INPUT_FILE_BYTES:
        raise PayloadTooLarge(
            f"A batch input file may have at most {settings.BATCH_MAX_INPUT_FILE_BYTES} bytes; "
            f"this one has {upload.size}.",
            param="file",
        )
    upload.seek(0)
    stored = file_create(
        tenant_id=caller.tenant_id,
        purpose=purpose,
        filename=_printable(upload.name) or "upload.jsonl",
        content=upload.file,
        expires_at=expires_after_seconds(expires_s),
    )
    return file_object(stored)


@sync_to_async
def _file_list(caller: Caller, params: dict) -> tuple[list[dict], bool]:
    files, has_more = files_for_tenant(
        tenant_id=caller.tenant_id,
        purpose=params.get("purpose") or None,
        limit=params["limit"],
        order=params["order"],
        after=params.get("after") or None,
    )
    return [file_object(stored) for stored in files], has_more


@sync_to_async
def _file_read(caller: Caller, file_id: str) -> dict:
    return file_object(file_of_tenant(tenant_id=caller.tenant_id, public_id=file_id))


@sync_to_async
def _file_delete(caller: Caller, file_id: str) -> str:
    stored = file_of_tenant(tenant_id=caller.tenant_id, public_id=file_id)
    file_delete(stored=stored)
    return stored.public_id


class FileListCreateView(ApiView):
    endpoint = "files"
    parser_classes = [MultipartUploadParser, OrjsonParser]

    @extend_schema(
        operation_id="create_file",
        summary="Upload a file (OpenAI-compatible)",
        description=(
            "A multipart/form-data upload: `file` and `purpose` (`batch`), optionally `expires_after`. "
            "At most FILES_MAX_UPLOAD_BYTES (512 MB) bytes, refused as it arrives; a batch input "
            "file at most BATCH_MAX_INPUT_FILE_BYTES (200 MB)."
        ),
        request={
            "multipart/form-data": OpenApiRequest(
                FileUploadRequest,
                # How the SDKs send it (a JSON part is read too).
                encoding={"expires_after": {"style": "deepObject", "explode": True}},
            )
        },
        responses={
            200: FileObjectSerializer,
            400: error_response(
                "An unknown purpose, no file part, a file without a line, a bad expires_after, a field "
                "the form does not have",
                BadRequest(
                    "purpose must be one of 'batch', got 'fine-tune'", param="purpose", code="invalid_purpose"
                ),
                BadRequest(
                    "The file has no lines; a batch input file has one request a line.",
                    param="file",
                    code="empty_file",
                ),
            ),
            **AUTH_ERRORS,
            413: error_response("The upload is too large", PayloadTooLarge("The upload is larger than ...")),
            415: error_response(
                "A body that is neither multipart nor JSON",
                UnsupportedMediaType('Unsupported media type "text/plain" in request.'),
            ),
            422: error_response(
                "A form field or file part sent twice",
                ValidationFailed("file: sent 2 times in the form; send it once", param="file"),
            ),
        },
        examples=[OpenApiExample("Uploaded", value=FILE_EXAMPLE, response_only=True, status_codes=["200"])],
        tags=["files"],
    )
    async def post(self, request: Request) -> Response:
        if not request.content_type.startswith("multipart/form-data"):
            raise BadRequest("Upload a file as multipart/form-data with `file` and `purpose` parts.")
        return Response(await sync_to_async(_upload)(request, request.user))

    @extend_schema(
        operation_id="list_files",
        summary="Your files",
        parameters=[FileListQuery],
        responses={
            200: FileListSerializer,
            **AUTH_ERRORS,
            404: error_response(
                "`after` names no file of yours",
                NotFound(
                    "You have no file 'file-0123...' to list after.", param="after", code="file_not_found"
                ),
            ),
            422: error_response(
                "A bad limit, order, purpose or `after`",
                ValidationFailed("limit: Ensure this value is less than or equal to 10000.", param="limit"),
            ),
        },
        tags=["files"],
    )
    async def get(self, request: Request) -> Response:
        params = validated(FileListQuery, request.query_params.dict())
        data, has_more = await _file_list(request.user, params)
        return Response(list_page(data, has_more))


class FileDetailView(ApiView):
    endpoint = "file"

    @extend_schema(
        operation_id="retrieve_file",
        summary="One file",
        parameters=[FILE_ID_PARAMETER],
        responses={200: FileObjectSerializer, **AUTH_ERRORS, 404: FILE_NOT_FOUND},
        tags=["files"],
    )
    async def get(self, request: Request, file_id: str) -> Response:
        return Response(await _file_read(request.user, file_id))

    @extend_schema(
        operation_id="delete_file",
        summary="Delete a file",
        parameters=[FILE_ID_PARAMETER],
        responses={200: FileDeletedSerializer, **AUTH_ERRORS, 404: FILE_NOT_FOUND},
        tags=["files"],
    )
    async def delete(self, request: Request, file_id: str) -> Response:
        public_id = await _file_delete(request.user, file_id)
        return Response({"id": public_id, "object": "file", "deleted": True})


class FileContentView(ApiView):
    endpoint = "file_content"

    @extend_schema(
        operation_id="download_file",
        summary="A file's content (streamed)",
        parameters=[FILE_ID_PARAMETER],
        responses={
            (200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY, description="The bytes"),
            **AUTH_ERRORS,
            404: FILE_NOT_FOUND,
        },
        tags=["files"],
    )
    async def get(self, request: Request, file_id: str):
        stored = await sync_to_async(file_of_tenant)(tenant_id=request.user.tenant_id, public_id=file_id)
        response = StreamingHttpResponse(
            in_threads(lambda: file_pieces(stored)), content_type="application/octet-stream"
        )
        response["Content-Length"] = str(stored.bytes)
        response["Content-Disposition"] = f'attachment; filename="{stored.public_id}.jsonl"'
        return response
