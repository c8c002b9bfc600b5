"""The admin's quotas and usage: tenant page numbers and charts, key usage columns, the usage list and CSV."""

from __future__ import annotations

import csv
import io
import re
import threading
import warnings
from datetime import timedelta

import httpx2
import pytest
from django.db import connection
from django.db.models import Sum
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from embeddings.models import UsageBucket
from embeddings.services.accounts.api_keys import api_key_create
from embeddings.services.quotas.reports import USAGE_CSV_HEADER, utc_day_start
from embeddings.tooling.triton_server import free_port
from tests.factories import usage_bucket

pytestmark = pytest.mark.django_db


def bucket(tenant, api_key, hour, *, requests=0, **counters):
    """Usage whose requests all succeeded."""
    return usage_bucket(tenant, api_key, hour, requests=requests, succeeded=requests, **counters)


def bars(page: str, chart_id: str) -> list[tuple[str, int]]:
    svg = re.search(rf'<svg [^>]*id="{chart_id}".*?</svg>', page, re.S).group(0)
    return [(day, int(value)) for day, value in re.findall(r'data-day="([\d-]+)" data-value="(\d+)"', svg)]


def test_tenant_page_shows_this_months_usage_against_its_quotas(admin_client, alpha, beta):
    alpha.tokens_per_month, alpha.tokens_per_day = 1_000_000, 10_000
    alpha.save(update_fields=["tokens_per_month", "tokens_per_day"])
    busy, _ = api_key_create(tenant=alpha, name="busy-key")
    quiet, _ = api_key_create(tenant=alpha, name="quiet-key")
    today = utc_day_start(timezone.now())
    bucket(alpha, busy, today, tokens=2500, requests=10)
    bucket(alpha, quiet, today, tokens=500, requests=4, endpoint="seed")
    bucket(beta, None, today, tokens=999_999, requests=999)

    page = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk])).content.decode()

    month_row = re.search(r'<tr data-window="tokens_per_month">.*?</tr>', page, re.S).group(0)
    assert '<td class="tokens-used">3,000</td>' in month_row
    assert '<td class="tokens-limit">1,000,000</td>' in month_row
    assert "0.3%" in month_row and '<td class="requests">14</td>' in month_row
    day_row = re.search(r'<tr data-window="tokens_per_day">.*?</tr>', page, re.S).group(0)
    assert "3,000" in day_row and "10,000" in day_row and "30.0%" in day_row
    top = re.search(r'<table id="usage-top-keys">.*?</table>', page, re.S).group(0)
    assert top.index("busy-key") < top.index("quiet-key") and "2,500" in top
    assert "999,999" not in page

    tokens = bars(page, "usage-tokens-chart")
    requests = bars(page, "usage-requests-chart")
    assert len(tokens) == len(requests) == 30
    assert tokens[-1] == (f"{today:%Y-%m-%d}", 3000) and requests[-1] == (f"{today:%Y-%m-%d}", 14)
    assert all(value == 0 for _, value in tokens[:-1])
    assert tokens[0][0] == f"{today - timedelta(days=29):%Y-%m-%d}"


def test_tenant_without_limits_or_usage(admin_client, alpha):
    page = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk])).content.decode()

    assert '<td class="tokens-limit">unlimited</td>' in page
    assert "No usage this month." in page
    assert len(bars(page, "usage-tokens-chart")) == 30


def test_tenant_page_renders_when_redis_is_down(admin_client, alpha, settings):
    from embeddings.redis.connections import reset_redis_clients

    alpha.requests_per_minute = 10  # a windowed limit, so the live state must ask Redis
    alpha.save(update_fields=["requests_per_minute"])
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    reset_redis_clients()
    try:
        response = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk]))
    finally:
        reset_redis_clients()

    assert response.status_code == 200
    page = response.content.decode()
    assert "Live quota state unavailable" in page
    assert len(bars(page, "usage-tokens-chart")) == 30


