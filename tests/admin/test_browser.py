"""The admin and the API docs in a real browser: Debian's headless Chromium driven by Playwright
against a live server (the docs and the admin's stylesheet: uvicorn as `make run` starts it).

Setup installs `chromium` (Makefile SYSTEM_PACKAGES) and Playwright (requirements-test.txt); we use
the system browser, never Playwright's own downloads. If the browser cannot start, the test fails
and says why: it is never skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator

import httpx2
import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from embeddings.models import UsageBucket
from embeddings.services.accounts.api_keys import api_key_create
from embeddings.services.accounts.tenants import tenant_create
from embeddings.services.quotas.reports import utc_day_start
from tests.api.conftest import LiveServer, live_uvicorn
from tests.processes import REPO_ROOT, DjangoShell, tenant_with_key

BROWSER_TIMEOUT_MS = 20_000
FULL_KEY = re.compile(r"emb_[a-z0-9]{12}_[A-Za-z0-9_-]{20,100}")


@contextlib.contextmanager
def chromium() -> Iterator:
    """Debian's Chromium under Playwright, closed after; the test fails, saying why, if it cannot start."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        pytest.fail(f"Playwright is not installed ({error}): `make setup` installs requirements-test.txt")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(
            "No `chromium` on PATH: `make setup` installs Debian's chromium (SYSTEM_PACKAGES)", pytrace=False
        )
    with sync_playwright() as playwright:
        try:
            # Root (CI, containers) cannot use Chromium's sandbox; --disable-dev-shm-usage: small /dev/shm.
            browser = playwright.chromium.launch(
                executable_path=executable,
                headless=True,
                args=["--no-sandbox", "--disable-dev-shm-usage"] if os.geteuid() == 0 else [],
                timeout=BROWSER_TIMEOUT_MS,
            )
        except Exception as error:
            pytest.fail(f"Chromium ({executable}) did not start under Playwright: {error}", pytrace=False)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def fresh_page(browser) -> Iterator:
    """A page in a browser context of its own: no cookie or cache of another test's."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(BROWSER_TIMEOUT_MS)
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def browser_page() -> Iterator:
    """A browser of the test's own: the tests that set up database rows first need one, since Django
    refuses ORM calls from this thread once Playwright's event loop runs in it."""
    with chromium() as browser, fresh_page(browser) as page:
        yield page


@pytest.fixture
def tenant_with_usage(transactional_db):
    tenant = tenant_create(name="Acme")
    tenant.tokens_per_month = 100_000
    tenant.save(update_fields=["tokens_per_month"])
    api_key, _ = api_key_create(tenant=tenant, name="acme-batch")
    today = utc_day_start(timezone.now())
    for hour in (today, today.replace(hour=1)):
        UsageBucket.objects.create(
            tenant=tenant, api_key=api_key, model="all-MiniLM-L6-v2", endpoint="embeddings", hour=hour,
            requests=3, succeeded=3, inputs=6, tokens=2_500, cached_inputs=2, cached_tokens=800,
        )  # fmt: skip
    User.objects.create_superuser("root", "root@example.com", "a-long-password")
    return tenant


def _click_and_load(page, selector: str) -> None:
    """Click what leads to another page, and return once that page has loaded.

    A bare click returns as soon as the next page starts to arrive; on a busy machine its body is
    then not parsed yet, and a locator's count() (which does not wait) reads the empty page.
    """
    with page.expect_navigation():
        page.click(selector)


