"""Launches the real Triton Inference Server shipped in the `nvidia-pytriton` wheel, on this machine.

The wheel carries a `tritonserver` binary and the Python backend. Running it outside PyTriton needs:
the wheel's bundled libraries on LD_LIBRARY_PATH; the Python backend stub for this interpreter placed
beside `libtriton_python.so`; this interpreter's own libpython first on LD_LIBRARY_PATH (the stub
crashes with `'_thread.RLock' object has no attribute '_recursion_count'` when it picks the system's
copy); and this environment's interpreter first on PATH and its site-packages on PYTHONPATH, so
models import this environment's numpy/onnxruntime.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonServerError(RuntimeError):
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Linux: SIGTERM this child when its parent dies (a killed test run, a crashed launcher)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class TritonServer:
    """One tritonserver process serving the given model repositories on loopback ports."""

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
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model_repositories = [Path(p).resolve() for p in model_repositories]
        self.run_dir = Path(run_dir)
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.address = address
        self.model_config_name = model_config_name
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def grpc_target(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.address}:{self.http_port}"

    def _prepare_backends(self, dist: TritonDistribution) -> Path:
        """A backend directory holding the Python backend with this interpreter's stub beside it."""
        backends = self.run_dir / "triton_backends"
        python_dir = backends / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        for source in dist.python_backend_dir.iterdir():
            if source.name == "__pycache__":
                continue
            link = python_dir / source.name
            if not link.exists() or link.resolve() != source.resolve():
                link.unlink(missing_ok=True)
                link.symlink_to(source)
        stub = python_dir / "triton_python_backend_stub"
        if not stub.exists() or stub.stat().st_size != dist.python_stub.stat().st_size:
            shutil.copy2(dist.python_stub, stub)
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
            "--pinned-memory-pool-byte-size=0",
            "--exit-timeout-secs=10",
            # Larger shared-memory regions between Triton and the Python stub: fewer resizes
            # for big batches of embeddings.
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=16777216",
        ]
        if self.model_config_name:
            args.append(f"--model-config-name={self.model_config_name}")
        return args + self.extra_args

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError("Triton is already running")
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

    def stop(self, timeout_s: float = 15.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: for fault tests."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        self.stop()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
