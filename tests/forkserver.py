"""A fork server for the Python processes tests start: `manage.py serve`, Celery workers, manage.py
commands and scripts. Each such process used to import Django, DRF's neighbours, Celery, gRPC, numpy
and tokenizers afresh (~0.6 of its ~0.9 CPU-seconds of start-up, and a test run starts hundreds of
them on two cores). This server imports the third-party modules that read neither Django's settings
nor the environment when imported (PRELOAD), once per pytest process, then forks a child for each
process a test starts. The child becomes what `subprocess.Popen([sys.executable, ...])` would have
started: its own environment, working directory, argv, sys.path[0], standard streams and passed
descriptors, a session of its own, SIGTERM when its parent dies; then it runs the script (`manage.py`),
module (`-m celery`) or code (`-c`) as Python's `__main__` would, and exits as that Python would
(atexit handlers, a SystemExit's code, an uncaught exception's traceback and status 1).

What differs from a fresh interpreter: the preloaded modules were imported before the child's
environment was set (so none that reads it at import is preloaded: prometheus_client reads
PROMETHEUS_MULTIPROC_DIR, DRF reads Django's settings), interpreter flags are the server's, and the
child's parent is the server, not the test. A process whose environment gives Python other start-up
settings gets a fresh interpreter; PYTHONPATH alone is given to a forked child's sys.path as Python
would place it, unless one of its directories holds a sitecustomize or usercustomize (which run only
at an interpreter's start) or a module the server has imported from elsewhere (the child would keep
the server's). Tests about how the service starts (`manage.py serve`'s signals, runstack, what
Chromium draws of `make run`'s server, the multi-host run) start real interpreters;
`EMBEDSITE_TEST_FORKSERVER=0` makes every test do so.

Protocol: one SOCK_SEQPACKET message a request, JSON, descriptors alongside (SCM_RIGHTS); one
message a reply. The server reaps its children and keeps their exit status for `poll`.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# Imported once in the server. Each is checked to read neither Django's settings nor the environment
# when imported (tests/test_forkserver.py: the child's settings and metrics mode are its own).
PRELOAD = (
    "django.db.models",
    "django.http",
    "django.urls",
    "django.forms",
    "django.template",
    "django.contrib.admin",
    "django.contrib.postgres.fields",
    "django.core.management",
    "numpy",
    "tokenizers",
    "grpc",
    "grpc.aio",
    "google.protobuf.message",
    "celery",
    "kombu",
    "redis.asyncio",
    "uvicorn",
    "uvloop",
    "httptools",
    "channels",
    "orjson",
    "psycopg",
    "requests",
    "yaml",
    "jinja2",
    "whitenoise",
    "cryptography.hazmat.primitives.hashes",
    "opentelemetry.trace",
)
# Never preloaded: they read the environment or Django's settings as they are imported.
NOT_PRELOADED = ("prometheus_client", "rest_framework", "embedsite", "embeddings")

ENABLED_VARIABLE = "EMBEDSITE_TEST_FORKSERVER"
MAX_MESSAGE = 1 << 20


def enabled() -> bool:
    return os.environ.get(ENABLED_VARIABLE, "1") != "0"


def interpreter_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables Python reads as it starts (PYTHONPATH, PYTHONHASHSEED, ...): a forked child has
    the server's, so a process given others needs a fresh interpreter (PYTHONPATH alone: see
    ForkServer.can_start)."""
    return {key: value for key, value in env.items() if key.startswith("PYTHON")}


# Modules Python imports from sys.path as it starts, so only a fresh interpreter runs them.
START_UP_MODULES = ("sitecustomize", "usercustomize")


def _top_level_names(directory: str) -> set[str]:
    """The names `import NAME` could find in `directory`: modules, extensions and packages."""
    return {entry.name.split(".", 1)[0] for entry in os.scandir(directory)}