def test_log_in_see_the_usage_chart_and_create_a_key(live_server, tenant_with_usage, browser_page):
    # Everything is checked through the browser: Django refuses ORM calls from this thread once
    # Playwright's event loop runs in it (the database is set up before the browser starts).
    page = browser_page
    tenant_url = live_server.url + reverse("admin:embeddings_tenant_change", args=[tenant_with_usage.pk])

    page.goto(tenant_url)  # not logged in: the admin sends us to its login page
    assert "/admin/login/" in page.url
    page.fill("#id_username", "root")
    page.fill("#id_password", "a-long-password")
    page.click("input[type=submit]")
    page.wait_for_url(tenant_url)

    month = page.locator('tr[data-window="tokens_per_month"]')
    assert month.locator("td.tokens-used").inner_text() == "5,000"
    assert month.locator("td.tokens-limit").inner_text() == "100,000"
    assert month.locator(".tokens-percent").inner_text() == "5.0%"
    assert month.locator("td.requests").inner_text() == "6"
    assert "acme-batch" in page.locator("#usage-top-keys").inner_text()
    cached = page.locator("#usage-cached")
    assert cached.is_visible()
    assert cached.inner_text() == "4 of them (1,600 tokens) answered from the embedding cache"
    shared = page.locator("#id_shared_embedding_cache")
    assert shared.is_visible() and not shared.is_checked()
    page.goto(live_server.url + reverse("admin:embeddings_usagebucket_changelist"))
    assert page.locator("#result_list th.column-cached_tokens").text_content().strip() == "Cached tokens"
    assert page.locator("#result_list td.field-cached_tokens").all_inner_texts() == ["800", "800"]
    page.goto(tenant_url)

    for chart_id in ("usage-tokens-chart", "usage-requests-chart"):
        chart = page.locator(f"svg#{chart_id}")
        assert chart.is_visible()
        assert chart.bounding_box()["width"] > 300  # laid out by the browser, not just in the HTML
        bars = chart.locator("rect.bar")
        assert bars.count() == 30
        # The browser drew today's bar (the last) with height, and the idle days flat.
        heights = bars.evaluate_all("rects => rects.map(rect => rect.getBBox().height)")
        assert heights[-1] > 0 and all(height == 0 for height in heights[:-1])
    assert "Tokens per day" in page.locator("svg#usage-tokens-chart > title").text_content()

    _click_and_load(page, "text=Create an API key for this tenant")
    page.fill("#id_name", "made-in-a-browser")
    _click_and_load(page, "input[name=_save]")
    shown = page.locator("#new-api-key").inner_text()
    assert FULL_KEY.fullmatch(shown)
    assert "shown only this once" in page.content()

    # The key list now has it, for this tenant, by the prefix of the key just shown; the full key is
    # on no other page.
    page.goto(live_server.url + reverse("admin:embeddings_apikey_changelist") + "?q=made-in-a-browser")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    row_text = rows.first.inner_text()
    assert "Acme" in row_text and shown[: len("emb_") + 13] in row_text
    page.goto(tenant_url)
    assert "made-in-a-browser" in page.locator(".inline-group").inner_text()
    assert shown not in page.content()


WEBHOOK_SECRET = re.compile(r"whsec_[A-Za-z0-9_-]{20,}")


def _log_in(page, live_server, password: str = "a-long-password") -> None:
    page.goto(live_server.url + reverse("admin:login"))
    page.fill("#id_username", "root")
    page.fill("#id_password", password)
    _click_and_load(page, "input[type=submit]")


def test_rotate_a_webhook_secret_and_see_it_once(live_server, tenant_with_usage, browser_page, tmp_path):
    page = browser_page
    _log_in(page, live_server)
    page.goto(live_server.url + reverse("admin:embeddings_tenant_changelist"))
    page.check("#result_list tbody tr input.action-select")
    page.select_option("select[name=action]", "rotate_webhook_secrets")
    _click_and_load(page, "button[name=index]")
    secret = page.locator("code.new-webhook-secret")
    assert secret.count() == 1 and secret.is_visible()
    shown = secret.inner_text()
    assert WEBHOOK_SECRET.fullmatch(shown)
    assert "shown only this once" in page.content()
    page.screenshot(path=str(tmp_path / "webhook-secret-rotated.png"), full_page=True)
    # The tenant page shows a fingerprint of it, never the secret.
    page.goto(live_server.url + reverse("admin:embeddings_tenant_change", args=[tenant_with_usage.pk]))
    assert "fingerprint" in page.locator(".field-webhook_secret_status").inner_text()
    assert shown not in page.content()


