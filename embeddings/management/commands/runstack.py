"""Run the whole local service: Redis (the critical one, the job store and, where it is on, the
embedding cache), Triton, Celery (worker, beat), then the ASGI server (`manage.py serve`); a child
that dies is restarted, Ctrl-C stops all.

The supervision (delays, giving up) is embeddings/tooling/supervision.py; this module says what each
child is: how it starts, when it is ready, what a dead one leaves behind.
"""

import http.client
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, OutputWrapper
from prometheus_client import multiprocess as prometheus_multiprocess

from embeddings.observability.logs import LogLines
from embeddings.tooling.local_redis import RedisServer, RedisServerError, local_redis_servers
from embeddings.tooling.local_triton import local_triton_server
from embeddings.tooling.supervision import Child, RestartPolicy, StackFailed, Supervisor
from embeddings.tooling.triton_server import (
    TritonServer,
    TritonServerError,
    die_with_parent,
    end_process_group,
)

# How often the supervisor looks at its children: a death is noticed within this long.
TICK_S = 0.2
# Against a child that never gets ready (a hung import, a port that never answers), not for timing:
# Redis answers in milliseconds, Django and Celery import in seconds on a loaded machine.
REDIS_STARTUP_TIMEOUT_S = 20.0
WEB_STARTUP_TIMEOUT_S = 120.0


def fresh_prometheus_dir() -> Path:
    """PROMETHEUS_MULTIPROC_DIR (default .run/prometheus), emptied: values of a previous run's
    processes must not be summed into this one's."""
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or settings.RUN_DIR / "prometheus")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return path


def forget_dead_processes(directory: Path) -> None:
    """Remove the live-gauge files of processes that no longer run from PROMETHEUS_MULTIPROC_DIR. A web
    process removes its own as it stops (embeddings/metrics.py lifespan); a killed one cannot, and
    `livesum` gauges (calls and tokens in flight) would count its last values for ever. Counters and
    histograms of dead processes stay, as prometheus_client means them to: /metrics still counts
    what they served, and never goes backwards."""
    for path in directory.glob("gauge_live*_*.db"):
        pid = int(path.stem.rpartition("_")[2])
        if not _running(pid):
            prometheus_multiprocess.mark_process_dead(pid, str(directory))


def _running(pid: int) -> bool:
    """Whether `pid` runs: a zombie does not (a killed worker whose parent died too waits for init,
    which in a container may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def celery_arguments(role: str) -> list[str]:
    """Python's arguments for `celery -A embedsite worker|beat` as runstack runs it."""
    arguments = {
        # One process is plenty for the fold; solo keeps it to one.
        "worker": ["worker", "--pool", "solo", "--without-gossip", "--without-mingle"],
        "beat": ["beat"],
    }[role]
    # No plain-text startup banner among JSON log lines.
    quiet = ["--quiet"] if settings.LOG_FORMAT == "json" else []
    return ["-m", "celery", "-A", "embedsite", *quiet, *arguments, "--loglevel", "INFO"]


