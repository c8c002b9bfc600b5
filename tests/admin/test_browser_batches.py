"""Batches and files in the admin, in Debian's headless Chromium through uvicorn as `make run` serves
it (DEBUG off, the files `make setup` collected): the batches list with its progress bars, a batch's
page with its job, files, validation errors and timeline, its cancel button's effect and message, a
file's page with its download, and its deletion. Screenshots land in .run/screenshots/
(batches-list.png, batch-detail.png, batch-cancelled.png, file-detail.png, file-delete.png). The
browser and server fixtures are tests/admin/test_browser.py's."""

from __future__ import annotations

import json
from pathlib import Path

from tests.admin.test_browser import (
    SCREENSHOTS_DIR,
    _click_and_load,
    docs_browser,
    docs_page,
    docs_server,
    save_screenshot,
)
from tests.processes import DjangoShell

__all__ = ["docs_browser", "docs_page", "docs_server"]  # the fixtures, used by name

# Two batches as an operator finds them, run by a DjangoShell in the server's settings (its broker is
# a Redis database no worker reads: the chunks run here). In chunks of 4 lines: a finished one, 6
# lines answered and one refused (its output and error files written, its job gone), and a running
# one, 16 good lines and 4 refused while validating, chunks 0 and 1 run (8 answered).
BATCH_SCENE = """
import io, json
import orjson
from django.test import override_settings
from embeddings.models import Tenant
from embeddings.services.jobs.engine import job_chunk_run
from embeddings.services.openai_api.batches import batch_create, batch_finalize, batch_validate
from embeddings.services.openai_api.files import file_create
tenant = Tenant.objects.get(slug="live")

def line(custom_id, text, **changes):
    body = {"model": "all-MiniLM-L6-v2", "input": text}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body, **changes}
    return orjson.dumps(request) + b"\\n"

def batch_of(lines, name):
    stored = file_create(
        tenant_id=tenant.pk, purpose="batch", filename=name, content=io.BytesIO(b"".join(lines))
    )
    batch = batch_create(
        tenant_id=tenant.pk, api_key_id=None, input_file=stored, endpoint="/v1/embeddings",
        completion_window="24h", metadata={"project": name},
    )
    batch_validate(batch_id=batch.pk)
    batch.refresh_from_db()
    return batch

with override_settings(JOB_CHUNK_SIZE=4):
    nightly = [line(f"n-{i}", f"nightly sentence {i}") for i in range(6)]
    finished = batch_of([*nightly, b"not json\\n"], "nightly.jsonl")
    bad = [line("b-get", "x", method="GET"), line("b-url", "x", url="/v1/rerank"), b"[1]\\n"]
    bad.append(line("b-0", "again"))
    good = [line(f"b-{i}", f"browser sentence {i}") for i in range(16)]
    running = batch_of([*good[:8], *bad, *good[8:]], "browser.jsonl")
for chunk in range(finished.job.chunks):
    job_chunk_run(job_id=finished.job_id, chunk=chunk)
batch_finalize(batch_id=finished.pk)
finished.refresh_from_db()
for chunk in (0, 1):
    job_chunk_run(job_id=running.job_id, chunk=chunk)
print(json.dumps({
    "running": running.public_id, "running_job": running.job.public_id, "finished": finished.public_id,
    "output": finished.output_file.public_id, "output_bytes": finished.output_file.bytes,
}))
"""