@pytest.fixture
def unloaded_copy(transactional_db, explicit_triton) -> None:
    """A second model registered, disabled and not loaded (before the browser: no ORM calls after)."""
    from embeddings.services.inference.catalog import embedding_model_register

    embedding_model_register(triton_model="minilm_copy", name="copy", enabled=False)


def test_load_a_model_into_triton_from_the_changelist(
    live_server, tenant_with_usage, unloaded_copy, browser_page, tmp_path
):
    page = browser_page
    _log_in(page, live_server)
    page.goto(live_server.url + reverse("admin:embeddings_embeddingmodel_changelist"))
    row = page.locator("#result_list tbody tr", has_text="copy")
    # What each model answers, and whether it also ranks documents by similarity.
    assert row.locator("td.field-task").inner_text() == "Embedding"
    assert row.locator("td.field-rerank_by_similarity img").get_attribute("alt") == "False"
    # "not loaded", or UNAVAILABLE when this Triton unloaded it before.
    assert row.locator("td.field-triton_state").inner_text().split()[0] in {"not", "UNAVAILABLE"}
    row.locator("input.action-select").check()
    page.select_option("select[name=action]", "load_into_triton")
    _click_and_load(page, "button[name=index]")
    # The admin capitalises its messages' first letter.
    message = page.locator(".messagelist").inner_text().strip()
    assert message == "Copy: Triton model minilm_copy version 1 is loaded and serving."
    row = page.locator("#result_list tbody tr", has_text="copy")
    assert row.locator("td.field-triton_state").inner_text() == "READY"
    page.screenshot(path=str(tmp_path / "models-loaded.png"), full_page=True)


def test_repeated_wrong_passwords_lock_the_login(
    live_server, tenant_with_usage, browser_page, settings, tmp_path
):
    page = browser_page
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        _log_in(page, live_server, password="wrong")
        assert "Please enter the correct username and password" in page.content()
    _log_in(page, live_server, password="wrong")
    assert "Too many failed logins" in page.locator(".errornote").inner_text()
    page.screenshot(path=str(tmp_path / "login-locked-out.png"), full_page=True)
    # Even the right password is refused now.
    _log_in(page, live_server)
    assert "Too many failed logins" in page.content()
    assert "/admin/login/" in page.url


# --- What a person sees, served by uvicorn as `make run` starts it ---------------------------------
# Screenshots land here for a person to look at after a run (`.run/` is never committed).
SCREENSHOTS_DIR = REPO_ROOT / ".run" / "screenshots"
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
# Colours only the stylesheets give: unstyled, each of these elements is transparent.
ADMIN_HEADER_BACKGROUND = "rgb(65, 118, 144)"  # Django admin's --header-bg (#417690)
SWAGGER_METHOD_BACKGROUNDS = {"POST": "rgb(73, 204, 144)", "GET": "rgb(97, 175, 254)"}


