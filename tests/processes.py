"""Helpers for tests that run the project as separate processes: manage.py commands, stopping servers."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import httpx2
import pytest

from tests import forkserver

REPO_ROOT = Path(__file__).resolve().parents[1]


class ProcStat(NamedTuple):
    pid: int
    name: str
    state: str
    ppid: int
    pgrp: int


def proc_stats() -> Iterator[ProcStat]:
    """Every process's /proc/<pid>/stat, parsed; one that ends while being read is left out."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            yield ProcStat(int(entry), name, state, int(ppid), int(pgrp))


def children_of(pid: int) -> dict[int, str]:
    """pid -> command name of the live children of `pid`."""
    return {child.pid: child.name for child in proc_stats() if child.ppid == pid and child.state != "Z"}


def start_python(
    args: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path | str = REPO_ROOT,
    stdin=None,
    stdout=None,
    stderr=None,
    pass_fds: Sequence[int] = (),
    text: bool = False,
    fresh_interpreter: bool = False,
) -> subprocess.Popen | forkserver.ForkedProcess:
    """`python ARGS` (a script such as manage.py, `-m module` or `-c code`) in `env`, in a session of
    its own, SIGTERMed if this test process dies: forked from this process's fork server
    (tests/forkserver.py: the third-party modules already imported), or a fresh interpreter as
    `subprocess.Popen` starts it: with `fresh_interpreter` (the tests of how the service starts),
    EMBEDSITE_TEST_FORKSERVER=0, or where `env` gives Python other start-up settings (PYTHONPATH)."""
    if not fresh_interpreter and forkserver.enabled():
        server = forkserver.server()
        if server.can_start(env):
            return server.start(
                args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
                start_new_session=True, text=text,
            )  # fmt: skip
    from embeddings.tooling.triton_server import die_with_parent

    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        pass_fds=pass_fds, start_new_session=True, preexec_fn=die_with_parent, text=text,
    )  # fmt: skip


def run_python(
    args: Sequence[str], env: dict[str, str], timeout_s: float = 120, cwd: Path | str = REPO_ROOT
) -> subprocess.CompletedProcess:
    """start_python(args) in `cwd`, waited for: its status and what it wrote (text), as
    subprocess.run's capture_output; SIGKILLed after timeout_s (subprocess.TimeoutExpired)."""
    process = start_python(
        args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess([sys.executable, *args], process.returncode, out, err)


def start_celery(
    role: str, log_path: Path, env: dict[str, str]
) -> subprocess.Popen | forkserver.ForkedProcess:
    """runstack's `celery -A embedsite worker|beat` (start_celery) through start_python, its output
    appended to log_path."""
    from embeddings.management.commands.runstack import celery_arguments

    with log_path.open("ab") as log:
        return start_python(celery_arguments(role), env=env, stdout=log, stderr=subprocess.STDOUT)


def manage(env: dict[str, str], *args: str) -> str:
    """Run `manage.py ARGS` in `env`; its stdout, stripped (fails the test if the command fails)."""
    done = run_python(["manage.py", *args], env)
    assert done.returncode == 0, f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


_DJANGO_SETUP = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
import django
django.setup()
"""

# Each command in COMMANDS (JSON) as `manage.py NAME ARGS` runs it (the same parser, the system
# checks), in one Python: one Django start instead of one per command. A command's stdout is
# captured on its own; the last line printed is every command's, as JSON.
_RUN_COMMANDS = """
import io, json
from django.core.management import call_command
outputs = []
for name, *arguments in json.loads(COMMANDS):
    out = io.StringIO()
    call_command(name, *arguments, stdout=out, skip_checks=False)
    outputs.append(out.getvalue())
print(json.dumps(outputs))
"""
_MANAGE_COMMANDS = _DJANGO_SETUP + "import sys\nCOMMANDS = sys.argv[1]\n" + _RUN_COMMANDS


def manage_commands(env: dict[str, str], *commands: Sequence[str]) -> list[str]:
    """Run each `manage.py NAME ARGS` in `commands`, in order, in `env`, all in one process (Django
    starts once); each one's stdout, stripped (fails the test if one fails: those after it don't run)."""
    done = run_python(["-c", _MANAGE_COMMANDS, json.dumps([list(command) for command in commands])], env)
    listed = "; ".join(" ".join(command) for command in commands)
    assert done.returncode == 0, f"manage.py {listed} failed:\n{done.stdout}\n{done.stderr}"
    return [output.strip() for output in json.loads(done.stdout.splitlines()[-1])]


# Scripts run one after another, each as `manage.py shell -c SCRIPT` runs it: a request is a JSON
# line on stdin (the script), its answer a JSON line on the pipe argv[1] names (what the script
# printed, the traceback if it raised). Django's own output (its log lines) goes to stdout, a file.
_DJANGO_SHELL = (
    _DJANGO_SETUP
    + """
