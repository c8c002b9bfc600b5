"""The operations overview through uvicorn as `make run` serves it (DEBUG off, collected static
files, two workers, a critical Redis and a job store with their limits) and in Debian's headless
Chromium: what it draws after real requests, 429s included, reached both workers.

Its Triton target lists two replicas, the test Triton and a port nothing listens on, so the page
shows one replica serving and one down. The in-process tests of every section are in
tests/admin/test_admin_overview.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port
from tests.admin.test_admin_overview import clear_of_a_minute_end
from tests.admin.test_browser import (
    SCREENSHOTS_DIR,
    _click_and_load,
    chromium,
    fresh_page,
    save_screenshot,
)
from tests.api.conftest import LiveServer, live_uvicorn
from tests.processes import DjangoShell, tenant_with_key

# As `make run` sizes them (RUNSTACK_REDIS_MAXMEMORY_MB, RUNSTACK_JOB_STORE_MAXMEMORY_MB).
CRITICAL_MAXMEMORY_MB, JOB_STORE_MAXMEMORY_MB = 256, 2048


@pytest.fixture(scope="module")
def redis_pair(tmp_path_factory) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A critical Redis and a job store of the server's own, with maxmemory, as `make run` starts them."""
    directory = tmp_path_factory.mktemp("overview-redis")
    critical = RedisServer(
        port=free_port(), data_dir=directory, persistent=False, maxmemory_mb=CRITICAL_MAXMEMORY_MB
    )
    jobs_directory = tmp_path_factory.mktemp("overview-redis-jobs")
    job_store = RedisServer(
        port=free_port(), data_dir=jobs_directory, persistent=False, maxmemory_mb=JOB_STORE_MAXMEMORY_MB
    )
    with critical, job_store:
        yield critical, job_store


@pytest.fixture(scope="module")
def overview_server(triton_server, redis_pair, tmp_path_factory) -> Iterator[LiveServer]:
    critical, job_store = redis_pair
    dead_replica = f"127.0.0.1:{free_port()}"
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("overview_server"),
        triton_target=f"{triton_server.grpc_target},{dead_replica}",
        redis_url=critical.url,
        workers=2,
        env={"DJANGO_DEBUG": "0", "JOB_STORE_URL": job_store.url},
        setup=[("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.com")],
        setup_env={"DJANGO_SUPERUSER_PASSWORD": "a-long-password"},
        as_shipped=True,
    ) as server:
        server.dead_replica = dead_replica
        yield server


# In the server's settings: a second catalog model Triton does not have, its requests of the last
# minute (four that succeeded in 10 to 40 ms, one that failed after 900 ms), counted by the settle
# script as a request's are; and six jobs, three of them still to run.
SCENE = """
import time
from datetime import timedelta
from django.utils import timezone
from embeddings.models import EmbeddingJob, EmbeddingModel, Tenant
from embeddings.services.quotas.activity import activity_counters
from embeddings.services.quotas.limits import quota_release_sync
from embeddings.services.quotas.usage import UsageEvent
EmbeddingModel.objects.create(name="bge-small", triton_model="bge_small", dimensions=384, max_tokens=512)
live = Tenant.objects.get(slug="live")
last_minute = time.time() - 60
for latency, outcome, tokens in ((10, "succeeded", 25), (20, "succeeded", 25), (30, "succeeded", 25),
                                 (40, "succeeded", 25), (900, "failed", 0)):
    event = UsageEvent(live.pk, None, "bge-small", "openai", outcome, 1, tokens, latency, at=last_minute)
    quota_release_sync(reservation=None, refund=False, usage=event, activity=activity_counters(event))
model = EmbeddingModel.objects.get(name="all-MiniLM-L6-v2")
now = timezone.now()
EmbeddingJob.objects.bulk_create(
    EmbeddingJob(public_id=f"job_scene{index:019d}", tenant=live, model=model, status=status, total=50,
                 created_at=now - timedelta(minutes=5 * (index + 1)))
    for index, status in enumerate(["queued", "queued", "running", "completed", "completed", "failed"])
)
"""