def test_tenant_quotas_are_editable_and_blank_means_unlimited(admin_client, alpha):
    url = reverse("admin:embeddings_tenant_change", args=[alpha.pk])
    page = admin_client.get(url).content.decode()
    assert "Quotas" in page and "Blank: unlimited" in page

    response = admin_client.post(
        url,
        {
            "name": "Alpha",
            "slug": "alpha",
            "is_active": "on",
            "allow_all_models": "on",
            "requests_per_minute": "50",
            "tokens_per_month": "1000000",
            "tokens_per_day": "",
            "api_keys-TOTAL_FORMS": "0",
            "api_keys-INITIAL_FORMS": "0",
        },
    )

    assert response.status_code == 302, response.content.decode()[:2000]
    alpha.refresh_from_db()
    assert alpha.requests_per_minute == 50 and alpha.tokens_per_month == 1_000_000
    assert alpha.tokens_per_day is None and alpha.max_concurrent_requests is None


def test_a_burst_without_its_rate_is_a_form_error_not_saved(admin_client, alpha):
    url = reverse("admin:embeddings_tenant_change", args=[alpha.pk])
    form = {
        "name": "Alpha",
        "slug": "alpha",
        "is_active": "on",
        "allow_all_models": "on",
        "request_burst": "50",
        "token_burst": "1000",
        "tokens_per_minute": "",
        "api_keys-TOTAL_FORMS": "0",
        "api_keys-INITIAL_FORMS": "0",
    }
    response = admin_client.post(url, form)
    assert response.status_code == 200
    page = response.content.decode()
    assert "A burst needs a request rate (per second or per minute)." in page
    assert "A burst needs a token rate (tokens per minute)." in page
    alpha.refresh_from_db()
    assert alpha.request_burst is None and alpha.token_burst is None

    response = admin_client.post(url, form | {"requests_per_second": "80", "tokens_per_minute": "150000"})
    assert response.status_code == 302, response.content.decode()[:2000]
    alpha.refresh_from_db()
    assert (alpha.requests_per_second, alpha.request_burst, alpha.token_burst) == (80, 50, 1000)


def test_key_quota_overrides_are_editable(admin_client, alpha):
    api_key, _ = api_key_create(tenant=alpha, name="ci")
    url = reverse("admin:embeddings_apikey_change", args=[api_key.pk])
    page = admin_client.get(url).content.decode()
    assert "Quota overrides" in page and "UTC day. Blank: the tenant's limits only." in page

    response = admin_client.post(
        url, {"name": "ci", "tokens_per_minute": "5000", "max_inputs_per_request": ""}
    )

    assert response.status_code == 302
    api_key.refresh_from_db()
    assert api_key.tokens_per_minute == 5000 and api_key.max_inputs_per_request is None


def test_key_list_shows_last_use_and_this_months_usage_without_a_query_per_key(admin_client, alpha, beta):
    used, _ = api_key_create(tenant=alpha, name="used-key")
    used.last_used_at = timezone.now()
    used.save(update_fields=["last_used_at"])
    now = timezone.now()
    bucket(alpha, used, utc_day_start(now), tokens=12_345, requests=7)
    bucket(alpha, used, utc_day_start(now).replace(day=1) - timedelta(hours=1), tokens=1, requests=1)
    changelist = reverse("admin:embeddings_apikey_changelist")

    response = admin_client.get(changelist)
    row = {key.name: key for key in response.context["cl"].result_list}["used-key"]
    assert (row.tokens_this_month, row.requests_this_month) == (12_345, 7)
    assert "12,345" in response.content.decode()

    with CaptureQueriesContext(connection) as few:
        admin_client.get(changelist)
    for number in range(10):
        key, _ = api_key_create(tenant=beta, name=f"more-{number}")
        bucket(beta, key, utc_day_start(now), tokens=number, requests=1)
    with CaptureQueriesContext(connection) as many:
        admin_client.get(changelist)
    assert len(many) == len(few)


