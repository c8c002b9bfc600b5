"""A local redis-server process (Debian's `redis-server`), shared by `runstack`, the tests and benchmarks."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings

from embeddings.errors import EmbedsiteError
from embeddings.tooling.triton_server import die_with_parent


class RedisServerError(EmbedsiteError, RuntimeError):
    """redis-server is missing, would not start, or stopped."""


class RedisServer:
    """One redis-server on a loopback port with its own data directory.

    persistent: append-only file in the data directory, written at once and fsynced every second
    (the local stack keeps quotas and unfolded usage across restarts; a crash loses at most the
    last second); off for tests, which want a clean, fast server.
    maxmemory_mb: the memory it may use, with noeviction (by default): past it, writes are refused
    (the caller gets an error) instead of keys silently evicted, quota windows and usage counters
    among them. A cache's server names an evicting policy instead (`eviction`).
    """

    def __init__(
        self,
        *,
        port: int,
        data_dir: Path,
        persistent: bool = True,
        log_path: Path | None = None,
        maxmemory_mb: int | None = None,
        eviction: str = "noeviction",
    ):
        self.port = port
        self.eviction = eviction
        self.data_dir = Path(data_dir)
        self.persistent = persistent
        self.log_path = log_path
        self.maxmemory_mb = maxmemory_mb
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, binary: str) -> list[str]:
        args = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", self.eviction,
            "--logfile", str(self.log_path or ""),
        ]  # fmt: skip
        if self.maxmemory_mb is not None:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb"]
        return args

    def start(self) -> None:
        binary = shutil.which(settings.REDIS_SERVER_BINARY) or (
            settings.REDIS_SERVER_BINARY if Path(settings.REDIS_SERVER_BINARY).is_file() else None
        )
        if binary is None:
            raise RedisServerError(
                f"{settings.REDIS_SERVER_BINARY!r} not found: the setup installs Debian's redis-server "
                "(`apt-get install redis-server`), or point REDIS_URL at a running Redis"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(binary),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches our launcher, which stops Redis after its users
            preexec_fn=die_with_parent,
        )

    def is_ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def wait_until_ready(self, timeout_s: float = 20.0) -> None:
        if self.process is None:
            raise RedisServerError("redis-server was not started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with status {self.process.returncode} while starting "
                    f"(port {self.port} taken?); log: {self.log_path}"
                )
            if self.is_ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer within {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)  # redis flushes its append-only file and exits
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crash would: for fault tests."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        self.wait_until_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _local_port(url: str, setting: str) -> int:
    parts = urlsplit(url)
    if parts.hostname not in {"127.0.0.1", "localhost"}:
        raise RedisServerError(f"{setting} points at {parts.hostname}: that Redis is not ours to start")
    return parts.port or 6379


def local_redis_servers() -> dict[str, RedisServer]:
    """The Redis servers `runstack` starts on this machine, by role: "critical" on REDIS_URL's port
    (data in RUN_DIR/redis, RUNSTACK_REDIS_MAXMEMORY_MB) and, where JOB_STORE_URL names another
    port, "job store" there (RUN_DIR/redis-jobs, RUNSTACK_JOB_STORE_MAXMEMORY_MB). Both keep an
    append-only file: the job store's keeps running jobs' inputs and progress across a restart. One
    server holding both roles gets both budgets. With EMBEDDING_CACHE on and EMBEDDING_CACHE_REDIS_URL
    naming a port of its own, "embedding cache" there: no file (a cache), at most
    RUNSTACK_EMBEDDING_CACHE_MAXMEMORY_MB, evicting (EMBEDDING_CACHE_EVICTION)."""
    servers = _stores()
    cache_url = settings.EMBEDDING_CACHE_REDIS_URL
    if settings.EMBEDDING_CACHE and cache_url:
        cache_port = _local_port(cache_url, "EMBEDDING_CACHE_REDIS_URL")
        if cache_port not in {server.port for server in servers.values()}:
            servers["embedding cache"] = RedisServer(
                port=cache_port,
                data_dir=Path(settings.RUN_DIR) / "redis-cache",
                persistent=False,
                log_path=Path(settings.RUN_DIR) / "redis-cache.log",
                maxmemory_mb=settings.RUNSTACK_EMBEDDING_CACHE_MAXMEMORY_MB,
                eviction=EMBEDDING_CACHE_EVICTION,
            )
    return servers


# The cache's Redis evicts the least frequently used entries when full: popular queries stay while a
# one-off re-index, read once, goes first (least recently used would let one big re-index push
# every popular query out).
EMBEDDING_CACHE_EVICTION = "allkeys-lfu"


def _stores() -> dict[str, RedisServer]:
    run_dir = Path(settings.RUN_DIR)
    critical_port = _local_port(settings.REDIS_URL, "REDIS_URL")
    job_store_port = _local_port(settings.JOB_STORE_URL, "JOB_STORE_URL") if settings.JOB_STORE_URL else None
    if job_store_port in (None, critical_port):
        return {
            "critical and job store": RedisServer(
                port=critical_port,
                data_dir=run_dir / "redis",
                log_path=run_dir / "redis.log",
                maxmemory_mb=settings.RUNSTACK_REDIS_MAXMEMORY_MB + settings.RUNSTACK_JOB_STORE_MAXMEMORY_MB,
            )
        }
    return {
        "critical": RedisServer(
            port=critical_port,
            data_dir=run_dir / "redis",
            log_path=run_dir / "redis.log",
            maxmemory_mb=settings.RUNSTACK_REDIS_MAXMEMORY_MB,
        ),
        "job store": RedisServer(
            port=job_store_port,
            data_dir=run_dir / "redis-jobs",
            log_path=run_dir / "redis-jobs.log",
            maxmemory_mb=settings.RUNSTACK_JOB_STORE_MAXMEMORY_MB,
        ),
    }