def start_celery(role: str, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`celery -A embedsite worker|beat` in its own session, its output appended to log_path.

    Beat keeps its schedule in CELERY_BEAT_SCHEDULE_FILENAME (RUN_DIR) as the child's settings say.
    """
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, *celery_arguments(role)],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def stop_process(process: subprocess.Popen | None, timeout_s: float = 15) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ModelsReconcile:
    """`manage.py reconcile_models` in a child process, its lines written to `out` once it ends. This
    process never opens a gRPC channel itself: the children it forks after would inherit gRPC's
    threads and fork handlers, which can abort a child between fork and exec (seen once in CI:
    status -6). Run, not waited for, so the supervisor watches the other children meanwhile."""

    def __init__(self, out: OutputWrapper) -> None:
        self.out = out
        self.output = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finished() or cancel()
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "reconcile_models"],
            cwd=settings.BASE_DIR,
            stdout=self.output,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.deadline = time.monotonic() + settings.TRITON_STARTUP_TIMEOUT_S
        self.over = False

    def finished(self) -> bool:
        """Whether it is over (done, failed or cut at its deadline), each said to `out` once."""
        if self.over:
            return True
        if self.process.poll() is None:
            if time.monotonic() < self.deadline:
                return False
            self.cancel()
            self.out.write(f"Catalog models not loaded within {settings.TRITON_STARTUP_TIMEOUT_S:g} s")
            return True
        self.over = True
        self.output.seek(0)
        for line in self.output.read().decode(errors="replace").splitlines():
            self.out.write(line)
        self.output.close()
        if self.process.returncode != 0:
            self.out.write(
                f"Catalog models not loaded: reconcile_models exited with status {self.process.returncode}"
            )
        return True

    def cancel(self) -> None:
        self.over = True
        stop_process(self.process, timeout_s=5)
        self.output.close()


class RedisChild(Child):
    """A Redis server of runstack's: restarted on the same port and data directory, so the job store
    finds its append-only file again."""

    startup_timeout_s = REDIS_STARTUP_TIMEOUT_S

    def __init__(self, role: str, server: RedisServer) -> None:
        self.name = f"Redis ({role})"
        self.server = server
        self.log_path = server.log_path

    def start(self) -> None:
        self.server.start()

    def exit_status(self) -> int | None:
        return None if self.server.process is None else self.server.process.poll()

    def ready(self) -> bool:
        return self.server.is_ready()

    def end_remains(self) -> None:
        # A child it forked (an append-only file rewrite) shares its group and may outlive it.
        end_process_group(self.server.process, timeout_s=REDIS_STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        self.server.stop()

    def ready_line(self) -> str:
        server = self.server
        return (
            f"{self.name} ready: {server.url} (data: {server.data_dir}, maxmemory {server.maxmemory_mb} MiB, "
            "noeviction)"
        )


class TritonChild(Child):
    """The local Triton: ready once it serves its startup models and the catalog's models are loaded
    again (they are not among the startup models)."""

    name = "Triton"

    def __init__(self, triton: TritonServer, out: OutputWrapper) -> None:
        self.triton = triton
        self.log_path = triton.log_path
        self.startup_timeout_s = settings.TRITON_STARTUP_TIMEOUT_S
        self.out = out
        self.reconcile: ModelsReconcile | None = None

    def start(self) -> None:
        # start() first ends what is left of a dead Triton's group: stubs and their shared memory.
        self.triton.start()
        self.reconcile = None

    def exit_status(self) -> int | None:
        process = self.triton.process
        return None if process is None else process.poll()

    def ready(self) -> bool:
        if self.reconcile is None:
            if not self.triton.is_ready():
                return False
            self.reconcile = ModelsReconcile(self.out)
        return self.reconcile.finished()

    def end_remains(self) -> None:
        self._cancel_reconcile()
        self.triton.stop()  # its whole process group, hung stubs SIGKILLed, their /dev/shm removed

    def stop(self) -> None:
        self._cancel_reconcile()
        self.triton.stop()

    def starting_line(self) -> str:
        return f"Starting Triton (log: {self.log}) ..."

    def ready_line(self) -> str:
        return f"Triton ready: gRPC {self.triton.grpc_target}"

    def _cancel_reconcile(self) -> None:
        if self.reconcile is not None:
            self.reconcile.cancel()


class ProcessChild(Child):
    """A child runstack starts itself in a session of its own (its process group)."""

    stop_timeout_s = 15.0

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def spawn(self) -> subprocess.Popen:
        raise NotImplementedError

    def start(self) -> None:
        self.process = self.spawn()

    def exit_status(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def end_remains(self) -> None:
        end_process_group(self.process, timeout_s=self.stop_timeout_s)

    def stop(self) -> None:
        stop_process(self.process, timeout_s=self.stop_timeout_s)


class CeleryChild(ProcessChild):
    """`celery worker` or `beat`: ready once it runs (Celery says more only in its log)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role
        self.name = f"the Celery {role}"
        self.log_path = settings.RUN_DIR / f"celery-{role}.log"
        # The worker finishes the chunk it is running (warm shutdown); beat only sends.
        self.stop_timeout_s = 30.0 if role == "worker" else 15.0

    def spawn(self) -> subprocess.Popen:
        return start_celery(self.role, self.log_path)


class WebChild(ProcessChild):
    """`manage.py serve`, its lines on runstack's own output; ready once it answers HTTP."""

    name = "the web server"
    startup_timeout_s = WEB_STARTUP_TIMEOUT_S

    def __init__(self, *, host: str, port: int, workers: int) -> None:
        super().__init__()
        self.host, self.port, self.workers = host, port, workers
        # It drains, then lets requests in flight finish (README "Graceful shutdown").
        self.stop_timeout_s = settings.SHUTDOWN_DRAIN_S + settings.SHUTDOWN_TIMEOUT_S + 15
        # Set before the workers import prometheus_client: each writes its values to files there, and
        # /metrics (whichever worker answers) sums them. Emptied once per run, not per restart.
        self.prometheus_dir = fresh_prometheus_dir()

    def spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable, "manage.py", "serve",
                "--host", self.host, "--port", str(self.port), "--workers", str(self.workers),
            ],
            cwd=settings.BASE_DIR,
            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.prometheus_dir)},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip

    def ready(self) -> bool:
        # Any answer will do (a Host outside DJANGO_ALLOWED_HOSTS is answered 400): it serves.
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        connection = http.client.HTTPConnection(host, self.port, timeout=0.5)
        try:
            connection.request("GET", "/health")
            connection.getresponse()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()
        return True

    def end_remains(self) -> None:
        # With several workers, uvicorn's own supervisor is what died: its workers live on, holding the
        # port, until their group is ended (SIGTERM: they finish what they serve).
        super().end_remains()
        forget_dead_processes(self.prometheus_dir)