def test_an_operator_reads_batches_and_files_and_cancels_a_batch(docs_server, docs_page, tmp_path):
    env = {name: value for name, value in docs_server.env.items() if name != "PROMETHEUS_MULTIPROC_DIR"}
    shell = DjangoShell(env, tmp_path / "shell.log")
    try:
        scene = json.loads(shell.run(BATCH_SCENE).splitlines()[-1])
    finally:
        shell.close()
    page = docs_page
    page.set_viewport_size({"width": 1920, "height": 1000})
    page.goto(f"{docs_server.base_url}/admin/embeddings/batch/")
    page.fill("#id_username", "root")
    page.fill("#id_password", "a-long-password")
    _click_and_load(page, "input[type=submit]")

    # The list: newest first, the running batch's bar as laid out, its job and its files linked.
    rows = page.locator("#result_list tbody tr")
    assert rows.locator("th.field-public_id").all_inner_texts() == [scene["running"], scene["finished"]]
    running = rows.filter(has_text=scene["running"])
    assert running.locator("td.field-status").inner_text() == "In Progress"
    assert running.locator("td.field-progress .job-rows").inner_text() == "12 / 20 (4 failed)"
    bar = running.locator(".job-progress")
    width = bar.evaluate("element => element.clientWidth")
    completed = running.locator(".job-progress-completed").bounding_box()["width"]
    failed = running.locator(".job-progress-failed").bounding_box()["width"]
    assert width > 100 and abs(completed / width - 0.4) < 0.02 and abs(failed / width - 0.2) < 0.02
    assert running.locator("td.field-invalid_lines").inner_text() == "4"
    job_link = running.locator("td.field-job_link a")
    assert (job_link.inner_text(), job_link.get_attribute("title")) == ("running", scene["running_job"])
    assert running.locator("td.field-files a").all_inner_texts() == ["input"]
    finished = rows.filter(has_text=scene["finished"])
    assert finished.locator("td.field-status").inner_text() == "Completed"
    assert finished.locator("td.field-progress .job-rows").inner_text() == "7 / 7 (1 failed)"
    assert finished.locator("td.field-files a").all_inner_texts() == ["input", "output", "error"]
    # Every column fits beside the admin's menu and filters at a desktop's width: nothing to scroll to.
    results = page.locator("#changelist .results")
    assert results.evaluate("element => element.scrollWidth <= element.clientWidth")
    save_screenshot(page, "batches-list")

    # The running batch's page: its job, its input file, its refused lines, its timeline.
    _click_and_load(page, f"text={scene['running']}")
    job_link = page.locator(".field-job_detail a")
    assert job_link.inner_text() == scene["running_job"]
    assert page.locator(".field-job_detail .readonly").inner_text().endswith("(running, 8 / 16)")
    assert "/admin/embeddings/embeddingjob/" in job_link.get_attribute("href")
    files = page.locator("#batch-files tbody tr")
    assert files.count() == 1 and files.first.get_attribute("data-role") == "input"
    assert files.first.locator("a.file-download").inner_text() == "download"
    errors = page.locator("#batch-errors tbody tr")
    assert errors.locator("td.error-line").all_inner_texts() == ["9", "10", "11", "12"]
    assert errors.locator("td.error-code").all_inner_texts() == [
        "invalid_method",
        "invalid_url",
        "invalid_json_line",
        "duplicate_custom_id",
    ]
    timeline = page.locator("#batch-timeline th").all_inner_texts()
    assert timeline[:2] == ["created (validating)", "in progress (validated, its job started)"]
    page.screenshot(path=str(SCREENSHOTS_DIR / "batch-detail.png"), full_page=True)

    _click_and_load(page, '#batch-actions form[data-action="cancel"] input[type=submit]')
    assert page.locator(".messagelist").inner_text().strip() == (
        f"Batch {scene['running']} is cancelling: it stops once its running chunks have; what finished "
        "goes to its output file, the rest to its error file (batch_cancelled)."
    )
    assert page.locator(".field-status .readonly").inner_text() == "Cancelling"
    assert page.locator("#batch-actions input[type=submit]").is_disabled()
    assert "(cancelling, " in page.locator(".field-job_detail .readonly").inner_text()
    assert "cancelling" in page.locator("#batch-timeline").inner_text()
    page.screenshot(path=str(SCREENSHOTS_DIR / "batch-cancelled.png"), full_page=True)

    # The finished batch's output file: its page, and its bytes downloaded as an attachment.
    page.goto(f"{docs_server.base_url}/admin/embeddings/batch/?q={scene['finished']}")
    _click_and_load(page, f"text={scene['finished']}")
    assert page.locator("#batch-files tbody tr").evaluate_all(
        "rows => rows.map(row => row.dataset.role)"
    ) == [
        "input",
        "output",
        "error",
    ]
    # Its job was deleted once its files were written.
    assert page.locator(".field-job_detail .readonly").inner_text() == "-"
    _click_and_load(page, f"#batch-files a:text('{scene['output']}')")
    assert page.locator(".field-public_id .readonly").inner_text() == scene["output"]
    assert (
        page.locator(".field-size_exact .readonly")
        .inner_text()
        .endswith(f"({scene['output_bytes']:,} bytes)")
    )
    uses = page.locator("#file-uses tbody tr")
    assert uses.count() == 1 and uses.first.get_attribute("data-role") == "output"
    assert "its output_file_id becomes null" in uses.first.locator("td.deletion-effect").inner_text()
    assert page.locator(".deletelink").is_visible()
    page.screenshot(path=str(SCREENSHOTS_DIR / "file-detail.png"), full_page=True)
    with page.expect_download() as download_info:
        page.click("#file-download-link")
    download = download_info.value
    assert download.suggested_filename == f"{scene['output']}_{scene['finished']}_output.jsonl"
    lines = Path(download.path()).read_bytes().splitlines()
    assert len(lines) == 6 and all(json.loads(line)["response"]["status_code"] == 200 for line in lines)

    # Deleting it: Django's confirmation says what it does to the batch, then the batch keeps the rest.
    _click_and_load(page, ".deletelink")
    assert "Its bytes are deleted from the files storage" in page.locator("#file-deletion-note").inner_text()
    effect = page.locator("#deleted-objects ul li").inner_text()
    assert effect.startswith(f"{scene['finished']} (output, completed): its output_file_id becomes null")
    page.screenshot(path=str(SCREENSHOTS_DIR / "file-delete.png"), full_page=True)
    _click_and_load(page, "input[type=submit]")
    said = page.locator(".messagelist li").all_inner_texts()
    assert said[0].startswith(
        f"Batch {scene['finished']} (output file {scene['output']}): its output_file_id"
    )
    assert said[1].startswith(f"The file “{scene['output']}")
    page.goto(f"{docs_server.base_url}/admin/embeddings/batch/?q={scene['finished']}")
    row = page.locator("#result_list tbody tr")
    assert row.locator("td.field-files a").all_inner_texts() == ["input", "error"]