@pytest.fixture(scope="module")
def docs_server(triton_server, redis_server, tmp_path_factory) -> Iterator[LiveServer]:
    """uvicorn as `make run` starts it: DEBUG off, static files from what `make setup` collected
    (served by WhiteNoise, no test helper in between), and a superuser in its database."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("docs_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        # Its jobs' chunks go to a Redis database no test's worker reads: the jobs test runs them.
        env={"DJANGO_DEBUG": "0", "CELERY_BROKER_URL": redis_server.url.rsplit("/", 1)[0] + "/14"},
        setup=[("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.com")],
        setup_env={"DJANGO_SUPERUSER_PASSWORD": "a-long-password"},
        as_shipped=True,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def docs_browser() -> Iterator:
    """One browser for the tests below, which make no ORM call: each gets a fresh context of it.
    Started at the first of them, after the tests above have closed theirs (file order)."""
    with chromium() as browser:
        yield browser


@pytest.fixture
def docs_page(docs_browser) -> Iterator:
    with fresh_page(docs_browser) as page:
        yield page


@pytest.fixture
def static_responses(docs_page) -> list:
    """Every /static/ response the page gets from here on."""
    responses: list = []
    docs_page.on("response", lambda response: "/static/" in response.url and responses.append(response))
    return responses


def assert_static_served(responses: list) -> None:
    """Each file the page asked for came back, by its content-hashed name, cacheable for a year."""
    assert responses, "the page loaded no static file"
    for response in responses:
        assert response.status == 200, f"{response.url}: {response.status}"
        cache_control = response.headers.get("cache-control", "")
        assert "immutable" in cache_control and "max-age=315360000" in cache_control, (
            f"{response.url}: {cache_control!r}"
        )


def save_screenshot(page, name: str) -> None:
    SCREENSHOTS_DIR.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS_DIR / f"{name}.png"), full_page=False)


def schema_operations(server: LiveServer) -> dict[tuple[str, str], str]:
    """(METHOD, path) -> operationId of every operation the served schema describes."""
    schema = httpx2.get(f"{server.base_url}/api/schema/?format=json", timeout=30).json()
    return {
        (method.upper(), path): operation["operationId"]
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if method in HTTP_METHODS
    }


def test_swagger_ui_lists_every_operation(docs_server, docs_page, static_responses):
    page = docs_page
    expected = schema_operations(docs_server)
    page.goto(f"{docs_server.base_url}/explorer/")
    blocks = page.locator(".opblock")
    blocks.first.wait_for()  # drawn by swagger-ui-bundle.js once it has fetched the schema
    shown = blocks.evaluate_all(
        """blocks => blocks.map(block => [
            block.querySelector('.opblock-summary-method').innerText,
            block.querySelector('.opblock-summary-path').dataset.path,
        ])"""
    )
    assert sorted(map(tuple, shown)) == sorted(expected)
    # Styled as Swagger UI's stylesheet says: each method's coloured badge.
    for method, colour in SWAGGER_METHOD_BACKGROUNDS.items():
        badge = page.locator(f".opblock-{method.lower()} .opblock-summary-method").first
        assert badge.evaluate("element => getComputedStyle(element).backgroundColor") == colour
    assert page.locator(".info .title").inner_text().startswith("embedsite")
    save_screenshot(page, "swagger-ui")
    assert_static_served(static_responses)


def test_redoc_draws_its_menu(docs_server, docs_page, static_responses):
    page = docs_page
    expected = schema_operations(docs_server)
    page.goto(f"{docs_server.base_url}/redoc/")
    menu = page.locator(".menu-content")
    menu.locator('li[data-item-id^="tag/"]').first.wait_for()  # drawn by redoc.standalone.js
    assert menu.bounding_box()["width"] > 150  # laid out as ReDoc's side menu, not bare HTML
    # One entry per operation ("tag/<tag>/operation/<operationId>"), under its visible tag.
    item_ids = menu.locator('li[data-item-id*="/operation/"]').evaluate_all(
        "items => items.map(item => item.dataset.itemId)"
    )
    assert sorted(item_id.rsplit("/", 1)[1] for item_id in item_ids) == sorted(expected.values())
    tags = {item_id.split("/")[1] for item_id in item_ids}
    for tag in tags:
        assert menu.locator(f'li[data-item-id="tag/{tag}"]').is_visible()
    save_screenshot(page, "redoc")
    assert_static_served(static_responses)


def test_the_admin_is_styled_by_its_stylesheet(docs_server, docs_page, static_responses):
    page = docs_page
    page.goto(f"{docs_server.base_url}/admin/")
    assert "/admin/login/" in page.url
    save_screenshot(page, "admin-login")
    page.fill("#id_username", "root")
    page.fill("#id_password", "a-long-password")
    page.click("input[type=submit]")
    page.wait_for_url(f"{docs_server.base_url}/admin/")
    header = page.locator("#header")
    assert header.evaluate("element => getComputedStyle(element).backgroundColor") == ADMIN_HEADER_BACKGROUND
    # The app list is laid out as the admin's CSS lays it out: a module table, not a bare list.
    tenants = page.locator("#content-main .app-embeddings .model-tenant")
    assert tenants.is_visible()
    assert (
        page.locator("#content-main .module").first.evaluate(
            "element => getComputedStyle(element).backgroundColor"
        )
        != "rgba(0, 0, 0, 0)"
    )
    save_screenshot(page, "admin-index")
    assert_static_served(static_responses)


def test_an_admin_sets_a_burst_and_sees_the_bucket_drain(docs_server, docs_page):
    """A tenant made by `create_tenant` with a rate of one request a minute; its burst set in the
    admin; three requests through the real server; the tenant page shows the bucket Redis holds."""
    env = {name: value for name, value in docs_server.env.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
    key = tenant_with_key(env, "rated", "--requests-per-minute", "1", name="Rated")
    page = docs_page
    page.goto(f"{docs_server.base_url}/admin/embeddings/tenant/?q=rated")
    page.fill("#id_username", "root")
    page.fill("#id_password", "a-long-password")
    _click_and_load(page, "input[type=submit]")
    _click_and_load(page, "#result_list tbody tr a")  # the tenant's name
    page.fill("#id_request_burst", "50")
    _click_and_load(page, "input[name=_continue]")
    assert "was changed successfully" in page.locator(".messagelist").inner_text()
    for _ in range(3):
        response = httpx2.post(
            f"{docs_server.base_url}/v1/embeddings",
            json={"model": "minilm", "input": "hello"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-ratelimit-limit-requests"] == "50"
    page.reload()
    row = page.locator('#usage-live tr[data-limit="requests_per_minute"]')
    cells = row.locator("td").all_inner_texts()
    # Three requests taken from a burst of 50 that refills one a minute: 3 used (or 2 if a
    # minute passed on a very slow machine), full again in about three minutes.
    assert cells[0] in ("3", "2") and cells[1] == "50 (burst; rate 1)", cells
    assert row.locator("th").inner_text() == "requests per minute"
    page.locator("#usage-live").scroll_into_view_if_needed()
    save_screenshot(page, "admin-tenant-rates")


# A running job as an operator finds it: 20 inputs in chunks of 4; chunks 0 and 1 embedded, chunk 2
# failed, chunk 3 running (its lease held by this shell, renewed until it closes), chunk 4 handed
# out; and a finished job beside it. Run by a DjangoShell in the server's settings.
JOB_SCENE = """
import json
from django.test import override_settings
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.jobs.engine import job_chunk_fail, job_chunk_run
from embeddings.services.jobs.leases import ChunkLease
from embeddings.services.jobs.store import job_store
from embeddings.services.jobs.submission import JobSpec, job_create
model = EmbeddingModel.objects.get(name="all-MiniLM-L6-v2")
tenant = Tenant.objects.get(slug="live")
with override_settings(JOB_CHUNK_SIZE=4):
    spec = JobSpec(model=model, texts=[f"finished sentence {i}" for i in range(6)])
    finished, _ = job_create(tenant_id=tenant.pk, api_key_id=None, spec=spec)
    spec = JobSpec(model=model, texts=[f"browser sentence {i}" for i in range(20)])
    running, _ = job_create(tenant_id=tenant.pk, api_key_id=None, spec=spec)
