"""GET /v1/usage: the calling tenant's own usage, grouped, with its current quota state."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta

from asgiref.sync import sync_to_async
from django.core.validators import RegexValidator
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field
from redis.exceptions import RedisError
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.base import ApiView
from embeddings.api.docs import AUTH_ERRORS, error_response
from embeddings.callers import Caller
from embeddings.contracts.fields import validated
from embeddings.errors.answers import NotFound, ValidationFailed
from embeddings.models import ApiKey, Tenant
from embeddings.services.accounts.api_keys import KEY_PREFIX, KEY_PUBLIC_ID_PATTERN
from embeddings.services.jobs.budget import TenantJobStorage, tenant_job_storage
from embeddings.services.quotas.limits import quota_status_sync
from embeddings.services.quotas.usage import TenantUsage, usage_for_tenant

logger = logging.getLogger(__name__)

# Wider ranges are refused (422): a year of hourly rows is as much as one request should add up.
MAX_USAGE_RANGE = timedelta(days=366)


# Bounds outside this window are refused (422): no usage predates the Unix epoch, and a moment next
# to datetime's limits (year 1, year 9999) overflows once a day or a UTC offset is added to it.
EARLIEST_BOUND = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_BOUND = datetime(9999, 1, 1, tzinfo=UTC)
# The code of a well-formed range refused for where it lies (before 1970, after 9999-01-01, end not
# after start, over MAX_USAGE_RANGE): what the schema's date formats cannot say.
RANGE_REFUSED = "invalid_range"


# --- Request and response shapes -------------------------------------------------------------------


@extend_schema_field(
    {
        "anyOf": [
            {"type": "string", "format": "date"},
            {"type": "string", "format": "date-time"},
            {"type": "string", "maxLength": 0},
        ]
    }
)
class UsageBoundField(serializers.CharField):
    """A bound of GET /v1/usage's range, read by the view (embeddings/api/usage.py parse_bound)."""

    def __init__(self, **options) -> None:
        super().__init__(required=False, allow_blank=True, trim_whitespace=False, **options)


class UsageQuery(serializers.Serializer):
    """The query string of GET /v1/usage (the view turns the bounds into datetimes). An empty
    value means the parameter's default, as if it were not sent."""

    start = UsageBoundField(
        help_text="UTC date `YYYY-MM-DD` (from its midnight) or ISO 8601 datetime (from the start of "
        "its hour; without an offset, UTC), from 1970-01-01 to 9999-01-01. Default: the first day of "
        "end's UTC month."
    )
    end = UsageBoundField(
        help_text="UTC date `YYYY-MM-DD` (that day included) or ISO 8601 datetime (exclusive; without "
        "an offset, UTC), from 1970-01-01 to 9999-01-01, after start and at most 366 days from it. "
        "Default: now."
    )
    group_by = serializers.ChoiceField(
        choices=["day", "model", "variant", "key"],
        default="day",
        help_text="`variant`: a row per model and the variant that served it (export version and dtype)",
    )
    key = serializers.CharField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        # The public id alone, or the key's first part or whole (its secret is not read).
        validators=[
            RegexValidator(
                rf"\A(?:{KEY_PREFIX})?{KEY_PUBLIC_ID_PATTERN}(?:_[A-Za-z0-9_-]{{0,100}})?\Z",
                message="must be an API key's public id",
            )
        ],
        help_text="Only this key of yours: its public id (`emb_<public id>_…`'s middle).",
    )


class UsageCountersSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    succeeded = serializers.IntegerField()
    rejected = serializers.IntegerField(help_text="Refused by a quota or rate limit")
    failed = serializers.IntegerField(help_text="Accepted, then failed")
    inputs = serializers.IntegerField()
    tokens = serializers.IntegerField(help_text="Every input's tokens, cached or computed")
    cached_inputs = serializers.IntegerField(help_text="Of inputs, those answered from the embedding cache")
    cached_tokens = serializers.IntegerField(help_text="Of tokens, those answered from the embedding cache")
    computed_tokens = serializers.IntegerField(
        help_text="Of tokens, those the model computed: tokens - cached_tokens"
    )
    mean_latency_ms = serializers.FloatField(allow_null=True, help_text="Null without requests")


class UsageKeySerializer(serializers.Serializer):
    id = serializers.CharField(help_text="The key's public id")
    name = serializers.CharField()


