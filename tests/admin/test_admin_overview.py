"""The operations overview (embeddings/admin_overview.py) in process against the real Triton, Redis
pair and database: models with their Triton state and last minute, today's top tenants by tokens,
the last hour's refusals by limit (429s forced through the real quota script), the job backlog, the
Redis servers' memory, each source down on its own, and who may see the page. What the browser
draws: tests/admin/test_browser_overview.py."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from datetime import timedelta

import httpx2
import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from django.utils import timezone

from embeddings.models import EmbeddingJob, UsageBucket
from embeddings.redis.connections import redis_job_store, redis_sync, reset_redis_clients
from embeddings.services.inference.clients import reset_clients
from embeddings.services.quotas.activity import activity_counters
from embeddings.services.quotas.limits import quota_release_sync
from embeddings.services.quotas.reports import utc_day_start
from embeddings.services.quotas.usage import UsageEvent
from embeddings.tooling.triton_server import free_port
from tests.api import conftest as api_fixtures
from tests.api import test_express as express_tests

api_setup = api_fixtures.api_setup
# The express lane's answers, counted as they go.
lane_calls = express_tests.lane_calls
OVERVIEW = "admin-operations-overview"


def overview_page(client) -> tuple[object, str]:
    response = client.get(reverse(OVERVIEW))
    assert response.status_code == 200
    return response, response.content.decode()


def section(page: str, section_id: str) -> str:
    start = page.index(f'<section id="{section_id}">')
    return page[start : page.index("</section>", start)]


def settle(event: UsageEvent) -> None:
    """Counted as a request's settle counts it: usage and the minute's activity in one script."""
    quota_release_sync(reservation=None, refund=False, usage=event, activity=activity_counters(event))


def clear_of_a_minute_end(seconds: float = 10) -> None:
    """Sleep into the next minute when fewer than `seconds` are left of this one: what a test counts
    in "the last minute" and "now", then reads back, must not straddle a minute's end."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)


def requests_through_the_api(tenant, count: int, model: str = "all-MiniLM-L6-v2") -> list[int]:
    """POST /v1/embeddings `count` times to the real ASGI app; the status codes."""
    from embedsite.asgi import application

    async def send() -> list[int]:
        transport = httpx2.ASGITransport(app=application)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
            statuses = []
            for index in range(count):
                response = await http.post(
                    "/v1/embeddings", json={"model": model, "input": f"text {index}"}, headers=tenant.headers
                )
                statuses.append(response.status_code)
            return statuses

    return asyncio.run(send())


# --- Models ---------------------------------------------------------------------------------------


def test_each_model_shows_its_triton_state_and_last_minute(admin_client, api_setup):
    clear_of_a_minute_end()
    now = time.time()
    alpha = api_setup["alpha"].tenant
    for latency in (10, 20, 30, 40):
        settle(
            UsageEvent(alpha.pk, None, "all-MiniLM-L6-v2", "openai", "succeeded", 1, 25, latency, at=now - 60)
        )
    settle(UsageEvent(alpha.pk, None, "all-MiniLM-L6-v2", "openai", "failed", latency_ms=900, at=now - 60))
    statuses = requests_through_the_api(api_setup["alpha"], 3)  # this minute: the chart's last bar
    assert statuses == [200, 200, 200]

    response, page = overview_page(admin_client)
    (row,) = response.context["model_rows"]
    assert row["name"] == "all-MiniLM-L6-v2" and row["triton_model"] == "minilm" and row["version"] == "1"
    assert [cell["text"] for cell in row["replicas"]] == ["READY"]  # one Triton: one replica
    assert (row["requests"], row["tokens"], row["errors"], row["refused"]) == ("5", "100", "1", "0")
    # Ranks 2.5 and 4.95 of 5: halfway into 20-30 ms, and 95% into 750-1000 ms.
    assert (row["p50"], row["p99"]) == ("25 ms", "988 ms")
    models = section(page, "operations-models")
    assert 'class="replica-state state-ready" title="">READY</td>' in models
    # Requests a minute: ten complete minutes and the current one, the last minute's 5 and now's 3.
    bars = re.findall(r'<rect class="bar" data-minute="(\d\d:\d\d)" data-value="(\d+)"', models)
    assert len(bars) == 11
    assert [int(value) for _, value in bars][-2:] == [5, 3] and sum(int(value) for _, value in bars) == 8
    assert "Requests per minute: all-MiniLM-L6-v2" in models


