"""Usage reports read from UsageBucket rows: a tenant's month against its quotas, days, top keys, CSV.

Reads only: the rows are written by the usage fold (embeddings/services/quotas/usage.py). Days and months
are UTC, as the quota windows are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db.models import IntegerField, OuterRef, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Coalesce, TruncDate

from embeddings.models import ApiKey, Tenant, UsageBucket

CHART_DAYS = 30

USAGE_CSV_HEADER = (
    "hour_utc",
    "tenant",
    "api_key_id",
    "api_key_name",
    "model",
    "endpoint",
    "requests",
    "succeeded",
    "rejected",
    "failed",
    "inputs",
    "tokens",
    "latency_ms_total",
    "cached_inputs",
    "cached_tokens",
    # The variant that served (blank: not recorded); after the older columns, which keep their places.
    "model_version",
    "model_dtype",
)


def utc_day_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def utc_month_start(now: datetime) -> datetime:
    return utc_day_start(now).replace(day=1)


@dataclass(frozen=True)
class BudgetUse:
    """Tokens used in a window against that window's limit (None: unlimited)."""

    used: int
    limit: int | None

    @property
    def percent(self) -> float | None:
        if self.limit is None:
            return None
        if self.limit == 0:
            return 100.0 if self.used else 0.0
        return 100.0 * self.used / self.limit

    @property
    def remaining(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.used)


@dataclass(frozen=True)
class TenantUsageSummary:
    month_start: datetime
    day_start: datetime
    month_tokens: BudgetUse
    day_tokens: BudgetUse
    month_requests: int
    month_succeeded: int
    month_rejected: int
    month_failed: int
    month_inputs: int
    # Of month_inputs and month_tokens, those the embedding cache answered.
    month_cached_inputs: int
    month_cached_tokens: int
    day_requests: int


@dataclass(frozen=True)
class DayUsage:
    day: date
    tokens: int
    requests: int


@dataclass(frozen=True)
class KeyUsage:
    api_key_id: int | None  # None: work without a key, or by a key deleted since
    name: str
    prefix: str
    tokens: int
    requests: int


def _totals(queryset: QuerySet[UsageBucket], *fields: str) -> dict[str, int]:
    sums = queryset.aggregate(**{field: Coalesce(Sum(field), 0) for field in fields})
    return {field: int(sums[field]) for field in fields}


def tenant_usage_summary(*, tenant: Tenant, now: datetime) -> TenantUsageSummary:
    """This UTC month's and today's usage of every key of `tenant`, against the tenant's budgets."""
    month_start, day_start = utc_month_start(now), utc_day_start(now)
    month = _totals(
        UsageBucket.objects.filter(tenant=tenant, hour__gte=month_start),
        "tokens",
        "requests",
        "succeeded",
        "rejected",
        "failed",
        "inputs",
        "cached_inputs",
        "cached_tokens",
    )
    today = _totals(UsageBucket.objects.filter(tenant=tenant, hour__gte=day_start), "tokens", "requests")
    return TenantUsageSummary(
        month_start=month_start,
        day_start=day_start,
        month_tokens=BudgetUse(used=month["tokens"], limit=tenant.tokens_per_month),
        day_tokens=BudgetUse(used=today["tokens"], limit=tenant.tokens_per_day),
        month_requests=month["requests"],
        month_succeeded=month["succeeded"],
        month_rejected=month["rejected"],
        month_failed=month["failed"],
        month_inputs=month["inputs"],
        month_cached_inputs=month["cached_inputs"],
        month_cached_tokens=month["cached_tokens"],
        day_requests=today["requests"],
    )


def daily_usage(*, tenant: Tenant, now: datetime, days: int = CHART_DAYS) -> list[DayUsage]:
    """Tokens and requests per UTC day for the `days` days ending today, oldest first; idle days are 0."""
    today = utc_day_start(now)
    first = today - timedelta(days=days - 1)
    rows = (
        UsageBucket.objects.filter(tenant=tenant, hour__gte=first, hour__lt=today + timedelta(days=1))
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values("day")
        .annotate(day_tokens=Sum("tokens"), day_requests=Sum("requests"))
    )
    by_day = {row["day"]: (int(row["day_tokens"]), int(row["day_requests"])) for row in rows}
    result = []
    for offset in range(days):
        day = (first + timedelta(days=offset)).date()
        tokens, requests = by_day.get(day, (0, 0))
        result.append(DayUsage(day=day, tokens=tokens, requests=requests))
    return result


def top_keys(*, tenant: Tenant, now: datetime, limit: int = 5) -> list[KeyUsage]:
    """The tenant's keys that used the most tokens this UTC month, most first."""
    rows = (
        UsageBucket.objects.filter(tenant=tenant, hour__gte=utc_month_start(now))
        .values("api_key", "api_key__name", "api_key__public_id")
        .annotate(key_tokens=Sum("tokens"), key_requests=Sum("requests"))
        .order_by("-key_tokens", "-key_requests", "api_key")[:limit]
    )
    return [
        KeyUsage(
            api_key_id=row["api_key"],
            name=row["api_key__name"] or "(no key)",
            prefix=f"emb_{row['api_key__public_id']}_" if row["api_key__public_id"] else "",
            tokens=int(row["key_tokens"]),
            requests=int(row["key_requests"]),
        )
        for row in rows
    ]


def api_keys_with_month_usage(queryset: QuerySet[ApiKey], *, now: datetime) -> QuerySet[ApiKey]:
    """Annotate each key with `tokens_this_month` and `requests_this_month`, in the same query."""
    month = UsageBucket.objects.filter(api_key=OuterRef("pk"), hour__gte=utc_month_start(now)).values(
        "api_key"
    )

    def month_sum(field: str) -> Coalesce:
        total = month.annotate(total=Sum(field)).values("total")
        return Coalesce(Subquery(total, output_field=IntegerField()), Value(0))

    return queryset.annotate(tokens_this_month=month_sum("tokens"), requests_this_month=month_sum("requests"))


def spreadsheet_safe(text: str) -> str:
    """Keep a spreadsheet from reading a name such as `=HYPERLINK(...)` as a formula."""
    return f"'{text}" if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def usage_csv_rows(buckets: Iterable[UsageBucket] | QuerySet[UsageBucket]) -> Iterator[tuple]:
    """The header, then one row per bucket; a queryset is read in chunks, never all at once."""
    yield USAGE_CSV_HEADER
    if isinstance(buckets, QuerySet):
        buckets = buckets.select_related("tenant", "api_key").iterator(chunk_size=2000)
    for bucket in buckets:
        yield (
            bucket.hour.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            spreadsheet_safe(bucket.tenant.slug),
            bucket.api_key.public_id if bucket.api_key else "",
            spreadsheet_safe(bucket.api_key.name) if bucket.api_key else "",
            spreadsheet_safe(bucket.model),
            spreadsheet_safe(bucket.endpoint),
            bucket.requests,
            bucket.succeeded,
            bucket.rejected,
            bucket.failed,
            bucket.inputs,
            bucket.tokens,
            bucket.latency_ms_total,
            bucket.cached_inputs,
            bucket.cached_tokens,
            bucket.model_version,
            spreadsheet_safe(bucket.model_dtype),
        )
