"""The collector around a process's start-up (embedsite/process_start.py): a process started as
manage.py or as the ASGI application (what uvicorn's workers import) collects again once started,
with what start-up built frozen; a process whose collector something else stopped keeps it stopped.
Fresh interpreters, as the service's processes start: no database, Triton or Redis."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from embedsite import process_start
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.unit

COLLECTOR = "import gc, json; print(json.dumps([gc.isenabled(), gc.get_freeze_count()]))"
# Far fewer than Django, the app and their libraries make (~200,000 objects).
STARTUP_OBJECTS = 50_000


def collector_after(args: list[str]) -> tuple[bool, int]:
    """(collecting, objects frozen) as `python ARGS` printed them, the last line of its output."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "embedsite.settings"}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    enabled, frozen = json.loads(done.stdout.strip().splitlines()[-1])
    return enabled, frozen


def test_a_management_command_runs_collecting_with_djangos_start_up_frozen():
    enabled, frozen = collector_after(["manage.py", "shell", "-c", COLLECTOR])
    assert enabled
    assert frozen > STARTUP_OBJECTS


def test_the_asgi_application_imported_leaves_its_process_collecting_with_it_frozen():
    enabled, frozen = collector_after(["-c", f"import embedsite.asgi\n{COLLECTOR}"])
    assert enabled
    assert frozen > STARTUP_OBJECTS


def test_settings_read_without_an_entry_point_leave_the_collector_alone():
    code = f"from django.conf import settings\nsettings.DEBUG\n{COLLECTOR}"
    enabled, frozen = collector_after(["-c", code])
    assert enabled
    assert frozen == 0


@pytest.fixture
def collector_restored():
    enabled = gc.isenabled()
    yield
    process_start._paused_by_start_up = False
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_a_collector_stopped_before_start_up_stays_stopped(collector_restored):
    gc.disable()
    process_start.begin()
    process_start.end()
    assert not gc.isenabled()


def test_start_up_pauses_the_collector_until_it_ends(collector_restored):
    gc.enable()
    process_start.begin()
    assert not gc.isenabled()
    process_start.begin()  # again, as the ASGI module does after Django's set-up
    process_start.end()
    assert gc.isenabled()
    process_start.end()  # later calls only freeze
    assert gc.isenabled()