import contextlib, io, json, sys, traceback
from django.db import connections
answers = os.fdopen(int(sys.argv[1]), "w")
for request in sys.stdin:
    printed, error = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(json.loads(request), "<script>", "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    connections.close_all()  # as a `manage.py shell` process ends with its connections
    answers.write(json.dumps({"printed": printed.getvalue(), "error": error}) + "\\n")
    answers.flush()
"""
)


class DjangoShell:
    """One Python with Django set up in `env` that runs scripts as `manage.py shell -c SCRIPT` does,
    one at a time: Django starts once (~1.7 CPU-s), not for every script. What a script leaves in
    memory stays for the next (a module's caches, clients): give each what it needs."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        answers, answers_in_child = os.pipe()
        with log_path.open("ab") as log:
            self.process = start_python(
                ["-c", _DJANGO_SHELL, str(answers_in_child)],
                env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(answers_in_child,),
            )  # fmt: skip
        os.close(answers_in_child)
        self._answers = os.fdopen(answers, "r")

    def run(self, script: str, timeout_s: float = 120) -> str:
        """What `script` printed, stripped (fails the test if it raised or took over timeout_s)."""
        self.process.stdin.write((json.dumps(script) + "\n").encode())
        self.process.stdin.flush()
        ready, _, _ = select.select([self._answers], [], [], timeout_s)
        line = self._answers.readline() if ready else ""
        if not line:  # stopped, so that no later script reads this one's answer
            stop_process_group(self.process)
            log = self.log_path.read_text()[-4000:]
            pytest.fail(f"the shell ended, or gave no answer within {timeout_s:g} s:\n{log}")
        answer = json.loads(line)
        assert answer["error"] is None, f"the script failed:\n{script[:2000]}\n{answer['error']}"
        return answer["printed"].strip()

    def commands(self, *commands: Sequence[str]) -> list[str]:
        """manage_commands(env, *commands) in this shell."""
        script = f"COMMANDS = {json.dumps([list(command) for command in commands])!r}\n{_RUN_COMMANDS}"
        return [output.strip() for output in json.loads(self.run(script).splitlines()[-1])]

    def close(self) -> None:
        self.process.stdin.close()  # the loop ends, and the process with it
        self._answers.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        stop_process_group(self.process)


def tenant_with_key(
    where: dict[str, str] | DjangoShell, slug: str, *options: str, name: str | None = None
) -> str:
    """`create_tenant --slug SLUG OPTIONS` and `create_api_key --tenant SLUG` in one process, a new
    one in the environment `where` or the DjangoShell `where`: the key."""
    commands = (
        ("create_tenant", "--name", name or slug, "--slug", slug, *options),
        ("create_api_key", "--tenant", slug),
    )
    _, key = (
        where.commands(*commands) if isinstance(where, DjangoShell) else manage_commands(where, *commands)
    )
    return key


def stop_process_group(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the process's group (a server's workers too), SIGKILL whatever is left after timeout_s."""
    stop_process_groups(process, timeout_s=timeout_s)


def stop_process_groups(*processes: subprocess.Popen, timeout_s: float = 20) -> None:
    """stop_process_group for each process, the groups shutting down side by side: all have SIGTERM
    before any is waited for."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=15)


def wait_until_healthy(
    process: subprocess.Popen,
    base_url: str,
    log_path: Path,
    *,
    ready: Callable[[], bool] = lambda: True,
    timeout_s: float = 120.0,
) -> None:
    """Until the server `process` started answers GET /health with 200 (once `ready()` holds too);
    fails the test with the log's tail if it exits first or takes longer than timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        if ready():
            try:
                if httpx2.get(f"{base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
        time.sleep(0.05)
    pytest.fail(f"the server did not start within {timeout_s:g} s:\n{log_path.read_text()[-4000:]}")


@contextlib.contextmanager
def process_group_paused(process, database_url: str | None = None, timeout_s: float = 30) -> Iterator[None]:
    """The process's group stopped (SIGSTOP) for the block, continued (SIGCONT) after: a server or
    worker that holds back its work until the test has checked what it needs to see first.

    With `database_url`, paused at a moment the group holds no transaction on that database (paused
    in one, a writer keeps SQLite locked, reads included, or its rows locked, and the test's own
    writes would wait for ever): paused and continued again until such a moment."""
    from tests.database_backend import no_transaction_open

    assert process.poll() is None, "the process is not running"
    deadline = time.monotonic() + timeout_s
    os.killpg(process.pid, signal.SIGSTOP)
    while database_url is not None and not no_transaction_open(database_url):
        os.killpg(process.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"not once outside a transaction in {timeout_s:g} s"
        time.sleep(0.005)
        os.killpg(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGCONT)


def ctrl_c_as_in_a_terminal() -> None:
    """preexec_fn: SIGINT back to its default in the child. A shell starts background jobs (and CI
    runners often start tests) with SIGINT ignored, and a Python started that way installs no
    KeyboardInterrupt handler, so a test's SIGINT would do nothing; a terminal's foreground process
    has it at its default, which is what a user's Ctrl-C reaches."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def ctrl_c_raises_keyboard_interrupt() -> Iterator[None]:
    """In this (main) thread, SIGINT raises KeyboardInterrupt for the block, as in an interactive
    Python, even where the test run was started with SIGINT ignored (see ctrl_c_as_in_a_terminal)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
