"""Launches the real Triton Inference Server shipped in the `nvidia-pytriton` wheel, on this machine.

The wheel carries a `tritonserver` binary and the Python backend. Running it outside PyTriton needs:
the wheel's bundled libraries on LD_LIBRARY_PATH; the Python backend stub for this interpreter placed
beside `libtriton_python.so`; this interpreter's own libpython first on LD_LIBRARY_PATH (the stub
crashes with `'_thread.RLock' object has no attribute '_recursion_count'` when it picks the system's
copy); and this environment's interpreter first on PATH and its site-packages on PYTHONPATH, so
models import this environment's numpy/onnxruntime.

Triton runs in a session and process group of its own, which its Python backend stubs (one process
per model instance, hundreds of MB each) share. The launcher ends the whole group: on stop(), and on
its own as soon as tritonserver exits unasked (a crash, kill -9), because stubs wait forever on a
dead tritonserver nobody has reaped. A stub that needs SIGKILL leaves its shared-memory region in
/dev/shm; the launcher removes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from embeddings.errors import EmbedsiteError

# Our python-based backends: <name>/model.py, served by the Python backend to every model whose
# config says `backend: "<name>"`.
from embeddings.in_triton import BACKENDS_DIR as PYTHON_BASED_BACKENDS_DIR

PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


PYTHON_BACKEND_LIBRARY = "libtriton_python.so"


class TritonServerError(EmbedsiteError, RuntimeError):
    """Triton could not be found, started, or did not become ready."""


@dataclass(frozen=True)
class TritonDistribution:
    """Where the pieces of the wheel's Triton live."""

    binary: Path
    python_backend_dir: Path
    python_stub: Path
    bundled_libs: Path

    @classmethod
    def locate(cls) -> TritonDistribution:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonServerError(
                "The nvidia-pytriton wheel is not installed; run the setup (`make setup`)."
            )
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        server_dir = package_dir / "tritonserver"
        found = cls(
            binary=server_dir / "bin" / "tritonserver",
            python_backend_dir=server_dir / "backends" / "python",
            python_stub=server_dir / "python_backend_stubs" / PYTHON_VERSION / "triton_python_backend_stub",
            bundled_libs=package_dir.parent / "nvidia_pytriton.libs",
        )
        for path in (found.binary, found.python_backend_dir, found.python_stub, found.bundled_libs):
            if not path.exists():
                raise TritonServerError(f"The nvidia-pytriton wheel is incomplete: {path} is missing")
        return found


def _copy_if_changed(source: Path, target: Path) -> None:
    """Copy `source` to `target` unless `target` is a regular file with the same bytes already
    (a copy, not a link: Triton follows neither out of its backend directory)."""
    unchanged = (
        target.is_file()
        and not target.is_symlink()
        and target.stat().st_size == source.stat().st_size
        and target.read_bytes() == source.read_bytes()
    )
    if unchanged:
        return
    target.unlink(missing_ok=True)
    shutil.copy2(source, target)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Loaded in the parent, once: die_with_parent runs between fork and exec, where loading a library
# (dlopen, its lock perhaps held by another thread at the fork, e.g. gRPC's) can deadlock the child.
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
PR_SET_PDEATHSIG = 1


# Lets clients ping connections with calls in flight every second or more (TRITON_KEEPALIVE_S):
# Triton's default treats pings closer than 300 s as abuse and closes the connection.
TRITON_PING_FLAGS = ("--grpc-http2-min-recv-ping-interval-without-data=1000",)