class UsageRowSerializer(UsageCountersSerializer):
    day = serializers.DateField(required=False, help_text="group_by=day")
    model = serializers.CharField(required=False, help_text="group_by=model or variant")
    model_version = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="group_by=variant: the model's pinned export version that served (a switch of version "
        "starts a new row); null: not recorded (usage from before it was, or a model without a pinned "
        "version)",
    )
    model_dtype = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="group_by=variant: that export's dtype, as /v1/models reports it (`float32`, `int8`, ...); "
        "null: not recorded",
    )
    key = UsageKeySerializer(
        required=False, allow_null=True, help_text="group_by=key; null: no key, or a deleted one"
    )


class JobStorageSerializer(serializers.Serializer):
    used_bytes = serializers.IntegerField(help_text="Bytes your jobs hold in the job store now")
    budget_bytes = serializers.IntegerField(help_text="Bytes your jobs may hold at once")
    available_bytes = serializers.IntegerField(help_text="budget_bytes - used_bytes (at least 0)")


class UsageResponse(serializers.Serializer):
    object = serializers.CharField(default="usage")
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    group_by = serializers.CharField()
    includes_unfolded = serializers.BooleanField(
        help_text="True: counters not yet folded into the database are included (up to the second)"
    )
    totals = UsageCountersSerializer()
    data = UsageRowSerializer(many=True)
    quota = serializers.JSONField(
        allow_null=True,
        help_text="Limits and current windows of your tenant and this key; null if unreadable",
    )
    job_storage = JobStorageSerializer(
        help_text="Your jobs' inputs and results held in the job store, against your budget: a job "
        "that would not fit is refused (429 or 413 job_storage_budget_exceeded)"
    )


def parse_bound(text: str, *, param: str) -> datetime:
    """A query bound as an aware UTC datetime. A date means its midnight, and as `end` the
    midnight after it (the day is included); a naive datetime is UTC."""
    try:
        if len(text) == len("YYYY-MM-DD"):
            day = date.fromisoformat(text)
            moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
            if param == "end":
                moment += timedelta(days=1)
        else:
            moment = datetime.fromisoformat(text)
            moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except ValueError:
        raise ValidationFailed(
            f"{param}: {text!r} is not a date (YYYY-MM-DD) or an ISO 8601 datetime", param=param
        ) from None
    except OverflowError:
        moment = None
    if moment is None or not EARLIEST_BOUND <= moment <= LATEST_BOUND:
        raise ValidationFailed(
            f"{param}: {text!r} is outside {EARLIEST_BOUND:%Y-%m-%d} to {LATEST_BOUND:%Y-%m-%d} (UTC)",
            param=param,
            code=RANGE_REFUSED,
        )
    return moment


def usage_range(params: dict, now: datetime) -> tuple[datetime, datetime]:
    end = parse_bound(params["end"], param="end") if "end" in params else now
    if "start" in params:
        start = parse_bound(params["start"], param="start")
    else:
        last_moment = end - timedelta(microseconds=1)
        start = last_moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if end <= start:
        raise ValidationFailed("end: must be after start", param="end", code=RANGE_REFUSED)
    if end - start > MAX_USAGE_RANGE:
        raise ValidationFailed(
            f"start: the range may span at most {MAX_USAGE_RANGE.days} days; ask for less at a time",
            param="start",
            code=RANGE_REFUSED,
        )
    return start, end


def counters_json(counters: dict[str, int]) -> dict:
    requests = counters["requests"]
    return {
        "requests": requests,
        "succeeded": counters["succeeded"],
        "rejected": counters["rejected"],
        "failed": counters["failed"],
        "inputs": counters["inputs"],
        "tokens": counters["tokens"],
        "cached_inputs": counters["cached_inputs"],
        "cached_tokens": counters["cached_tokens"],
        "computed_tokens": counters["tokens"] - counters["cached_tokens"],
        "mean_latency_ms": round(counters["latency_ms_total"] / requests, 3) if requests else None,
    }


def rows_json(usage: TenantUsage, group_by: str) -> list[dict]:
    rows = []
    for row in usage.rows:
        if group_by == "day":
            group = {"day": row.group.isoformat()}
        elif group_by == "model":
            group = {"model": row.group}
        elif group_by == "variant":
            model, version, dtype = row.group
            group = {"model": model, "model_version": version or None, "model_dtype": dtype or None}
        else:
            names = usage.key_names.get(row.group)
            group = {"key": {"id": names[0], "name": names[1]} if names else None}
        rows.append({**group, **counters_json(row.counters)})
    return rows


def _key_of_tenant(*, tenant_id: int, public_id: str) -> int:
    """The id of the tenant's key with this public id; another tenant's key is not found either."""
    public_id = public_id.removeprefix("emb_").split("_", 1)[0]
    key_id = (
        ApiKey.objects.filter(tenant_id=tenant_id, public_id=public_id).values_list("pk", flat=True).first()
    )
    if key_id is None:
        raise NotFound(f"You have no API key {public_id!r}.", param="key", code="api_key_not_found")
    return key_id


