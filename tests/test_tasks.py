"""Celery tasks run by a real `celery -A embedsite worker` (and beat), started as runstack starts
them, against the test Redis and a database shared with the test (on the run's backend)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery

from embeddings.services.quotas.limits import quota_release_sync
from embeddings.services.quotas.usage import UsageEvent
from tests.database_backend import database_rows, migrated_database_url
from tests.processes import manage, start_celery, stop_process_group

FOLD_TASK = "embeddings.tasks.usage_fold_task"


@dataclass
class StackDatabase:
    url: str
    env: dict[str, str]
    tenant_id: int
    run_dir: Path

    def totals(self, model: str) -> tuple[int, int]:
        """(requests, tokens) folded for this model so far."""
        (row,) = database_rows(
            self.url,
            "SELECT COALESCE(SUM(requests), 0) AS requests, COALESCE(SUM(tokens), 0) AS tokens "
            "FROM embeddings_usagebucket WHERE model = %s",
            model,
        )
        return int(row["requests"]), int(row["tokens"])


@pytest.fixture(scope="module")
def stack_database(redis_server, tmp_path_factory) -> StackDatabase:
    """A migrated database with one tenant; the environment that points a process at it."""
    workdir = tmp_path_factory.mktemp("celery")
    url = migrated_database_url(workdir)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": url,
        "REDIS_URL": redis_server.url,
        "CELERY_BROKER_URL": redis_server.url,
        "EMBEDSITE_RUN_DIR": str(workdir),
    }
    manage(env, "create_tenant", "--name", "Worker", "--slug", "worker")
    (tenant,) = database_rows(url, "SELECT id FROM embeddings_tenant WHERE slug = %s", "worker")
    return StackDatabase(url, env, tenant["id"], workdir)


@pytest.fixture
def celery_worker(stack_database, service_redis, tmp_path) -> Iterator[Path]:
    """`celery -A embedsite worker` (solo pool) on the test Redis and the shared database; its log."""
    log_path = tmp_path / "worker.log"
    worker = start_celery("worker", log_path, env=stack_database.env)
    yield log_path
    stop_process_group(worker)


def wait_for_totals(
    database: StackDatabase, model: str, expected: tuple[int, int], logs: list[Path], timeout_s: float = 90
) -> None:
    """Until the folded totals are the expected ones (a deadline against hanging, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if database.totals(model) == expected:
            return
        time.sleep(0.2)
    text = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
    pytest.fail(f"totals for {model} are {database.totals(model)}, not {expected}:\n{text}")


def record(database: StackDatabase, model: str, count: int) -> tuple[int, int]:
    for index in range(count):
        quota_release_sync(
            reservation=None,
            refund=False,
            usage=UsageEvent(database.tenant_id, None, model, "openai", "succeeded", 1, index + 1),
        )
    return count, sum(range(1, count + 1))


def test_worker_folds_when_the_task_is_sent(stack_database, celery_worker, service_redis):
    expected = record(stack_database, "sent-model", 25)
    assert stack_database.totals("sent-model") == (0, 0)
    # Sent by name from an app of its own: what beat does, without the test's Django settings.
    with Celery("sender", broker=service_redis.url) as sender:
        sender.send_task(FOLD_TASK)
    wait_for_totals(stack_database, "sent-model", expected, [celery_worker])
    # A second send folds what came since, and counts nothing twice.
    record(stack_database, "sent-model", 5)
    with Celery("sender", broker=service_redis.url) as sender:
        sender.send_task(FOLD_TASK)
    wait_for_totals(stack_database, "sent-model", (30, expected[1] + 15), [celery_worker])


def test_beat_schedules_the_fold(stack_database, celery_worker, tmp_path):
    """`celery -A embedsite beat` sends the fold every USAGE_FOLD_INTERVAL_S (1 s here)."""
    expected = record(stack_database, "beat-model", 10)
    env = {**stack_database.env, "USAGE_FOLD_INTERVAL_S": "1"}
    log_path = tmp_path / "beat.log"
    beat = start_celery("beat", log_path, env=env)
    try:
        wait_for_totals(stack_database, "beat-model", expected, [celery_worker, log_path])
    finally:
        stop_process_group(beat)
    assert f"Sending due task fold-usage ({FOLD_TASK})" in log_path.read_text()
    # Its schedule file where the settings put it: RUN_DIR.
    assert list(stack_database.run_dir.glob("celerybeat-schedule*"))


def test_the_fold_is_in_the_beat_schedule_and_registered(settings):
    from embedsite.celery import app

    app.loader.import_default_modules()
    entry = app.conf.beat_schedule["fold-usage"]
    assert entry["task"] == FOLD_TASK
    assert entry["schedule"] == settings.USAGE_FOLD_INTERVAL_S
    assert FOLD_TASK in app.tasks
    assert app.tasks[FOLD_TASK].acks_late