def test_the_express_lane_and_the_views_both_feed_the_counters(api_setup, settings, lane_calls):
    """POST /v1/embeddings on the express lane and through the view, and TEI's /embed: each request
    is in the current minute's count, read as the overview reads it."""
    from embeddings.services.quotas.activity import recent_activity

    lane = lane_calls
    assert requests_through_the_api(api_setup["alpha"], 2) == [200, 200]
    assert len(lane) == 2
    settings.EXPRESS_EMBEDDINGS = False
    assert requests_through_the_api(api_setup["alpha"], 3) == [200] * 3
    assert len(lane) == 2  # the view answered these

    async def tei() -> int:
        from embedsite.asgi import application

        transport = httpx2.ASGITransport(app=application)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
            response = await http.post("/embed", json={"inputs": "hello"}, headers=api_setup["alpha"].headers)
            return response.status_code

    assert asyncio.run(tei()) == 200
    now = recent_activity()
    # Two minutes at most, should the requests straddle a minute's end.
    assert sum(minute.requests for minute in now.models["all-MiniLM-L6-v2"][-2:]) == 6


def test_a_triton_replica_that_does_not_answer_is_shown_as_such(admin_client, api_setup, settings):
    """Two replicas listed, one of them a port nothing listens on: its column says why, the other
    still answers; the page is a page, not a 500."""
    live = api_setup_triton_address(settings)
    settings.TRITON_GRPC_TARGET = f"ipv4:{live},127.0.0.1:{free_port()}"
    reset_clients()
    response, page = overview_page(admin_client)
    replicas = response.context["overview"].replicas
    assert replicas[0].endpoint == live and replicas[0].error == ""
    assert replicas[1].error == "unreachable (TritonUnavailable)"
    (row,) = response.context["model_rows"]
    assert [cell["text"] for cell in row["replicas"]] == ["READY", "—"]
    assert "unreachable (TritonUnavailable)" in section(page, "operations-models")


def api_setup_triton_address(settings) -> str:
    return settings.TRITON_GRPC_TARGET.removeprefix("ipv4:")


