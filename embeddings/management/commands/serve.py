"""`manage.py serve`: the web server as shipped (uvicorn, embedsite/server.py), the one command that
starts it: runstack, docker-compose and Kubernetes all run this."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embedsite.server import serve


class Command(BaseCommand):
    help = (
        "Serve embedsite with uvicorn (uvloop, httptools) in WEB_CONCURRENCY worker processes. On SIGTERM: "
        "/ready answers 503 for SHUTDOWN_DRAIN_S while still serving, then no new connection is accepted "
        "and requests in flight get SHUTDOWN_TIMEOUT_S to finish."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default=settings.SERVER_HOST)
        parser.add_argument("--port", type=int, default=settings.SERVER_PORT)
        parser.add_argument("--workers", type=int, default=settings.WEB_CONCURRENCY)

    def handle(self, *args, host, port, workers, **options):
        if workers < 1:
            raise CommandError("--workers must be at least 1")
        serve(
            host=host,
            port=port,
            workers=workers,
            drain_s=settings.SHUTDOWN_DRAIN_S,
            timeout_s=settings.SHUTDOWN_TIMEOUT_S,
        )
