"""Helpers for tests that run the project as separate processes: manage.py commands, stopping servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def manage(env: dict[str, str], *args: str) -> str:
    """Run `manage.py ARGS` in `env`; its stdout, stripped (fails the test if the command fails)."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


def stop_process_group(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the process's group (a server's workers too), SIGKILL whatever is left after timeout_s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=15)