@pytest.fixture
def usage_rows(alpha, beta):
    alpha_key, _ = api_key_create(tenant=alpha, name="alpha-key")
    beta_key, _ = api_key_create(tenant=beta, name="beta-key")
    hour = utc_day_start(timezone.now())
    return [
        bucket(alpha, alpha_key, hour, tokens=10, requests=1),
        bucket(
            alpha,
            alpha_key,
            hour,
            tokens=20,
            requests=2,
            model="other-model",
            model_version="3",
            model_dtype="int8",
        ),
        bucket(alpha, alpha_key, hour - timedelta(days=40), tokens=30, requests=3),
        bucket(beta, beta_key, hour, tokens=40, requests=4),
    ]


def csv_rows(response) -> list[dict]:
    body = b"".join(response).decode()  # the admin's async pieces, read as a sync client would
    return list(csv.DictReader(io.StringIO(body)))


def test_usage_list_filters_and_is_read_only(admin_client, usage_rows, alpha):
    changelist = reverse("admin:embeddings_usagebucket_changelist")

    everything = admin_client.get(changelist)
    assert everything.context["cl"].result_count == 4
    by_tenant_and_model = admin_client.get(
        changelist, {"tenant__id__exact": alpha.pk, "model": "other-model"}
    )
    assert [row.tokens for row in by_tenant_and_model.context["cl"].result_list] == [20]
    by_dtype = admin_client.get(changelist, {"model_dtype": "int8"})
    assert [(row.tokens, row.model_version) for row in by_dtype.context["cl"].result_list] == [(20, "3")]
    by_key = admin_client.get(changelist, {"api_key__id__exact": usage_rows[3].api_key_id})
    assert [row.tokens for row in by_key.context["cl"].result_list] == [40]
    this_year = usage_rows[0].hour.year
    by_date = admin_client.get(changelist, {"hour__year": this_year, "hour__month": usage_rows[0].hour.month})
    assert 30 not in [row.tokens for row in by_date.context["cl"].result_list]

    page = everything.content.decode()
    assert "delete_selected" not in page and "export_csv" in page
    assert admin_client.get(reverse("admin:embeddings_usagebucket_add")).status_code == 403
    change = admin_client.get(reverse("admin:embeddings_usagebucket_change", args=[usage_rows[0].pk]))
    assert change.status_code == 200 and 'name="tokens"' not in change.content.decode()


def test_csv_download_link_keeps_the_filters(admin_client, usage_rows, alpha):
    changelist = reverse("admin:embeddings_usagebucket_changelist")
    page = admin_client.get(changelist, {"tenant__id__exact": alpha.pk, "q": "alpha"}).content.decode()
    link = re.search(r'<a id="usage-csv-link" href="([^"]+)"', page).group(1).replace("&amp;", "&")
    assert link.startswith(reverse("admin:embeddings_usagebucket_csv"))

    response = admin_client.get(link)

    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = csv_rows(response)
    assert sorted(int(row["tokens"]) for row in rows) == [10, 20, 30]
    assert {row["tenant"] for row in rows} == {"alpha"}
    assert list(rows[0]) == list(USAGE_CSV_HEADER)
    variants = sorted((row["model_version"], row["model_dtype"]) for row in rows)
    assert variants == [("", ""), ("", ""), ("3", "int8")]


def test_csv_of_everything_and_of_selected_rows(admin_client, usage_rows):
    everything = admin_client.get(reverse("admin:embeddings_usagebucket_csv"))
    assert sorted(int(row["tokens"]) for row in csv_rows(everything)) == [10, 20, 30, 40]

    selected = admin_client.post(
        reverse("admin:embeddings_usagebucket_changelist"),
        {"action": "export_csv", "_selected_action": [usage_rows[1].pk, usage_rows[3].pk]},
    )
    assert sorted(int(row["tokens"]) for row in csv_rows(selected)) == [20, 40]

    bad = admin_client.get(reverse("admin:embeddings_usagebucket_csv"), {"no_such_field__exact": "1"})
    assert bad.status_code == 400