def die_with_parent() -> None:
    """Linux: SIGTERM this child when its parent dies (a killed test run, a crashed launcher)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# Each stub of a Python-based backend maps a region named after its backend: the Python backend's own
# (triton_python_backend_shm_region_...) and ours (triton_embedsite_onnx_backend_shm_region_..., and
# the torch backend's), 16 MB each.
PYTHON_BACKEND_SHM_REGION = re.compile(r"/dev/shm/(triton_[a-z0-9_]+_shm_region_[0-9a-f-]+)")


def process_group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out: they hold no memory) in process group `pgid`, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                line = stat.read()
        except OSError:  # ended meanwhile
            continue
        # Fields after the command name (which may hold spaces or parentheses): state, ppid, pgrp.
        state, _ppid, pgrp = line[line.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def shared_memory_regions(pids: Sequence[int]) -> set[str]:
    """Names of the Python backend's shared-memory regions (in /dev/shm) these processes have mapped."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            names.update(PYTHON_BACKEND_SHM_REGION.findall(maps.read()))
    return names


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _wait_until_group_ends(pgid: int, deadline: float) -> bool:
    while process_group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def end_process_group(process: subprocess.Popen, *, timeout_s: float, kill_timeout_s: float = 5.0) -> None:
    """End the process group `process` leads (started with start_new_session=True): SIGTERM to the
    group, up to timeout_s for the leader and every member to exit, then SIGKILL to the group (at
    once when timeout_s is 0).

    Works when the leader has died already: its group lives on while any member does, and Linux does
    not hand its number to a new process meanwhile. Regions of /dev/shm that members killed by
    SIGKILL could not remove are removed here (only those the group's own processes had mapped).
    """
    pgid = process.pid
    if timeout_s > 0:
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        # Reaping the leader matters: its stubs take a zombie for a live parent and wait on it forever.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
        if _wait_until_group_ends(pgid, deadline):
            return
    regions = shared_memory_regions([pgid, *process_group_members(pgid)])
    _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=kill_timeout_s)
    _wait_until_group_ends(pgid, time.monotonic() + kill_timeout_s)
    for name in regions:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def _wait_for_exit(process: subprocess.Popen) -> None:
    """Block until `process` exits, without reaping it (a pidfd; polling where the kernel has none)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:  # exited and reaped already
        return
    except OSError:  # no pidfd_open (Linux < 5.3)
        while process.poll() is None:
            time.sleep(0.5)
        return
    try:
        if process.returncode is None:  # else the pid may be another process's by now
            waiter = select.poll()  # not select.select: it fails for descriptors above 1023
            waiter.register(pidfd, select.POLLIN)
            waiter.poll()
    finally:
        os.close(pidfd)


class TritonProcessGroup:
    """A started tritonserver and its process group, ended exactly once: by the launcher's stop(), or
    by a watcher thread as soon as tritonserver exits on its own."""

    def __init__(self, process: subprocess.Popen, *, stop_timeout_s: float) -> None:
        self.process = process
        self.stop_timeout_s = stop_timeout_s
        self._lock = threading.Lock()
        self._ended = False
        threading.Thread(
            target=self._end_when_leader_exits, name=f"triton-{process.pid}-group", daemon=True
        ).start()

    def end(self, timeout_s: float | None = None) -> None:
        """End the group (see end_process_group); returns once it is over, whoever began it."""
        with self._lock:
            if not self._ended:
                end_process_group(
                    self.process, timeout_s=self.stop_timeout_s if timeout_s is None else timeout_s
                )
                self._ended = True

    def _end_when_leader_exits(self) -> None:
        _wait_for_exit(self.process)
        self.end()


MODEL_CONTROL_MODES = ("none", "explicit", "poll")


class TritonServer:
    """One tritonserver process serving the given model repositories on loopback ports.

    model_control_mode: "none" loads every model of the repositories at start and nothing after;
    "explicit" loads only `startup_models` at start, and then what clients load through the model
    repository API (TritonClient.model_load); "poll" follows the repositories' changes on its own.
    """

    def __init__(
        self,
        *,
        model_repositories: Sequence[Path],
        run_dir: Path,
        grpc_port: int,
        http_port: int,
        metrics_port: int,
        address: str = "127.0.0.1",
        model_config_name: str = "",
        model_control_mode: str = "none",
        startup_models: Sequence[str] = (),
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.model_repositories = [Path(p).resolve() for p in model_repositories]
        self.run_dir = Path(run_dir)
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.address = address
        self.model_config_name = model_config_name
        if model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(
                f"model_control_mode must be one of {MODEL_CONTROL_MODES}, not {model_control_mode!r}"
            )
        if startup_models and model_control_mode != "explicit":
            raise ValueError(
                "startup_models need model_control_mode='explicit' (other modes load everything)"
            )
        self.model_control_mode = model_control_mode
        self.startup_models = list(startup_models)
        self.log_path = log_path
        self.extra_args = list(extra_args)
        # How long Triton's group gets to exit after SIGTERM before SIGKILL (Triton itself waits up
        # to --exit-timeout-secs=10 for requests in flight).
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self._group: TritonProcessGroup | None = None
        self._log_file = None

    @property
    def grpc_target(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.address}:{self.http_port}"

    def _prepare_backends(self, dist: TritonDistribution) -> Path:
        """A backend directory holding the Python backend with this interpreter's stub beside it, and
        our python-based backends (`embedsite_onnx`, `embedsite_torch`) served through it."""
        backends = self.run_dir / "triton_backends"
        python_dir = backends / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        for source in dist.python_backend_dir.iterdir():
            if source.name in ("__pycache__", PYTHON_BACKEND_LIBRARY):
                continue
            link = python_dir / source.name
            if not link.exists() or link.resolve() != source.resolve():
                link.unlink(missing_ok=True)
                link.symlink_to(source)
        # Triton refuses to serve a python-based backend through a libtriton_python.so that is a
        # symlink ("backend library name 'libtriton_python.so' escapes backend directory").
        _copy_if_changed(
            dist.python_backend_dir / PYTHON_BACKEND_LIBRARY, python_dir / PYTHON_BACKEND_LIBRARY
        )
        _copy_if_changed(dist.python_stub, python_dir / "triton_python_backend_stub")
        for backend in PYTHON_BASED_BACKENDS_DIR.iterdir():
            if (backend / "model.py").is_file():
                (backends / backend.name).mkdir(exist_ok=True)
                # model.py and the modules it loads from beside it (embedsite_torch's encoder.py).
                for source in backend.glob("*.py"):
                    _copy_if_changed(source, backends / backend.name / source.name)
        return backends

    def _environment(self, dist: TritonDistribution) -> dict[str, str]:
        env = dict(os.environ)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        ld_path = [libdir, str(dist.bundled_libs), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in ld_path if p)
        site_packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        python_path = [*sorted(site_packages), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
        # The stub takes its packages from the `python3` first on PATH, not only PYTHONPATH: without
        # this environment's interpreter first it may load another numpy and return empty tensors.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def command(self, dist: TritonDistribution, backends: Path) -> list[str]:
        args = [str(dist.binary)]
        args += [f"--model-repository={repo}" for repo in self.model_repositories]
        args += [
            f"--backend-directory={backends}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.metrics_port}",
            *TRITON_PING_FLAGS,
            "--pinned-memory-pool-byte-size=0",
            "--exit-timeout-secs=10",
            # Every config we serve is complete. Auto-completion would start one Python stub per
            # model at each load only to ask its model.py (none completes anything): 3 of a
            # start's 4.5 s here.
            "--disable-auto-complete-config",
            # Larger shared-memory regions between Triton and the Python stub: fewer resizes
            # for big batches of embeddings.
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=16777216",
        ]
        if self.model_config_name:
            args.append(f"--model-config-name={self.model_config_name}")
        args.append(f"--model-control-mode={self.model_control_mode}")
        args += [f"--load-model={name}" for name in self.startup_models]
        return args + self.extra_args

    @property
    def process_group(self) -> int | None:
        """The id of Triton's process group (tritonserver's pid), while this launcher holds one."""
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError("Triton is already running")
        # A Triton that died since: what is left of its group (stubs) ends before a new one starts.
        self.stop()
        for repo in self.model_repositories:
            if not repo.is_dir():
                raise TritonServerError(f"Model repository {repo} does not exist")
        dist = TritonDistribution.locate()
        backends = self._prepare_backends(dist)
        output = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            output = self._log_file
        self.process = subprocess.Popen(
            self.command(dist, backends),
            env=self._environment(dist),
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches our launcher, which stops Triton in order
            preexec_fn=die_with_parent,
        )
        self._group = TritonProcessGroup(self.process, stop_timeout_s=self.stop_timeout_s)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(Triton's log went to the console)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until every model is loaded (Triton's strict readiness), or raise with the log."""
        if self.process is None:
            raise TritonServerError("Triton was not started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(
                    f"Triton exited with status {code} while starting:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TritonServerError(f"Triton was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float | None = None) -> None:
        """End Triton's whole process group (its backend stubs too), whether tritonserver is still
        running or has died; return once none of it is left. timeout_s (default stop_timeout_s) is
        how long the group gets after SIGTERM; 0 kills it at once (no graceful unload: Triton takes
        3-10 s to unload its models one poll a second), for a caller with nothing in flight."""
        group, self._group, self.process = self._group, None, None
        if group is not None:
            group.end(timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL tritonserver alone, as a crash would (for fault tests); what is left of its group
        ends as after any crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        self.stop()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