def embed(server: LiveServer, key: str, count: int) -> list[int]:
    statuses = []
    for index in range(count):
        response = httpx2.post(
            f"{server.base_url}/v1/embeddings",
            json={"model": "all-MiniLM-L6-v2", "input": f"overview text {index}"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        statuses.append(response.status_code)
    return statuses


def test_the_overview_is_behind_the_admins_login(overview_server):
    response = httpx2.get(f"{overview_server.base_url}/admin/operations/", timeout=30)
    assert response.status_code == 302
    assert response.headers["location"] == "/admin/login/?next=/admin/operations/"


def test_an_operator_reads_the_operations_overview(overview_server, tmp_path):
    env = {name: value for name, value in overview_server.env.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
    shell = DjangoShell(env, tmp_path / "shell.log")
    try:
        rated_key = tenant_with_key(shell, "rated", "--requests-per-minute", "1", name="Rated")
        # The scene's "last minute" is the page's: the browser starts and logs in within 30 s.
        clear_of_a_minute_end(30)
        shell.run(SCENE)
    finally:
        shell.close()
    # Real requests through both workers: Live's four pass, Rated's rate of one a minute refuses two.
    assert embed(overview_server, overview_server.api_key, 4) == [200] * 4
    assert embed(overview_server, rated_key, 3) == [200, 429, 429]

    with chromium() as browser, fresh_page(browser) as page:
        page.set_viewport_size({"width": 1600, "height": 1000})
        page.goto(f"{overview_server.base_url}/admin/")
        page.fill("#id_username", "root")
        page.fill("#id_password", "a-long-password")
        _click_and_load(page, "input[type=submit]")
        save_screenshot(page, "ops-overview-index")
        _click_and_load(page, "#operations-overview-link th a")
        assert page.url.endswith("/admin/operations/")
        assert page.locator("#content h1").inner_text() == "Operations overview"

        # Models: a column per replica, the dead one saying why; each model's state on each.
        replicas = page.locator("#model-table thead th.replica")
        assert replicas.count() == 2
        assert "unreachable (TritonUnavailable)" in replicas.nth(1).text_content()
        assert overview_server.dead_replica in replicas.nth(1).text_content()
        rows = page.locator("#model-table tbody tr.model-row")
        assert rows.locator("th").all_inner_texts() == ["all-MiniLM-L6-v2", "bge-small"]
        minilm, bge = rows.nth(0), rows.nth(1)
        assert minilm.locator("td.replica-state").all_inner_texts() == ["READY", "—"]
        assert bge.locator("td.replica-state").all_inner_texts() == ["not loaded", "—"]
        assert bge.locator("td.replica-state").first.get_attribute("title") == "not in Triton's repository"
        ready_colour = minilm.locator("td.state-ready").evaluate("cell => getComputedStyle(cell).color")
        assert ready_colour == "rgb(65, 118, 144)"  # drawn as the page's style says
        # bge-small's last minute, as the shell counted it.
        cells = {
            name: bge.locator(f"td.{name}").inner_text()
            for name in ("requests", "tokens", "errors", "p50", "p99")
        }
        assert cells == {"requests": "5", "tokens": "100", "errors": "1", "p50": "25 ms", "p99": "988 ms"}

        # A chart a model: eleven bars (ten minutes and this one), drawn to scale by the browser.
        charts = page.locator("#requests-charts svg")
        assert charts.count() == 2
        minilm_chart = page.locator('#requests-charts figure[data-model="all-MiniLM-L6-v2"] svg')
        bars = minilm_chart.locator("rect.bar")
        assert bars.count() == 11
        values = [int(value) for value in bars.evaluate_all("rects => rects.map(rect => rect.dataset.value)")]
        heights = bars.evaluate_all("rects => rects.map(rect => rect.getBBox().height)")
        assert sum(values) == 7  # every request of both workers, the refused ones too
        assert values[-2] == int(minilm.locator("td.requests").inner_text())  # the table's last minute
        tallest = max(range(11), key=lambda index: values[index])
        for value, height in zip(values, heights, strict=True):
            assert height == pytest.approx(heights[tallest] * value / values[tallest], abs=0.6)
        assert minilm_chart.bounding_box()["width"] > 300
        bge_values = page.locator('#requests-charts figure[data-model="bge-small"] rect.bar').evaluate_all(
            "rects => rects.map(rect => Number(rect.dataset.value))"
        )
        assert bge_values[-2] == 5 and sum(bge_values) == 5

        # Tenants: today's tokens (live counters: nothing is folded yet) and the last hour's 429s.
        top = page.locator("#top-tokens tbody tr")
        assert top.locator("th").all_inner_texts() == ["Live", "Rated"]
        tokens = [int(text.replace(",", "")) for text in top.locator("td.tokens").all_inner_texts()]
        assert tokens[0] > tokens[1] > 0
        tenant_bars = page.locator("svg#top-tenants-chart rect.bar")
        assert tenant_bars.count() == 2
        assert tenant_bars.evaluate_all("rects => rects.map(rect => rect.dataset.tenant)") == [
            "live",
            "rated",
        ]
        tenant_heights = tenant_bars.evaluate_all("rects => rects.map(rect => rect.getBBox().height)")
        assert tenant_heights[1] == pytest.approx(tenant_heights[0] * tokens[1] / tokens[0], abs=0.6)
        refused = page.locator("#top-refusals tbody tr")
        assert refused.count() == 1
        assert refused.locator("th").inner_text() == "Rated"
        assert refused.locator("td.refused").inner_text() == "2"
        assert refused.locator("td.limits").inner_text() == "requests_per_minute (tenant): 2"

        # The job backlog, and each Redis server against its maxmemory.
        backlog = page.locator("#backlog tbody tr")
        assert dict(
            zip(backlog.locator("th").all_inner_texts(), backlog.locator("td").all_inner_texts(), strict=True)
        ) == {
            "queued": "2",
            "running": "1",
            "cancelling": "0",
        }
        assert page.locator("#backlog-summary").inner_text().startswith("150 inputs still to embed")
        servers = page.locator("#redis-memory tbody tr")
        assert servers.locator("th").all_inner_texts() == [
            "critical (REDIS_URL)",
            "job store (JOB_STORE_URL)",
        ]
        assert servers.locator("td.limit").all_inner_texts() == ["256.0\xa0MB", "2.0\xa0GB"]
        assert servers.locator("td.policy").all_inner_texts() == ["noeviction", "noeviction"]
        assert servers.locator("meter").count() == 2
        SCREENSHOTS_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS_DIR / "ops-overview.png"), full_page=True)
        page.locator("#operations-models").scroll_into_view_if_needed()
        save_screenshot(page, "ops-overview-models")