def _imported_from() -> dict[str, list[str]]:
    """Each top-level module this process has imported: the directories it was found in (none for a
    built-in or frozen module, which sys.path cannot shadow)."""
    found: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        if getattr(module, "__path__", None) is not None:
            found[name] = sorted({os.path.dirname(os.path.realpath(path)) for path in module.__path__})
        elif getattr(module, "__file__", None):
            found[name] = [os.path.dirname(os.path.realpath(module.__file__))]
        else:
            found[name] = []
    return found


# --- The server ------------------------------------------------------------------------------------


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    leaked = [name for name in sys.modules if name.split(".")[0] in NOT_PRELOADED]
    assert not leaked, f"preloading imported {leaked[:5]}, which must not be preloaded"


def _serve(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Answer requests until one starts a process; returns (that request, its descriptors) in the
    child, never in the server (which exits when the test process closes its end)."""
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    exited: dict[int, int] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = os.waitstatus_to_exitcode(status)

    while True:
        readable, _, _ = select.select([connection, wakeup_read], [], [])
        if wakeup_read in readable:
            os.read(wakeup_read, 4096)
            reap()
        if connection not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 64)
        if not message:
            sys.exit(0)  # the test process has gone
        request = json.loads(message)
        if request["op"] == "modules":
            connection.send(json.dumps(_imported_from()).encode())
            continue
        if request["op"] == "poll":
            reap()
            connection.send(json.dumps({"returncode": exited.get(request["pid"])}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wakeup_read)
            os.close(wakeup_write)
            connection.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        connection.send(json.dumps({"pid": pid}).encode())


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """This forked child as Popen would have started it: descriptors, session, environment."""
    from embeddings.tooling.triton_server import die_with_parent  # the app: only now, in the child

    if request["new_session"]:
        os.setsid()
    die_with_parent()
    # Out of the way of the numbers they are going to, then onto them (0, 1, 2 and pass_fds).
    held = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fd_targets"], held, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    if request["sigint_default"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[1:1] = request["python_path"]  # where Python puts PYTHONPATH: after the script's directory


def _run(args: list[str]) -> None:
    """`python ARGS` in this process, as its `__main__`: a script, `-m module` or `-c code`."""
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    # No parent-death signal: it would follow the thread that started the server, not the test
    # process; the server ends when the test process's end of the connection closes instead.
    connection = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    # What the children inherit goes to the collector's permanent generation: each child's full
    # collections traversed all of it again (a quarter of the CPU of the processes tests start,
    # perf over a PostgreSQL pass), and touching it copied the shared pages.
    gc.freeze()
    sys.stdout.flush()
    request, fds = _serve(connection)
    _become(request, fds)
    _run(request["args"])


# --- The test process's side -----------------------------------------------------------------------


class ForkedProcess:
    """What a test holds of a process the fork server started: Popen's interface as tests use it
    (pid, poll, wait, returncode, signals, stdin/stdout/stderr pipes, communicate)."""

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str], streams: dict[str, IO | None]):
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = streams["stdin"], streams["stdout"], streams["stderr"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.002
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Everything the process wrote to its stdout and stderr pipes until it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = [pipe for pipe in (self.stdout, self.stderr) if pipe is not None]
        read: dict[IO, list[bytes]] = {pipe: [] for pipe in pipes}
        while pipes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for pipe in select.select(pipes, [], [], left)[0]:
                chunk = os.read(pipe.fileno(), 65536)
                if chunk:
                    read[pipe].append(chunk)
                else:
                    pipes.remove(pipe)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        outputs = []
        for pipe in (self.stdout, self.stderr):
            if pipe is None:
                outputs.append(None)
                continue
            data = b"".join(read[pipe])
            outputs.append(data.decode() if isinstance(pipe, io.TextIOBase) else data)
            pipe.close()
        return outputs[0], outputs[1]


def _child_descriptor(stream: Any) -> int:
    """A descriptor for the child of a Popen-style stream argument other than PIPE and STDOUT:
    None is /dev/null (not this test process's stdin or output)."""
    if stream is None or stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR)
    return os.dup(stream if isinstance(stream, int) else stream.fileno())


class ForkServer:
    """One fork server for this pytest process, started at its first request."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        repo_root = Path(__file__).resolve().parents[1]
        # Without DJANGO_SETTINGS_MODULE, a preloaded module reading the settings fails loudly
        # instead of configuring this test process's.
        env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
            cwd=repo_root, env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
        )  # fmt: skip
        theirs.close()
        self.interpreter_settings = interpreter_settings(env)
        self._connection = ours
        self._lock = threading.Lock()
        self._imported: dict[str, list[str]] | None = None  # _imported_from() of the server, once asked

    def _ask(self, request: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        message = json.dumps(request).encode()
        assert len(message) < MAX_MESSAGE, "request too large for the fork server"
        with self._lock:
            socket.send_fds(self._connection, [message], list(fds))
            reply = self._connection.recv(MAX_MESSAGE)
        if not reply:
            raise RuntimeError(f"the fork server has exited ({self._process.poll()})")
        return json.loads(reply)

    def returncode(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def can_start(self, env: Mapping[str, str]) -> bool:
        """Whether a child with `env` starts as a fresh interpreter given `env` would: the same start-up
        settings as the server's, or PYTHONPATH besides (the server having none) whose directories
        hold no start-up module and none the server imported from another place."""
        settings = interpreter_settings(env)
        if settings == self.interpreter_settings:
            return True
        python_path = settings.pop("PYTHONPATH", None)
        if python_path is None or settings != self.interpreter_settings:
            return False
        if self._imported is None:
            self._imported = self._ask({"op": "modules"})
        for entry in python_path.split(os.pathsep):
            if not os.path.isabs(entry) or not os.path.isdir(entry):
                return False
            names = _top_level_names(entry)
            if names.intersection(START_UP_MODULES):
                return False
            place = os.path.realpath(entry)
            if any(self._imported[name] not in ([], [place]) for name in names.intersection(self._imported)):
                return False
        return True

    def start(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        pass_fds: Sequence[int] = (),
        start_new_session: bool = False,
        sigint_default: bool = False,
        text: bool = False,
    ) -> ForkedProcess:
        """`subprocess.Popen([sys.executable, *args], ...)`, forked from the server."""
        env = os.environ if env is None else env
        assert self.can_start(env), "the child needs a fresh interpreter (interpreter_settings)"
        # PYTHONPATH that the server lacks (can_start allowed it) goes into the child's sys.path.
        python_path = (
            [] if "PYTHONPATH" in self.interpreter_settings else env.get("PYTHONPATH", "").split(os.pathsep)
        )
        python_path = [entry for entry in python_path if entry]
        child_fds: list[int] = []
        ours: dict[str, IO | None] = {"stdin": None, "stdout": None, "stderr": None}
        try:
            for name, stream in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
                if stream == subprocess.PIPE:
                    read_end, write_end = os.pipe()
                    mine, theirs = (write_end, read_end) if name == "stdin" else (read_end, write_end)
                    ours[name] = os.fdopen(mine, ("w" if name == "stdin" else "r") + ("" if text else "b"))
                    child_fds.append(theirs)
                elif stream == subprocess.STDOUT:
                    child_fds.append(os.dup(child_fds[1]))
                else:
                    child_fds.append(_child_descriptor(stream))
            child_fds.extend(os.dup(fd) for fd in pass_fds)
            reply = self._ask(
                {
                    "op": "start",
                    "args": list(args),
                    "env": dict(env),
                    "cwd": os.fspath(cwd or os.getcwd()),
                    "python_path": python_path,
                    "fd_targets": [0, 1, 2, *pass_fds],
                    "new_session": start_new_session,
                    "sigint_default": sigint_default,
                },
                child_fds,
            )
        finally:
            for fd in child_fds:
                os.close(fd)
        return ForkedProcess(self, reply["pid"], args, ours)

    def close(self) -> None:
        self._connection.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    """This process's fork server, started on first use."""
    global _server
    with _server_lock:
        if _server is None or _server._process.poll() is not None:
            _server = ForkServer()
        return _server


def stop() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


if __name__ == "__main__":
    main()
