"""/v1/batches: OpenAI's Batch API (create, list, retrieve, cancel) over services/openai_api/batches.py."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.base import ApiView, list_page
from embeddings.api.docs import AUTH_ERRORS, ListPageSerializer, error_response
from embeddings.callers import Caller
from embeddings.contracts.fields import (
    MetadataField,
    QueryIntegerField,
    StrictCharField,
    cursor_field,
    id_schema,
    validated,
)
from embeddings.errors.answers import NotFound, PayloadTooLarge, UnsupportedMediaType, ValidationFailed
from embeddings.models import Batch
from embeddings.services.openai_api.batches import (
    BATCH_ID_PATTERN,
    COMPLETION_WINDOWS,
    ENDPOINTS,
    batch_cancel,
    batch_create,
    batch_for_tenant,
    batch_object,
    batches_for_tenant,
)
from embeddings.services.openai_api.files import file_of_tenant


class BatchCreateRequest(serializers.Serializer):
    input_file_id = StrictCharField(
        lookup=True, max_length=64, help_text="A file of yours with purpose `batch` (another string: 404)."
    )
    endpoint = serializers.ChoiceField(choices=list(ENDPOINTS))
    completion_window = serializers.ChoiceField(choices=list(COMPLETION_WINDOWS))
    metadata = MetadataField(required=False, allow_null=True)


class BatchListQuery(serializers.Serializer):
    limit = QueryIntegerField(min_value=1, max_value=100, default=20)
    after = cursor_field(
        pattern=BATCH_ID_PATTERN, what="a batch id (`batch_` and 24 lowercase letters or digits)"
    )


class BatchErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    line = serializers.IntegerField(allow_null=True)


class BatchErrorsSerializer(serializers.Serializer):
    object = serializers.CharField(help_text='Always "list".')
    data = BatchErrorSerializer(many=True)


class BatchRequestCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class BatchObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text='Always "batch".')
    endpoint = serializers.CharField()
    model = serializers.CharField(allow_null=True)
    errors = BatchErrorsSerializer(allow_null=True)
    input_file_id = serializers.CharField()
    completion_window = serializers.CharField()
    status = serializers.ChoiceField(choices=Batch.Status.values)
    output_file_id = serializers.CharField(allow_null=True)
    error_file_id = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField()
    in_progress_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField(allow_null=True)
    finalizing_at = serializers.IntegerField(allow_null=True)
    completed_at = serializers.IntegerField(allow_null=True)
    failed_at = serializers.IntegerField(allow_null=True)
    expired_at = serializers.IntegerField(allow_null=True)
    cancelling_at = serializers.IntegerField(allow_null=True)
    cancelled_at = serializers.IntegerField(allow_null=True)
    request_counts = BatchRequestCountsSerializer()
    usage = serializers.JSONField(
        help_text="`input_tokens`, `output_tokens` (0), `total_tokens` and their details"
    )
    metadata = serializers.DictField(child=serializers.CharField(), allow_null=True)


class BatchListSerializer(ListPageSerializer):
    data = BatchObjectSerializer(many=True)


BATCH_EXAMPLE = {
    "id": "batch_6f1c2d9a8b7e4f30a1b2c3d4",
    "object": "batch",
    "endpoint": "/v1/embeddings",
    "model": "all-MiniLM-L6-v2",
    "errors": None,
    "input_file_id": "file-9Xc2mQ4RkTz8LpA1bYv3Wn0e",
    "completion_window": "24h",
    "status": "in_progress",
    "output_file_id": None,
    "error_file_id": None,
    "created_at": 1767225600,
    "in_progress_at": 1767225601,
    "expires_at": 1767312000,
    "finalizing_at": None,
    "completed_at": None,
    "failed_at": None,
    "expired_at": None,
    "cancelling_at": None,
    "cancelled_at": None,
    "request_counts": {"total": 10000, "completed": 2560, "failed": 0},
    "usage": {
        "input_tokens": 31200,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 31200,
    },
    "metadata": {"corpus": "wiki-2026-11"},
}
BATCH_ID_PARAMETER = OpenApiParameter(
    "batch_id",
    id_schema(BATCH_ID_PATTERN),
    OpenApiParameter.PATH,
    description="The batch's id (any other string is no batch: 404).",
)
BATCH_NOT_FOUND = error_response(
    "No batch (or input file) of yours has this id; another tenant's is not found either",
    NotFound("You have no batch 'batch_0123'.", param="batch_id", code="batch_not_found"),
)
BATCH_RESPONSE_EXAMPLE = OpenApiExample(
    "Running", value=BATCH_EXAMPLE, response_only=True, status_codes=["200"]
)


def _tenant_batch(caller: Caller, batch_id: str) -> Batch:
    batch = batch_for_tenant(tenant_id=caller.tenant_id, public_id=batch_id)
    if batch is None:
        raise NotFound(f"You have no batch {batch_id!r}.", param="batch_id", code="batch_not_found")
    return batch


@sync_to_async
def _create(caller: Caller, params: dict) -> dict:
    input_file = file_of_tenant(tenant_id=caller.tenant_id, public_id=params["input_file_id"])
    batch = batch_create(
        tenant_id=caller.tenant_id,
        api_key_id=caller.key_id,
        input_file=input_file,
        endpoint=params["endpoint"],
        completion_window=params["completion_window"],
        metadata=params.get("metadata"),
    )
    return batch_object(batch)


@sync_to_async
def _read(caller: Caller, batch_id: str) -> dict:
    return batch_object(_tenant_batch(caller, batch_id))


@sync_to_async
def _cancel(caller: Caller, batch_id: str) -> dict:
    return batch_object(batch_cancel(batch=_tenant_batch(caller, batch_id)))


@sync_to_async
def _list(caller: Caller, params: dict) -> tuple[list[dict], bool]:
    batches, has_more = batches_for_tenant(
        tenant_id=caller.tenant_id, limit=params["limit"], after=params.get("after") or None
    )
    return [batch_object(batch) for batch in batches], has_more


class BatchListCreateView(ApiView):
    endpoint = "batches"

    @extend_schema(
        operation_id="create_batch",
        summary="Create a batch (OpenAI-compatible)",
        description=(
            "Runs every line of a `batch` file (`{custom_id, method: POST, url: /v1/embeddings, body}`) "
            "on the job engine. Lines are validated in `validating`: a bad line is listed in "
            "`errors.data` (with its `line`) and in the error file, the others run. Each output line's "
            "`response.body` is what POST /v1/embeddings answers for its body."
        ),
        request=BatchCreateRequest,
        responses={
            200: BatchObjectSerializer,
            **AUTH_ERRORS,
            404: BATCH_NOT_FOUND,
            413: error_response(
                "The input file is larger than BATCH_MAX_INPUT_FILE_BYTES",
                PayloadTooLarge("The input file has 250000000 bytes; a batch's may have at most 200000000."),
            ),
            415: error_response(
                "A body that is not JSON",
                UnsupportedMediaType('Unsupported media type "text/plain" in request.'),
            ),
            422: error_response(
                "An unknown endpoint or completion window, or a file whose purpose is not `batch`",
                ValidationFailed('endpoint: "/v1/chat/completions" is not a valid choice.', param="endpoint"),
            ),
        },
        examples=[
            OpenApiExample(
                "Validating",
                value={**BATCH_EXAMPLE, "status": "validating", "in_progress_at": None},
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["batches"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(BatchCreateRequest, request.data)
        return Response(await _create(request.user, params))

    @extend_schema(
        operation_id="list_batches",
        summary="Your batches, newest first",
        parameters=[BatchListQuery],
        responses={
            200: BatchListSerializer,
            **AUTH_ERRORS,
            404: error_response(
                "`after` names no batch of yours",
                NotFound(
                    "You have no batch 'batch_0123...' to list after.", param="after", code="batch_not_found"
                ),
            ),
            422: error_response(
                "A bad limit or `after`",
                ValidationFailed("limit: Ensure this value is less than or equal to 100.", param="limit"),
            ),
        },
        tags=["batches"],
    )
    async def get(self, request: Request) -> Response:
        params = validated(BatchListQuery, request.query_params.dict())
        data, has_more = await _list(request.user, params)
        return Response(list_page(data, has_more))


class BatchDetailView(ApiView):
    endpoint = "batch"

    @extend_schema(
        operation_id="retrieve_batch",
        summary="One batch: status, counts, files",
        parameters=[BATCH_ID_PARAMETER],
        responses={200: BatchObjectSerializer, **AUTH_ERRORS, 404: BATCH_NOT_FOUND},
        examples=[BATCH_RESPONSE_EXAMPLE],
        tags=["batches"],
    )
    async def get(self, request: Request, batch_id: str) -> Response:
        return Response(await _read(request.user, batch_id))


class BatchCancelView(ApiView):
    endpoint = "batch_cancel"

    @extend_schema(
        operation_id="cancel_batch",
        summary="Cancel a batch",
        description="`cancelling` until the chunks in progress end, then `cancelled`: what finished is in "
        "the output file, the rest in the error file (`batch_cancelled`).",
        request=None,
        parameters=[BATCH_ID_PARAMETER],
        responses={200: BatchObjectSerializer, **AUTH_ERRORS, 404: BATCH_NOT_FOUND},
        tags=["batches"],
    )
    async def post(self, request: Request, batch_id: str) -> Response:
        return Response(await _cancel(request.user, batch_id))