def restart_policy() -> RestartPolicy:
    return RestartPolicy(
        first_delay_s=settings.RUNSTACK_RESTART_DELAY_S,
        max_delay_s=settings.RUNSTACK_RESTART_MAX_DELAY_S,
        stable_s=settings.RUNSTACK_RESTART_STABLE_S,
        attempts=settings.RUNSTACK_RESTART_ATTEMPTS,
    )


class Command(BaseCommand):
    help = (
        "Start Redis, Triton, the Celery worker and beat and the embedsite ASGI server on the configured "
        "ports; restart any that dies; Ctrl-C stops all."
    )

    def add_arguments(self, parser):
        parser.add_argument("--workers", type=int, default=settings.WEB_CONCURRENCY)
        parser.add_argument("--host", default=settings.SERVER_HOST)
        parser.add_argument("--port", type=int, default=settings.SERVER_PORT)

    def handle(self, *args, workers, host, port, **options):
        # With LOG_FORMAT=json what runstack says is log lines too, among the web server's (same
        # terminal), its warnings and last error included; in text, plain lines as before.
        if settings.LOG_FORMAT != "json":
            self.run_stack(self.stdout, self.stderr.write, workers=workers, host=host, port=port)
            return
        logger = logging.getLogger("embedsite.runstack")
        try:
            self.run_stack(
                OutputWrapper(LogLines(logger)), logger.warning, workers=workers, host=host, port=port
            )
        except CommandError as error:
            logger.error("%s", error)
            sys.exit(1)

    def run_stack(self, out: OutputWrapper, warn, *, workers: int, host: str, port: int) -> None:
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        settings.RUN_DIR.mkdir(parents=True, exist_ok=True)
        redis_servers = local_redis_servers() if settings.RUNSTACK_STARTS_REDIS else {}
        triton = TritonChild(local_triton_server(log_path=settings.RUN_DIR / "triton.log"), out)
        celery = [CeleryChild("worker"), CeleryChild("beat")]
        web = WebChild(host=host, port=port, workers=workers)
        # Started in this order, each once the one before is ready (the catalog's models are served
        # before the web server takes its first request), and stopped in the reverse order: the web
        # server first, then beat (it only sends), the worker (it finishes its chunk), Triton, and
        # Redis last (the others may still write to it while stopping).
        redis = [RedisChild(role, server) for role, server in redis_servers.items()]
        supervisor = Supervisor([*redis, triton, *celery, web], restart_policy(), say=out.write, warn=warn)
        try:
            if supervisor.start_all(stop, TICK_S):
                self.announce(out, triton=triton.triton, web=web, celery=celery)
                while not stop.wait(TICK_S):
                    supervisor.tick()
        except (StackFailed, TritonServerError, RedisServerError) as error:
            raise CommandError(str(error)) from error
        finally:
            supervisor.stop_all()
            out.write("Stopped.")

    def announce(self, out: OutputWrapper, *, triton: TritonServer, web: WebChild, celery: list[CeleryChild]):
        base = f"http://{web.host}:{web.port}"
        manage = f"{sys.executable} manage.py"
        worker, beat = (child.log_path for child in celery)
        out.write(
            f"embedsite on {base}  ({web.workers} worker(s), Triton gRPC {triton.grpc_target})",
            self.style.SUCCESS if out is self.stdout else None,
        )
        out.write(
            f"  API docs   {base}/explorer/   {base}/redoc/   schema {base}/api/schema/\n"
            f"  admin      {base}/admin/   (first: {manage} createsuperuser)\n"
            f"  health     {base}/health   {base}/ready   {base}/metrics\n"
            f"  usage      {base}/v1/usage   folded into the database every "
            f"{settings.USAGE_FOLD_INTERVAL_S:g} s by Celery beat + worker (logs: {beat}, {worker})\n"
            f"  first key  {manage} create_tenant --name Acme && {manage} create_api_key --tenant acme\n"
            f'  embed      curl {base}/v1/embeddings -H "Authorization: Bearer $KEY" '
            '-H "Content-Type: application/json" '
            """-d '{"model": "all-MiniLM-L6-v2", "input": "hello"}'\n"""
            "  Any part that dies is restarted (README: Reliability and security). Stop: Ctrl-C"
        )