def test_csv_needs_permission_to_view_usage(client, usage_rows):
    from django.contrib.auth.models import User

    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(staff)
    assert client.get(reverse("admin:embeddings_usagebucket_csv")).status_code == 403


def test_tenant_add_page_has_quotas_and_no_usage(admin_client):
    page = admin_client.get(reverse("admin:embeddings_tenant_add")).content.decode()
    assert 'name="tokens_per_month"' in page and 'id="tenant-usage"' not in page


@pytest.mark.django_db(transaction=True)
async def test_csv_streamed_over_asgi_is_one_snapshot_while_a_fold_commits(
    alpha, service_redis, monkeypatch, postgresql_only
):
    """The CSV as the admin serves it under uvicorn (the ASGI app, autocommit: the queryset is read
    through a PostgreSQL server-side cursor in chunks of 2,000, sent in pieces as it is read): more
    rows than a chunk, every one once, and a usage fold that commits while the CSV is half written
    changes none of its rows."""
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import User
    from django.test import Client

    from embeddings import admin as embeddings_admin
    from embeddings.services.quotas.limits import quota_release_sync
    from embeddings.services.quotas.usage import UsageEvent, usage_fold
    from embedsite.asgi import application

    @sync_to_async
    def prepare() -> str:
        start = utc_day_start(timezone.now()) - timedelta(hours=3000)
        UsageBucket.objects.bulk_create(
            UsageBucket(
                tenant=alpha, model="m", endpoint="embeddings", hour=start + timedelta(hours=n), tokens=1
            )
            for n in range(2500)
        )
        admin_user = User.objects.create_superuser("csvadmin", "csv@example.com", "a-long-password")
        browser = Client()
        browser.force_login(admin_user)
        return browser.cookies["sessionid"].value

    session = await prepare()
    latest = await UsageBucket.objects.order_by("-hour").afirst()
    original_rows = embeddings_admin.usage_csv_rows
    folded = []

    def fold_and_close():
        try:
            folded.append(usage_fold())
        finally:
            connection.close()

    def rows_with_a_fold_half_way(queryset):
        for index, row in enumerate(original_rows(queryset)):
            if index == 2100:  # the second chunk is fetched after the fold
                # Every row's tokens +1000, committed by a fold in its own thread and connection.
                for bucket in UsageBucket.objects.order_by("hour").values_list("hour", flat=True)[2050:]:
                    at = bucket.timestamp()
                    quota_release_sync(
                        reservation=None,
                        refund=False,
                        usage=UsageEvent(alpha.pk, None, "m", "embeddings", "succeeded", 1, 1000, 1, at),
                    )
                fold = threading.Thread(target=lambda: folded.append(usage_fold()))
                fold.start()
                fold.join(timeout=60)
            yield row

    monkeypatch.setattr(embeddings_admin, "usage_csv_rows", rows_with_a_fold_half_way)
    transport = httpx2.ASGITransport(app=application)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://testserver", cookies={"sessionid": session}
        ) as http:
            response = await http.get(reverse("admin:embeddings_usagebucket_csv"), timeout=120)
    # Django warns when it must read a whole sync iterator into memory first (not streamed).
    assert not [warning for warning in caught if "consume synchronous iterators" in str(warning.message)]
    assert response.status_code == 200, response.text[:500]
    assert folded and folded[0].buckets == 450
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert len(rows) == 2500 and len({row["hour_utc"] for row in rows}) == 2500
    assert {row["tokens"] for row in rows} == {"1"}  # the snapshot from before the fold
    assert latest.hour.strftime("%Y-%m-%dT%H:%M:%SZ") in {row["hour_utc"] for row in rows}
    total = await UsageBucket.objects.aaggregate(tokens=Sum("tokens"))
    assert total["tokens"] == 2500 + 450 * 1000
    await sync_to_async(lambda: connection.close())()