def test_triton_down_is_shown_down_and_the_rest_still_shows(admin_client, api_setup, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    reset_clients()
    settle(UsageEvent(api_setup["beta"].tenant.pk, None, "all-MiniLM-L6-v2", "openai", "succeeded", 1, 9, 5))
    response, page = overview_page(admin_client)
    (row,) = response.context["model_rows"]
    assert [cell["text"] for cell in row["replicas"]] == ["—"]
    assert "unreachable (TritonUnavailable)" in page
    assert response.context["overview"].tenants_by_tokens[0].tokens == 9  # the other sections answer


# --- Tenants --------------------------------------------------------------------------------------


def test_top_tenants_by_tokens_today_count_folded_rows_and_live_counters(admin_client, api_setup):
    alpha, beta = api_setup["alpha"].tenant, api_setup["beta"].tenant
    today = utc_day_start(timezone.now())
    for tenant, tokens in ((alpha, 4_000), (beta, 2_500)):
        UsageBucket.objects.create(
            tenant=tenant, model="all-MiniLM-L6-v2", endpoint="openai", hour=today, requests=4, tokens=tokens
        )
    # Yesterday's do not count today.
    UsageBucket.objects.create(
        tenant=beta, model="all-MiniLM-L6-v2", endpoint="openai", hour=today - timedelta(hours=1),
        requests=1, tokens=10**6,
    )  # fmt: skip
    # Beta's counters not yet folded put it ahead: 2,500 + 2,000 > 4,000.
    for _ in range(2):
        settle(UsageEvent(beta.pk, None, "all-MiniLM-L6-v2", "openai", "succeeded", 1, 1_000, 5))
    response, page = overview_page(admin_client)
    tenants = response.context["tenants_by_tokens"]
    assert [(row["name"], row["tokens"], row["requests"]) for row in tenants] == [
        ("Beta", "4,500", "6"),
        ("Alpha", "4,000", "4"),
    ]
    assert response.context["overview"].tokens_include_unfolded
    chart = section(page, "operations-tenants")
    bars = re.findall(r'<rect class="bar" data-tenant="([^"]+)" data-value="(\d+)"', chart)
    assert bars == [(beta.slug, "4500"), (alpha.slug, "4000")]


def test_refusals_by_limit_in_the_last_hour_after_429s(admin_client, api_setup):
    """Alpha's request rate of one a minute (burst 1), and Beta's key's day budget of 5 tokens: real
    requests through the API and the real reserve script, refused with 429 for each."""
    alpha = api_setup["alpha"]
    alpha.tenant.requests_per_minute, alpha.tenant.request_burst = 1, 1
    alpha.tenant.save(update_fields=["requests_per_minute", "request_burst"])
    assert requests_through_the_api(alpha, 3) == [200, 429, 429]
    beta = api_setup["beta"]
    beta.api_key.tokens_per_day = 5  # a request of "text N" is 4 tokens: the first fits, no other
    beta.api_key.save(update_fields=["tokens_per_day"])
    time.sleep(0.3)  # the key cache (API_KEY_CACHE_SECONDS, 0.2 s in tests) reads the new limit
    assert requests_through_the_api(beta, 4)[1:] == [429, 429, 429]

    response, page = overview_page(admin_client)
    refused = {
        row["name"]: (row["refused"], row["by_limit"]) for row in response.context["tenants_by_refusals"]
    }
    assert refused == {
        "Beta": ("3", [("key", "tokens_per_day", "3")]),
        "Alpha": ("2", [("tenant", "requests_per_minute", "2")]),
    }
    assert list(refused) == ["Beta", "Alpha"]  # most refused first
    tenants = section(page, "operations-tenants")
    assert (
        '<span class="limit" data-limit="tokens_per_day" data-level="key">tokens_per_day (key): 3</span>'
        in tenants
    )
    # The model's row counts the refusals of its last full minute; these are in its last bars.
    assert sum(minute.refused for minute in response.context["overview"].models[0].minutes[-2:]) == 5


# --- Jobs and Redis -------------------------------------------------------------------------------


def test_the_job_backlog_by_state(admin_client, api_setup):
    alpha, model = api_setup["alpha"].tenant, api_setup["model"]
    now = timezone.now()
    states = ["queued"] * 3 + ["running"] * 2 + ["cancelling"] + ["completed"] * 5 + ["failed"]
    EmbeddingJob.objects.bulk_create(
        EmbeddingJob(
            public_id=f"job_backlog{index:017d}", tenant=alpha, model=model, status=status, total=100,
            completed=40 if status == "running" else 0, created_at=now - timedelta(minutes=10 + index),
        )
        for index, status in enumerate(states)
    )  # fmt: skip
    response, page = overview_page(admin_client)
    rows = {row["status"]: row["jobs"] for row in response.context["backlog_rows"]}
    assert rows == {"queued": "3", "running": "2", "cancelling": "1"}
    jobs = section(page, "operations-jobs")
    assert 'href="/admin/embeddings/embeddingjob/?status=queued"' in jobs
    # 6 active jobs of 100 inputs, 2 of them 40 done; the oldest active one is the 6th (15 minutes).
    assert "520 inputs still to embed" in jobs and "submitted 15\xa0minutes ago" in jobs


def test_each_redis_servers_memory_against_its_limit(admin_client, api_setup):
    redis_job_store().config_set("maxmemory", 64 * 1024 * 1024)
    try:
        response, page = overview_page(admin_client)
    finally:
        redis_job_store().config_set("maxmemory", 0)
    rows = {row["role"]: row for row in response.context["redis_rows"]}
    assert set(rows) == {"critical (REDIS_URL)", "job store (JOB_STORE_URL)"}
    critical, job_store = rows["critical (REDIS_URL)"], rows["job store (JOB_STORE_URL)"]
    assert critical["used"] == int(redis_sync().info("memory")["used_memory"]) or critical["used"] > 0
    assert critical["max"] == 0 and critical["percent"] is None
    assert job_store["max"] == 64 * 1024 * 1024 and job_store["policy"] == "noeviction"
    assert float(job_store["percent"]) == pytest.approx(100 * job_store["used"] / (64 * 1024 * 1024), abs=0.1)
    redis = section(page, "operations-redis")
    assert "64.0\xa0MB" in redis and "no limit set" in redis and "<meter" in redis


def test_one_server_for_both_roles_is_one_row(admin_client, api_setup, settings):
    settings.JOB_STORE_URL = ""
    reset_redis_clients()
    response, _ = overview_page(admin_client)
    assert [row["role"] for row in response.context["redis_rows"]] == ["critical and job store (one server)"]


def test_each_source_down_shows_in_its_own_section(admin_client, api_setup, settings):
    """The critical Redis refused, the job store silent (a socket that never answers): the page
    comes within READY_CHECK_TIMEOUT_S, says which, and shows the database's sections."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
        settings.JOB_STORE_URL = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        settings.JOB_STORE_TIMEOUT_S = 30
        settings.READY_CHECK_TIMEOUT_S = 0.5
        reset_redis_clients()
        UsageBucket.objects.create(
            tenant=api_setup["alpha"].tenant, model="all-MiniLM-L6-v2", endpoint="openai",
            hour=utc_day_start(timezone.now()), requests=1, tokens=77,
        )  # fmt: skip
        started = time.monotonic()
        response, page = overview_page(admin_client)
        assert time.monotonic() - started < 5  # a bound on hanging: the silent server is not waited for
    finally:
        silent.close()
    rows = {row["role"]: row["error"] for row in response.context["redis_rows"]}
    assert rows == {
        "critical (REDIS_URL)": "failed: ConnectionError",
        "job store (JOB_STORE_URL)": "no answer within 0.5 s",
    }
    assert "The activity counters (critical Redis) could not be read: failed: ConnectionError" in page
    assert "these are the folded usage rows only" in page
    assert [row["tokens"] for row in response.context["tenants_by_tokens"]] == ["77"]
    (row,) = response.context["model_rows"]
    assert [cell["text"] for cell in row["replicas"]] == ["READY"]


# --- Who may see it -------------------------------------------------------------------------------


def test_staff_who_may_view_tenants_see_it_and_the_index_links_it(client, api_setup):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename="view_tenant"))
    client.force_login(viewer)
    assert client.get(reverse(OVERVIEW)).status_code == 200
    index = client.get(reverse("admin:index")).content.decode()
    assert f'<a href="{reverse(OVERVIEW)}">Operations overview</a>' in index


def test_other_staff_are_refused_and_anyone_else_sent_to_log_in(client, api_setup):
    User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(User.objects.get(username="staff"))
    assert client.get(reverse(OVERVIEW)).status_code == 403
    assert "Operations overview" not in client.get(reverse("admin:index")).content.decode()
    User.objects.create_user("customer", password="pw")
    client.force_login(User.objects.get(username="customer"))
    response = client.get(reverse(OVERVIEW))
    assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))
    client.logout()
    response = client.get(reverse(OVERVIEW))
    assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))
