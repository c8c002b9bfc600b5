"""The fork server (tests/forkserver.py) starts what `subprocess.Popen([sys.executable, ...])` would:
a process with its own environment, working directory, argv, streams, descriptors and session, whose
Django settings and metrics mode come from its own environment, not the server's, and whose status
says how it ended. Pure process tests: no database, Triton or Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests import forkserver
from tests.processes import REPO_ROOT, run_python, start_python

pytestmark = pytest.mark.unit

REPORT = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "variable": os.environ.get("FORKED"),
    "settings_module": os.environ.get("DJANGO_SETTINGS_MODULE"),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "own_session": os.getsid(0) == os.getpid(), "main": __name__,
    "preloaded": "numpy" in sys.modules,
}))
"""


@pytest.fixture
def server():
    return forkserver.server()


def environment(**extra: str) -> dict[str, str]:
    """A small environment, with Python's start-up settings as this process has them (else the
    child would need a fresh interpreter)."""
    return {"PATH": os.environ["PATH"], **forkserver.interpreter_settings(os.environ), **extra}


def test_a_child_has_its_own_environment_directory_argv_and_session(server, tmp_path):
    process = server.start(
        ["-c", REPORT, "first", "second"], env=environment(FORKED="yes"), cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    report = json.loads(out)
    assert report["argv"] == ["-c", "first", "second"]
    assert report["cwd"] == str(tmp_path)
    assert report["path0"] == ""
    assert report["variable"] == "yes"
    # Nothing of the server's environment (the test process's settings module) leaks in.
    assert report["settings_module"] is None
    assert report["own_session"] is True
    assert report["main"] == "__main__"
    assert report["preloaded"] is True
    # 0, 1 and 2, and the descriptor listdir itself opened: none of the server's.
    assert len(report["fds"]) == 4 and report["fds"][:3] == [0, 1, 2]


def test_passed_descriptors_keep_their_numbers_and_stdin_is_a_pipe(server):
    read_end, write_end = os.pipe()
    script = "import os, sys; os.write(int(sys.argv[1]), sys.stdin.read().upper().encode())"
    process = server.start(
        ["-c", script, str(write_end)], env=environment(), stdin=subprocess.PIPE, pass_fds=(write_end,)
    )
    os.close(write_end)
    process.stdin.write(b"through the pipe")
    process.stdin.close()
    assert process.wait(timeout=60) == 0
    with os.fdopen(read_end, "rb") as answers:
        assert answers.read() == b"THROUGH THE PIPE"


@pytest.mark.parametrize(
    ("script", "status", "said"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bye')", 1, "bye"),
        ("raise ValueError('broken')", 1, "ValueError: broken"),
        ("import atexit; atexit.register(print, 'atexit ran')", 0, "atexit ran"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    ],
)
def test_a_child_ends_as_python_would(server, script, status, said):
    process = server.start(
        ["-c", script], env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out, _ = process.communicate(timeout=60)
    assert process.returncode == status
    assert said in out


def test_a_script_and_a_module_run_as_main(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys; print(__name__, sys.argv[1:], sys.path[0])")
    process = server.start([str(script), "a"], env=environment(), stdout=subprocess.PIPE, text=True)
    assert process.communicate(timeout=60)[0].split() == ["__main__", "['a']", str(tmp_path)]
    process = server.start(["-m", "json.tool", "--compact"], env=environment(), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)  # fmt: skip
    process.stdin.write(b'{"a": [1, 2]}')
    process.stdin.close()
    assert process.stdout.read() == b'{"a":[1,2]}\n'
    assert process.wait(timeout=60) == 0


def test_what_a_child_inherits_is_frozen_and_it_collects_its_own_garbage(server):
    """The preloaded modules are in the collector's permanent generation (a child's full
    collections skip them); the child's collector runs, on what it makes itself."""
    script = (
        "import gc, numpy\n"
        "class Cycle: pass\n"
        "a, b = Cycle(), Cycle(); a.other, b.other = b, a; del a, b\n"
        "print(gc.get_freeze_count() > 10_000, gc.isenabled(), gc.collect() >= 2)"
    )
    process = server.start(["-c", script], env=environment(), stdout=subprocess.PIPE, text=True)
    assert process.communicate(timeout=60)[0].split() == ["True", "True", "True"]


def test_wait_times_out_and_a_signal_ends_it(server):
    process = server.start(["-c", "import time; time.sleep(600)"], env=environment())
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.terminate()
    assert process.wait(timeout=60) == -signal.SIGTERM


def test_django_settings_and_metrics_mode_come_from_the_childs_environment(tmp_path):
    """What the server preloaded read neither: the child's DATABASE_URL and PROMETHEUS_MULTIPROC_DIR
    decide its settings and prometheus_client's multi-process mode."""
    script = (
        "import django; django.setup()\n"
        "from django.conf import settings\n"
        "from prometheus_client import values\n"
        "print(settings.DATABASES['default']['NAME'], values.ValueClass.__name__)"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'own.sqlite3'}",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
    }
    done = run_python(["-c", script], env)
    assert done.returncode == 0, done.stderr
    name, value_class = done.stdout.split()
    assert name == str(tmp_path / "own.sqlite3")
    assert value_class == "MmapedValue"


def test_without_the_fork_server_a_fresh_interpreter_runs_it(monkeypatch, tmp_path):
    monkeypatch.setenv(forkserver.ENABLED_VARIABLE, "0")
    process = start_python(
        ["-c", "import os; print(os.getppid())"], env=environment(), stdout=subprocess.PIPE
    )
    assert isinstance(process, subprocess.Popen)
    assert int(process.communicate(timeout=60)[0]) == os.getpid()


def test_manage_py_runs_forked(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "embedsite.settings",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}  # fmt: skip
    done = run_python(["manage.py", "check"], env)
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout


def test_a_process_given_other_start_up_settings_gets_a_fresh_interpreter(tmp_path):
    """PYTHONPATH naming a sitecustomize works only at an interpreter's start: not forked."""
    (tmp_path / "sitecustomize.py").write_text("import os; os.environ['SITE_RAN'] = 'yes'")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert not forkserver.server().can_start(env)
    process = start_python(
        ["-c", "import os; print(os.environ.get('SITE_RAN'))"], env=env, stdout=subprocess.PIPE
    )
    assert isinstance(process, subprocess.Popen)
    assert process.communicate(timeout=60)[0].strip() == b"yes"


SEARCH_PATH = "import json, sys, greeting; print(json.dumps([sys.path, greeting.__file__]))"


def test_pythonpath_alone_is_forked_with_the_search_path_a_fresh_interpreter_has(tmp_path):
    (tmp_path / "greeting.py").write_text("")
    env = environment(PYTHONPATH=str(tmp_path))
    assert forkserver.server().can_start(env)
    forked = start_python(["-c", SEARCH_PATH], env=env, stdout=subprocess.PIPE, cwd=tmp_path)
    assert isinstance(forked, forkserver.ForkedProcess)
    fresh = start_python(
        ["-c", SEARCH_PATH], env=env, stdout=subprocess.PIPE, cwd=tmp_path, fresh_interpreter=True
    )
    assert isinstance(fresh, subprocess.Popen)
    assert json.loads(forked.communicate(timeout=60)[0]) == json.loads(fresh.communicate(timeout=60)[0])


def test_pythonpath_shadowing_a_preloaded_module_gets_a_fresh_interpreter(tmp_path):
    """A forked child would keep the server's numpy where a fresh Python imports this one."""
    (tmp_path / "numpy.py").write_text("SHADOW = True")
    env = environment(PYTHONPATH=str(tmp_path))
    assert not forkserver.server().can_start(env)
    process = start_python(
        ["-c", "import numpy; print(numpy.SHADOW)"], env=env, stdout=subprocess.PIPE, cwd=tmp_path
    )
    assert isinstance(process, subprocess.Popen)
    assert process.communicate(timeout=60)[0].strip() == b"True"


def test_pythonpath_with_the_servers_own_directory_is_forked():
    """The checkout on PYTHONPATH (tests/test_settings.py does that) holds the `tests` package the
    server itself was imported from: the same module either way."""
    env = environment(PYTHONPATH=str(REPO_ROOT))
    assert forkserver.server().can_start(env)
    assert not forkserver.server().can_start(environment(PYTHONPATH="relative/path"))
