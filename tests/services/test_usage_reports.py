"""Usage reports from UsageBucket rows: UTC month and day windows, 30 days, top keys, CSV rows."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from embeddings.models import ApiKey, UsageBucket
from embeddings.services.accounts.api_keys import api_key_create
from embeddings.services.quotas.reports import (
    USAGE_CSV_HEADER,
    BudgetUse,
    api_keys_with_month_usage,
    daily_usage,
    spreadsheet_safe,
    tenant_usage_summary,
    top_keys,
    usage_csv_rows,
)
from tests.factories import usage_bucket

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 6, 12, 15, 30, tzinfo=UTC)


def bucket(tenant, api_key, hour: datetime, *, model="m", **counters):
    return usage_bucket(tenant, api_key, hour, model=model, **counters)


def test_summary_counts_this_utc_month_and_day_of_this_tenant_only(alpha, beta):
    key, _ = api_key_create(tenant=alpha, name="k")
    alpha.tokens_per_month, alpha.tokens_per_day = 1000, 100
    bucket(alpha, key, datetime(2026, 6, 12, 15, tzinfo=UTC), tokens=30, requests=3, succeeded=2, rejected=1)
    bucket(alpha, None, datetime(2026, 6, 12, 0, tzinfo=UTC), tokens=20, requests=2, succeeded=2)
    bucket(alpha, key, datetime(2026, 6, 1, 0, tzinfo=UTC), tokens=200, requests=5, failed=1)  # month
    bucket(alpha, key, datetime(2026, 5, 31, 23, tzinfo=UTC), tokens=9999, requests=99)  # last month
    bucket(beta, None, datetime(2026, 6, 12, 15, tzinfo=UTC), tokens=7777, requests=77)  # not alpha's

    summary = tenant_usage_summary(tenant=alpha, now=NOW)

    assert summary.month_start == datetime(2026, 6, 1, tzinfo=UTC)
    assert summary.month_tokens == BudgetUse(used=250, limit=1000)
    assert summary.month_tokens.percent == 25.0 and summary.month_tokens.remaining == 750
    assert summary.day_tokens == BudgetUse(used=50, limit=100)
    assert (summary.month_requests, summary.day_requests) == (10, 5)
    assert (summary.month_succeeded, summary.month_rejected, summary.month_failed) == (4, 1, 1)


def test_summary_of_a_tenant_without_usage_or_limits(alpha):
    summary = tenant_usage_summary(tenant=alpha, now=NOW)
    assert summary.month_tokens == BudgetUse(used=0, limit=None)
    assert summary.month_tokens.percent is None and summary.month_tokens.remaining is None
    assert summary.month_requests == 0


def test_budget_percent_edges():
    assert BudgetUse(used=0, limit=0).percent == 0.0
    assert BudgetUse(used=5, limit=0).percent == 100.0
    assert BudgetUse(used=150, limit=100).percent == 150.0  # a limit lowered below what was used
    assert BudgetUse(used=150, limit=100).remaining == 0


def test_daily_usage_is_thirty_utc_days_ending_today_with_idle_days_at_zero(alpha, beta):
    bucket(alpha, None, datetime(2026, 6, 12, 15, tzinfo=UTC), tokens=5, requests=1)
    bucket(alpha, None, datetime(2026, 6, 12, 1, tzinfo=UTC), tokens=7, requests=2, model="other")
    bucket(alpha, None, datetime(2026, 5, 14, 0, tzinfo=UTC), tokens=3, requests=1)  # the first day
    bucket(alpha, None, datetime(2026, 5, 13, 23, tzinfo=UTC), tokens=1000, requests=1000)  # before it
    bucket(beta, None, datetime(2026, 6, 10, 0, tzinfo=UTC), tokens=1000, requests=1000)

    days = daily_usage(tenant=alpha, now=NOW)

    assert len(days) == 30
    assert days[0].day == date(2026, 5, 14) and days[-1].day == date(2026, 6, 12)
    assert [day.day for day in days] == [date(2026, 5, 14) + timedelta(days=n) for n in range(30)]
    assert (days[0].tokens, days[0].requests) == (3, 1)
    assert (days[-1].tokens, days[-1].requests) == (12, 3)
    assert all((day.tokens, day.requests) == (0, 0) for day in days[1:-1])


def test_top_keys_this_month_most_tokens_first(alpha, beta):
    small, _ = api_key_create(tenant=alpha, name="small")
    big, _ = api_key_create(tenant=alpha, name="big")
    other, _ = api_key_create(tenant=beta, name="other")
    bucket(alpha, small, datetime(2026, 6, 2, tzinfo=UTC), tokens=10, requests=1)
    bucket(alpha, big, datetime(2026, 6, 2, tzinfo=UTC), tokens=60, requests=2)
    bucket(alpha, big, datetime(2026, 6, 3, tzinfo=UTC), tokens=40, requests=2, endpoint="seed")
    bucket(alpha, small, datetime(2026, 5, 30, tzinfo=UTC), tokens=10_000, requests=9)  # last month
    bucket(alpha, None, datetime(2026, 6, 4, tzinfo=UTC), tokens=20, requests=1)
    bucket(beta, other, datetime(2026, 6, 2, tzinfo=UTC), tokens=10_000, requests=9)

    found = top_keys(tenant=alpha, now=NOW)

    assert [(key.name, key.tokens, key.requests) for key in found] == [
        ("big", 100, 4),
        ("(no key)", 20, 1),
        ("small", 10, 1),
    ]
    assert found[0].prefix == big.prefix and found[1].api_key_id is None
    assert len(top_keys(tenant=alpha, now=NOW, limit=1)) == 1


def test_keys_annotated_with_month_usage_in_one_query(alpha, django_assert_num_queries):
    used, _ = api_key_create(tenant=alpha, name="used")
    api_key_create(tenant=alpha, name="idle")
    bucket(alpha, used, datetime(2026, 6, 2, tzinfo=UTC), tokens=60, requests=2)
    bucket(alpha, used, datetime(2026, 6, 3, tzinfo=UTC), tokens=40, requests=3, model="x")
    bucket(alpha, used, datetime(2026, 5, 3, tzinfo=UTC), tokens=1000, requests=30)

    with django_assert_num_queries(1):
        keys = {
            key.name: (key.tokens_this_month, key.requests_this_month)
            for key in api_keys_with_month_usage(ApiKey.objects.all(), now=NOW)
        }

    assert keys == {"used": (100, 5), "idle": (0, 0)}


def test_csv_rows(alpha):
    key, _ = api_key_create(tenant=alpha, name="=cmd|' /C calc'!A0")
    bucket(alpha, key, datetime(2026, 6, 2, 5, tzinfo=UTC), tokens=60, requests=2, inputs=4, succeeded=2,
           cached_inputs=1, cached_tokens=15, model_version="3", model_dtype="int8")  # fmt: skip
    # From before the variant was recorded.
    bucket(alpha, None, datetime(2026, 6, 2, 6, tzinfo=UTC), tokens=1, requests=1, failed=1)

    header, *rows = usage_csv_rows(UsageBucket.objects.order_by("hour"))

    assert header == USAGE_CSV_HEADER
    assert header[-2:] == ("model_version", "model_dtype")
    assert rows == [
        (
            *("2026-06-02T05:00:00Z", "alpha", key.public_id, "'=cmd|' /C calc'!A0", "m", "embeddings"),
            *(2, 2, 0, 0, 4, 60, 0, 1, 15, "3", "int8"),
        ),
        ("2026-06-02T06:00:00Z", "alpha", "", "", "m", "embeddings", 1, 0, 0, 1, 0, 1, 0, 0, 0, "", ""),
    ]


def test_spreadsheet_safe():
    assert [spreadsheet_safe(text) for text in ("ok", "-1", "+x", "@a", "a=b", "")] == [
        "ok",
        "'-1",
        "'+x",
        "'@a",
        "a=b",
        "",
    ]