@sync_to_async
def _tenant_usage(
    *, caller: Caller, start: datetime, end: datetime, group_by: str, key: str | None
) -> tuple[TenantUsage, dict | None, TenantJobStorage]:
    """The usage report, the quota state (None when Redis cannot be read) and the job storage held,
    in one thread hop.

    The quota state is read with the limits as they are in the database now (not as cached with
    the key), so a limit just changed in the admin shows at once.
    """
    tenant_id = caller.tenant_id
    api_key_id = _key_of_tenant(tenant_id=tenant_id, public_id=key) if key else None
    report = usage_for_tenant(
        tenant_id=tenant_id, start=start, end=end, group_by=group_by, api_key_id=api_key_id
    )
    try:
        quota = quota_status_sync(tenant_id, caller.key_id)
    except RedisError as error:
        logger.warning("usage: quota state unreadable: %s", error)
        quota = None
    storage = tenant_job_storage(tenant=Tenant.objects.get(pk=tenant_id))
    return report, quota, storage


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


USAGE_EXAMPLE = {
    "object": "usage",
    "start": "2026-11-01T00:00:00Z",
    "end": "2026-11-23T11:30:00Z",
    "group_by": "day",
    "includes_unfolded": True,
    "totals": {
        "requests": 1250, "succeeded": 1200, "rejected": 40, "failed": 10,
        "inputs": 5100, "tokens": 182000, "cached_inputs": 900, "cached_tokens": 31000,
        "computed_tokens": 151000, "mean_latency_ms": 14.2,
    },
    "data": [
        {
            "day": "2026-11-01", "requests": 600, "succeeded": 590, "rejected": 10, "failed": 0,
            "inputs": 2400, "tokens": 90000, "cached_inputs": 400, "cached_tokens": 14000,
            "computed_tokens": 76000, "mean_latency_ms": 13.9,
        },
        {
            "day": "2026-11-02", "requests": 650, "succeeded": 610, "rejected": 30, "failed": 10,
            "inputs": 2700, "tokens": 92000, "cached_inputs": 500, "cached_tokens": 17000,
            "computed_tokens": 75000, "mean_latency_ms": 14.5,
        },
    ],
    "quota": {
        "enabled": True,
        "tenant": {
            "tokens_per_month": {
                "limit": 1000000, "used": 182000, "remaining": 818000,
                "resets_at": "2026-12-01T00:00:00Z", "reset_in_s": 649800.0,
            },
        },
        "key": None,
    },
    "job_storage": {"used_bytes": 412000000, "budget_bytes": 1073741824, "available_bytes": 661741824},
}  # fmt: skip


class UsageView(ApiView):
    endpoint = "usage"

    @extend_schema(
        operation_id="retrieve_usage",
        summary="Your usage and quota state",
        description=(
            "Your tenant's usage (every key's, or one key's with `key`) in the UTC hours that start "
            "in [start, end), grouped by UTC `day`, `model`, `variant` (model, export version and "
            "dtype that served) or `key`, with totals and the current "
            "state of your quotas. Counted per request as it happens: counters not yet folded into "
            "the database are included (`includes_unfolded`), so numbers are up to date. "
            "`job_storage`: the bytes your jobs hold in the job store now, against your budget. "
            "Ranges of at most 366 days."
        ),
        parameters=[UsageQuery],
        responses={
            200: UsageResponse,
            **AUTH_ERRORS,
            404: error_response(
                "`key` names no key of yours",
                NotFound("You have no API key 'AbCdEf12'.", param="key", code="api_key_not_found"),
            ),
            422: error_response(
                "Bad dates, end before start, a range over 366 days, unknown group_by",
                ValidationFailed("end: must be after start", param="end"),
            ),
        },
        examples=[
            OpenApiExample("This month by day", value=USAGE_EXAMPLE, response_only=True, status_codes=["200"])
        ],
        tags=["usage"],
    )
    async def get(self, request: Request) -> Response:
        query = validated(UsageQuery, request.query_params.dict())
        params = {name: value for name, value in query.items() if value != ""}
        start, end = usage_range(params, datetime.now(UTC))
        usage, quota, storage = await _tenant_usage(
            caller=request.user, start=start, end=end, group_by=params["group_by"], key=params.get("key")
        )
        return Response(
            {
                "object": "usage",
                "start": _iso(start),
                "end": _iso(end),
                "group_by": params["group_by"],
                "includes_unfolded": usage.includes_unfolded,
                "totals": counters_json(usage.totals),
                "data": rows_json(usage, params["group_by"]),
                "quota": quota,
                "job_storage": storage.as_dict(),
            }
        )
