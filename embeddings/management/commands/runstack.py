"""Run the whole local service: Redis (the critical one and the job store), Celery (worker, beat),
Triton, then the ASGI server (`manage.py serve`); Ctrl-C stops all."""

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, OutputWrapper

from embeddings.observability.logs import LogLines
from embeddings.tooling.local_redis import RedisServerError, local_redis_servers
from embeddings.tooling.local_triton import local_triton_server
from embeddings.triton.server import TritonServerError, die_with_parent


def fresh_prometheus_dir() -> Path:
    """PROMETHEUS_MULTIPROC_DIR (default .run/prometheus), emptied: values of a previous run's
    processes must not be summed into this one's."""
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or settings.RUN_DIR / "prometheus")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return path


def reconcile_catalog_models(out: OutputWrapper) -> None:
    """`manage.py reconcile_models` in a child process, its lines written to `out`. This process never
    opens a gRPC channel itself: the web server it forks next would inherit gRPC's threads and fork
    handlers, which can abort a child between fork and exec (seen once in CI: status -6)."""
    try:
        reconcile = subprocess.run(
            [sys.executable, "manage.py", "reconcile_models"],
            cwd=settings.BASE_DIR,
            stdout=subprocess.PIPE,
            text=True,
            timeout=settings.TRITON_STARTUP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        out.write(f"Catalog models not loaded within {settings.TRITON_STARTUP_TIMEOUT_S:g} s")
        return
    for line in reconcile.stdout.splitlines():
        out.write(line)
    if reconcile.returncode != 0:
        out.write(f"Catalog models not loaded: reconcile_models exited with status {reconcile.returncode}")


def start_celery(role: str, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`celery -A embedsite worker|beat` in its own session, its output appended to log_path.

    Beat keeps its schedule in CELERY_BEAT_SCHEDULE_FILENAME (RUN_DIR) as the child's settings say.
    """
    arguments = {
        # One process is plenty for the fold; solo keeps it to one.
        "worker": ["worker", "--pool", "solo", "--without-gossip", "--without-mingle"],
        "beat": ["beat"],
    }[role]
    # No plain-text startup banner among JSON log lines.
    quiet = ["--quiet"] if settings.LOG_FORMAT == "json" else []
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "embedsite", *quiet, *arguments, "--loglevel", "INFO"],
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


class Command(BaseCommand):
    help = (
        "Start Redis, the Celery worker and beat, Triton and the embedsite ASGI server on the configured "
        "ports; Ctrl-C stops all."
    )

    def add_arguments(self, parser):
        parser.add_argument("--workers", type=int, default=settings.WEB_CONCURRENCY)
        parser.add_argument("--host", default=settings.SERVER_HOST)
        parser.add_argument("--port", type=int, default=settings.SERVER_PORT)

    def handle(self, *args, workers, host, port, **options):
        # With LOG_FORMAT=json what runstack says is log lines too, among the web server's (same
        # terminal), its last error included; in text, plain lines as before.
        if settings.LOG_FORMAT != "json":
            self.run_stack(self.stdout, workers=workers, host=host, port=port)
            return
        logger = logging.getLogger("embedsite.runstack")
        try:
            self.run_stack(OutputWrapper(LogLines(logger)), workers=workers, host=host, port=port)
        except CommandError as error:
            logger.error("%s", error)
            sys.exit(1)

    def run_stack(self, out: OutputWrapper, *, workers: int, host: str, port: int) -> None:
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        triton_log = settings.RUN_DIR / "triton.log"
        triton = local_triton_server(log_path=triton_log)
        redis_servers = local_redis_servers() if settings.RUNSTACK_STARTS_REDIS else {}
        web = None
        celery: dict[str, subprocess.Popen] = {}
        celery_logs = {role: settings.RUN_DIR / f"celery-{role}.log" for role in ("worker", "beat")}
        try:
            for role, redis_server in redis_servers.items():
                redis_server.start()
                redis_server.wait_until_ready()
                out.write(
                    f"Redis ({role}) ready: {redis_server.url} (data: {redis_server.data_dir}, "
                    f"maxmemory {redis_server.maxmemory_mb} MiB, noeviction)"
                )
            settings.RUN_DIR.mkdir(parents=True, exist_ok=True)
            for role, log_path in celery_logs.items():
                celery[role] = start_celery(role, log_path)
            out.write(f"Starting Triton (log: {triton_log}) ...")
            triton.start()
            triton.wait_until_ready(settings.TRITON_STARTUP_TIMEOUT_S)
            out.write(f"Triton ready: gRPC {triton.grpc_target}")
            # The catalog's models are served before the web server takes its first request.
            reconcile_catalog_models(out)
            # Set before the workers import prometheus_client: each writes its values to files
            # there, and /metrics (whichever worker answers) sums them.
            web_env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(fresh_prometheus_dir())}
            web = subprocess.Popen(
                [
                    sys.executable, "manage.py", "serve",
                    "--host", host, "--port", str(port), "--workers", str(workers),
                ],
                cwd=settings.BASE_DIR,
                env=web_env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )  # fmt: skip
            base = f"http://{host}:{port}"
            manage = f"{sys.executable} manage.py"
            out.write(
                f"embedsite on {base}  ({workers} worker(s), Triton gRPC {triton.grpc_target})",
                self.style.SUCCESS if out is self.stdout else None,
            )
            out.write(
                f"  API docs   {base}/explorer/   {base}/redoc/   schema {base}/api/schema/\n"
                f"  admin      {base}/admin/   (first: {manage} createsuperuser)\n"
                f"  health     {base}/health   {base}/ready   {base}/metrics\n"
                f"  usage      {base}/v1/usage   folded into the database every "
                f"{settings.USAGE_FOLD_INTERVAL_S:g} s by Celery beat + worker "
                f"(logs: {celery_logs['beat']}, {celery_logs['worker']})\n"
                f"  first key  {manage} create_tenant --name Acme && {manage} create_api_key --tenant acme\n"
                f'  embed      curl {base}/v1/embeddings -H "Authorization: Bearer $KEY" '
                '-H "Content-Type: application/json" '
                """-d '{"model": "all-MiniLM-L6-v2", "input": "hello"}'\n"""
                "  Stop: Ctrl-C"
            )
            while not stop.wait(0.5):
                if triton.process is None or triton.process.poll() is not None:
                    # Its backend stubs (hundreds of MB each) end first, before the rest winds down.
                    triton.stop()
                    raise CommandError(f"Triton exited unexpectedly; see {triton_log}")
                for role, redis_server in redis_servers.items():
                    if redis_server.process.poll() is not None:
                        raise CommandError(f"Redis ({role}) exited unexpectedly; see {redis_server.log_path}")
                if web.poll() is not None:
                    raise CommandError(f"The web server exited with status {web.returncode}")
                for role, process in celery.items():
                    if process.poll() is not None:
                        raise CommandError(
                            f"The Celery {role} exited with status {process.returncode}; "
                            f"see {celery_logs[role]}"
                        )
        except (TritonServerError, RedisServerError) as error:
            raise CommandError(str(error)) from error
        finally:
            # It drains, then lets requests in flight finish (README "Graceful shutdown").
            stop_process(web, timeout_s=settings.SHUTDOWN_DRAIN_S + settings.SHUTDOWN_TIMEOUT_S + 15)
            # Beat first (it only sends); the worker finishes the fold it is running (warm shutdown).
            stop_process(celery.get("beat"))
            stop_process(celery.get("worker"), timeout_s=30)
            triton.stop()
            for redis_server in redis_servers.values():
                redis_server.stop()  # last: the others may still write to it while stopping
            out.write("Stopped.")
