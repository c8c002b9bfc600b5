"""tests/cpu_accounting.py: a test's CPU is its process tree's, children alive or reaped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cpu_accounting import summary, tree_cpu

CHECKOUT = Path(__file__).resolve().parent.parent
# Burns about half a CPU-second, then says so and waits for its stdin to close.
BUSY_CHILD = textwrap.dedent(
    """
    import sys, time
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    print("done", flush=True)
    sys.stdin.read()
    """
)

pytestmark = pytest.mark.integration


def test_a_childs_cpu_counts_while_it_lives_and_once_reaped():
    before = tree_cpu().seconds
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "done\n"
    alive = tree_cpu().seconds - before
    child.stdin.close()
    child.wait(timeout=30)
    reaped = tree_cpu().seconds - before
    assert alive >= 0.45, alive
    assert reaped >= alive


def test_the_plugin_writes_each_tests_cpu_and_the_summary_sums_them(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys

            def test_busy():
                subprocess.run([sys.executable, "-c", {BUSY_CHILD!r}], input="", check=True, text=True)

            def test_idle():
                pass
            """
        )
    )
    report = tmp_path / "report"
    run = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-c", "/dev/null", "--rootdir", str(tmp_path),
            "-p", "no:cacheprovider", "-p", "tests.cpu_accounting", "--cpu-per-test", str(report),
            str(tmp_path / "test_sample.py"),
        ],
        cwd=CHECKOUT, capture_output=True, text=True, timeout=120,
        # Not a worker of this run's xdist, whose name it would write under.
        env={key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    records = {
        json.loads(line)["test"].split("::")[-1]: json.loads(line)
        for line in (report / "main.jsonl").read_text().splitlines()
    }
    assert set(records) == {"test_busy", "test_idle"}
    assert records["test_busy"]["cpu_s"] >= 0.45
    assert records["test_idle"]["cpu_s"] < 0.2
    assert records["test_busy"]["stub_cpu_s"] == 0
    text = summary(report)
    assert text.startswith("2 tests:")
    assert "test_sample.py::test_busy" in text