for chunk in (0, 1):
    job_chunk_run(job_id=finished.pk, chunk=chunk)
    job_chunk_run(job_id=running.pk, chunk=chunk)
failure = "the model answered 1024-d vectors, 384 expected"
job_chunk_fail(job_id=running.pk, chunk=2, code="embedding_failed", message=failure)
held_lease = ChunkLease(job_store(running), 3, lease_s=600)
held_lease.__enter__()
print(json.dumps([running.public_id, finished.public_id]))
"""


def test_an_operator_sees_a_jobs_progress_and_chunks_and_cancels_it(docs_server, docs_page, tmp_path):
    """Through uvicorn as `make run` serves it: the jobs list's rows and the bar the browser drew
    for each, a job's chunk table and events, and the cancel button's effect and message."""
    env = {name: value for name, value in docs_server.env.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
    shell = DjangoShell(env, tmp_path / "shell.log")
    try:
        public_id, finished_id = json.loads(shell.run(JOB_SCENE).splitlines()[-1])
        page = docs_page
        # An operator's desktop screen: the list's columns beside the admin's menu and filters.
        page.set_viewport_size({"width": 1920, "height": 1000})
        page.goto(f"{docs_server.base_url}/admin/embeddings/embeddingjob/")
        page.fill("#id_username", "root")
        page.fill("#id_password", "a-long-password")
        _click_and_load(page, "input[type=submit]")

        rows = page.locator("#result_list tbody tr")
        assert rows.count() == 2
        assert rows.locator("th.field-public_id").all_inner_texts() == [public_id, finished_id]
        running = rows.filter(has_text=public_id)
        assert running.locator("td.field-status").inner_text() == "Running"
        assert running.locator("td.field-progress .job-rows").inner_text() == "12 / 20 (4 failed)"
        # The bar as laid out: 8 of 20 completed (40 %), then 4 failed (20 %) of its width.
        bar = running.locator(".job-progress")
        width = bar.evaluate("element => element.clientWidth")
        completed = running.locator(".job-progress-completed").bounding_box()["width"]
        failed = running.locator(".job-progress-failed").bounding_box()["width"]
        assert width > 100 and abs(completed / width - 0.4) < 0.02 and abs(failed / width - 0.2) < 0.02
        finished = rows.filter(has_text=finished_id)
        assert finished.locator("td.field-status").inner_text() == "Completed"
        assert finished.locator(".job-progress-completed").bounding_box()["width"] >= width - 1
        assert "KiB" in running.locator("td.field-storage_held").inner_text()
        save_screenshot(page, "jobs-list")

        _click_and_load(page, f"text={public_id}")
        chunks = page.locator("#job-chunks tbody tr")
        assert chunks.locator("td.chunk-state").all_inner_texts() == [
            "running",
            "sent",
            "failed",
            "done",
            "done",
        ]
        assert page.locator("#job-chunk-summary").inner_text() == "1 running, 1 sent, 1 failed, 2 done"
        leased = chunks.nth(0).locator("td").all_inner_texts()
        assert leased[0] == "3" and re.fullmatch(r".+:\d+", leased[4]) and leased[5].startswith("until")
        assert "1024-d vectors, 384 expected" in chunks.nth(2).locator("td.chunk-error").inner_text()
        events = page.locator("#job-events td.event-name").all_inner_texts()
        assert events == ["chunk_failed", "running"]  # latest first
        assert page.locator('#job-actions form[data-action="retry"] input[type=submit]').is_disabled()
        page.screenshot(path=str(SCREENSHOTS_DIR / "job-detail.png"), full_page=True)

        _click_and_load(page, '#job-actions form[data-action="cancel"] input[type=submit]')
        assert page.locator(".messagelist").inner_text().strip() == (
            f"Job {public_id} is cancelling: it stops once its running chunks have."
        )
        assert page.locator(".field-status .readonly").inner_text() == "Cancelling"
        assert page.locator('#job-actions form[data-action="cancel"] input[type=submit]').is_disabled()
        assert page.locator("#job-events td.event-name").first.inner_text() == "cancelling"
        page.screenshot(path=str(SCREENSHOTS_DIR / "job-cancelled.png"), full_page=True)
    finally:
        shell.close()
