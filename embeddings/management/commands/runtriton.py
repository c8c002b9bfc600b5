"""Run the local Triton Inference Server against model_repository/ until interrupted."""

import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.services.inference.serving import write_serving_states
from embeddings.tooling.local_triton import local_triton_server
from embeddings.tooling.triton_server import TritonServerError


class Command(BaseCommand):
    help = "Start Triton on the configured ports, wait until its models are ready, stop on Ctrl-C."

    def handle(self, *args, **options):
        server = local_triton_server()
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        try:
            server.start()
            server.wait_until_ready(settings.TRITON_STARTUP_TIMEOUT_S)
        except TritonServerError as error:
            server.stop()
            raise CommandError(str(error)) from error
        self.stdout.write(
            self.style.SUCCESS(f"Triton ready: gRPC {server.grpc_target}, HTTP {server.http_url}")
        )
        write_serving_states(self.stdout)
        try:
            while not stop.wait(0.5):
                if server.process is None or server.process.poll() is not None:
                    raise CommandError("Triton exited unexpectedly")
        finally:
            server.stop()
            self.stdout.write("Triton stopped.")
