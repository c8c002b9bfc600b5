"""The web server as shipped (`manage.py serve`): uvicorn with our flags, draining before it stops.

SIGTERM (or Ctrl-C) starts the shutdown, in every worker process:
1. drain, for `drain_s`: /ready answers 503 while everything else is served as before, so load
   balancers and Kubernetes take the process out of rotation before it stops accepting;
2. uvicorn's own graceful shutdown: the listening socket is closed (new connections are refused),
   idle keep-alive connections are closed, requests in flight get `timeout_s` to finish (then they
   are cancelled), the ASGI lifespan shuts down, the process exits.

Only step 1 is ours. uvicorn 0.54 has no hook for it, so `DrainingServer` delays its exit handler, and
the supervisor of several workers is uvicorn's own with that server in each worker.

Every connection is served by `EdgeProtocol` (embedsite/edge.py): bounded heads, head and write
timeouts, a connection cap and admission before a request runs (embeddings/api/admission.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import sys
import time
from types import FrameType

import uvicorn
from prometheus_client import multiprocess as prometheus_multiprocess
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

from embeddings import lifecycle
from embedsite.edge import EDGE_REFUSAL_REASONS, EdgeLimits, EdgeProtocol, edge_refusals

APPLICATION = "embedsite.asgi:application"

logger = logging.getLogger("uvicorn.error")


# Descriptors a process needs besides its clients' connections: Redis and Triton pools, the
# database, log files, the listening socket.
RESERVED_DESCRIPTORS = 256


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration with the shipped flags, the edge's limits and the drain, which travel
    with it to each worker process."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        workers: int,
        drain_s: float,
        timeout_s: float,
        edge_limits: EdgeLimits | None = None,
        keep_alive_s: float = 5.0,
    ):
        super().__init__(
            APPLICATION,
            host=host,
            port=port,
            workers=workers,
            loop="uvloop",
            http=EdgeProtocol,
            ws="websockets-sansio",
            timeout_keep_alive=keep_alive_s,
            # Our access log line (embeddings/observability/middleware.py) names the request id,
            # tenant and timings; uvicorn's would only repeat its first half.
            access_log=False,
            # Django's LOGGING (LOG_FORMAT) formats uvicorn's lines too, in every worker.
            log_config=None,
            timeout_graceful_shutdown=timeout_s,
        )
        self.shutdown_drain_s = drain_s
        self.edge_limits = edge_limits or edge_limits_from_settings()
        # Made in each worker process once the application (and Django) is loaded.
        self.admission = None

    def load(self) -> None:
        super().load()
        from embeddings.api.admission import admission_controller

        self.admission = admission_controller()
        edge_refusals.prepare(EDGE_REFUSAL_REASONS)


def edge_limits_from_settings() -> EdgeLimits:
    from django.conf import settings

    from embeddings.api import intake

    return EdgeLimits(
        max_head_bytes=settings.HTTP_MAX_HEAD_BYTES,
        max_headers=settings.HTTP_MAX_HEADERS,
        head_timeout_s=settings.HTTP_HEAD_TIMEOUT_S,
        write_timeout_s=settings.HTTP_WRITE_TIMEOUT_S,
        max_connections=connections_within_file_limit(settings.HTTP_MAX_CONNECTIONS),
        body_limit=intake.body_limit,
    )


def connections_within_file_limit(wanted: int) -> int:
    """Raise this process's soft file limit (inherited by its workers) to hold `wanted` connections
    plus RESERVED_DESCRIPTORS, as far as the hard limit allows; the connections it can hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + RESERVED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fitting = max(1, soft - RESERVED_DESCRIPTORS)
    logger.warning(
        "HTTP_MAX_CONNECTIONS=%d does not fit the file limit (%d): at most %d connections per process",
        wanted, soft, fitting,
    )  # fmt: skip
    return fitting


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT marks the process as shutting down (/ready: 503)
    and reaches uvicorn's own handler only `drain_s` later. During the drain a repeated SIGTERM
    changes nothing (systemd or a process-group kill may deliver it twice), a SIGINT ends the drain at
    once (Ctrl-C twice: stop now; a third forces uvicorn's exit)."""

    config: ServerConfig
    clock = staticmethod(time.monotonic)

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.drain_ends_at: float | None = None
        self.drain_signal: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        lifecycle.shutdown_begin()
        if self.drain_ends_at is None and not self.should_exit and self.config.shutdown_drain_s > 0:
            self.drain_ends_at = self.clock() + self.config.shutdown_drain_s
            self.drain_signal = sig
            logger.info("Draining for %g s: /ready answers 503", self.config.shutdown_drain_s)
            return
        if self.drain_signal is not None and not self.should_exit and sig == signal.SIGTERM:
            return
        self.drain_signal = None
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_signal is not None and self.clock() >= self.drain_ends_at:
            drained, self.drain_signal = self.drain_signal, None
            # uvicorn's handler, as if the signal came now: it also re-raises it once stopped.
            super().handle_exit(drained, None)
        return await super().on_tick(counter)


class DrainingWorkerProcess(multiprocess.Process):
    """One worker process of uvicorn's supervisor, running a DrainingServer."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = DrainingServer(config=self.config)
        return self._server


class Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor of several workers, which also closes its own copy of the listening socket
    when told to stop: the socket then closes once the last worker has stopped accepting, and new
    connections are refused at once instead of queueing, unanswered, until this process exits."""

    def handle_term(self) -> None:
        self._close_listening_sockets()
        super().handle_term()

    def handle_int(self) -> None:
        self._close_listening_sockets()
        super().handle_int()

    def _close_listening_sockets(self) -> None:
        for sock in self.sockets:
            sock.close()

    def keep_subprocess_alive(self) -> None:
        """uvicorn's replacement of a dead worker, then the dead one's live gauges removed: a killed
        worker cannot remove them itself (embeddings/metrics.py lifespan), and /metrics' `livesum`
        gauges (calls and tokens in flight) would count its last values for ever."""
        before = {process.pid for process in self.processes}
        super().keep_subprocess_alive()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            for pid in before - {process.pid for process in self.processes}:
                prometheus_multiprocess.mark_process_dead(pid)


def tokenize_on_one_thread() -> None:
    """Each web process tokenises a request's texts on its own thread unless TOKENIZERS_PARALLELISM
    says otherwise. A web process serves many requests at once; HF tokenizers' default spreads one
    request over every core, whose threads then spin on cores the other processes need: on a 16-core
    H100 host, 0.17-0.20 ms of web CPU per short text sent 32 a request instead of 0.24-0.26
    (README "GPU figures")."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def serve(*, host: str, port: int, workers: int, drain_s: float, timeout_s: float) -> None:
    """Serve embedsite until SIGTERM/SIGINT, then drain and shut down gracefully (module docstring)."""
    from django.conf import settings

    tokenize_on_one_thread()
    config = ServerConfig(
        host=host,
        port=port,
        workers=workers,
        drain_s=drain_s,
        timeout_s=timeout_s,
        keep_alive_s=settings.HTTP_KEEPALIVE_TIMEOUT_S,
    )
    if workers == 1:
        config.load_app()
        server = DrainingServer(config=config)
        # uvicorn re-raises a SIGINT once it has stopped; uvicorn.run() swallows it too.
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return
    # uvicorn's supervisor makes its workers from this module-level name; it has no other hook. Only
    # this process (which does nothing else) sees the change; tests/management/test_serve.py checks
    # that every worker drains.
    multiprocess.Process = DrainingWorkerProcess
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # This process only supervises: the live gauges Django made it load (zeros) are no worker's.
        prometheus_multiprocess.mark_process_dead(os.getpid())
    Supervisor(config, sockets=[config.bind_socket()]).run()
