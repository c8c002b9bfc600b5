"""`manage.py embed_file INPUT --model M --out vectors.npy|.jsonl`: a whole file embedded through the
jobs API (any embedsite server, with a key): submit, show progress, download the results."""

from __future__ import annotations

import os
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from embeddings.jobs_client import FINISHED_STATUSES, JobsApiError, JobsClient

RESULT_FORMATS = {".npy": "npy", ".jsonl": "jsonl"}
BAR_WIDTH = 30


def progress_line(job: dict) -> str:
    counts = job.get("counts") or {}
    total, done = counts.get("total", 0), counts.get("completed", 0) + counts.get("failed", 0)
    fraction = done / total if total else 0.0
    filled = int(BAR_WIDTH * fraction)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    failed = f", {counts['failed']} failed" if counts.get("failed") else ""
    return f"[{bar}] {done}/{total} {fraction:4.0%} {job.get('status')}{failed}"


class Command(BaseCommand):
    help = (
        'Embed a text file (one input per line) or a JSONL file ({"id", "text"} lines) through the '
        "jobs API and write the vectors to --out (.npy or .jsonl). Ctrl-C cancels the job."
    )

    def add_arguments(self, parser):
        parser.add_argument("input", type=Path, help="a .txt (one text a line) or .jsonl file")
        parser.add_argument("--model", required=True)
        parser.add_argument("--out", required=True, type=Path, help="vectors.npy or vectors.jsonl")
        parser.add_argument(
            "--url",
            default=os.environ.get("EMBEDSITE_URL", "http://127.0.0.1:8080"),
            help="the server (default $EMBEDSITE_URL or http://127.0.0.1:8080)",
        )
        parser.add_argument("--key", default=None, help="API key (default $EMBEDSITE_API_KEY)")
        parser.add_argument("--encoding-format", choices=["float", "base64"], default=None)
        parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls")

    def handle(self, *args, input, model, out, url, key, encoding_format, poll_interval, **options):
        key = key or os.environ.get("EMBEDSITE_API_KEY", "")
        if not key:
            raise CommandError("No API key: pass --key or set EMBEDSITE_API_KEY")
        result_format = RESULT_FORMATS.get(out.suffix.lower())
        if result_format is None:
            raise CommandError(f"--out must end in .npy or .jsonl, not {out.name!r}")
        if encoding_format and result_format == "npy":
            raise CommandError("--encoding-format applies to .jsonl output; .npy is always float32")
        if not input.is_file():
            raise CommandError(f"{input} is not a file")
        if poll_interval <= 0:
            raise CommandError("--poll-interval must be positive")
        if not out.parent.is_dir():
            raise CommandError(f"{out.parent} is not a directory")
        client = JobsClient(url, key)
        try:
            job = client.submit_file(
                input, model=model, options={"encoding_format": encoding_format} if encoding_format else None
            )
            self.stderr.write(f"job {job['id']}: {job['counts']['total']} inputs")
            job = self._wait(client, job, poll_interval)
            if job["status"] != "completed":
                error = job.get("error") or {}
                reason = f": {error.get('message')}" if error.get("message") else ""
                raise CommandError(f"job {job['id']} {job['status']}{reason}")
            written = client.download(
                job["id"], out, result_format=result_format, encoding_format=encoding_format
            )
        except JobsApiError as error:
            raise CommandError(str(error)) from error
        self.stderr.write(f"wrote {job['counts']['completed']} vectors ({written} bytes) to {out}")

    def _wait(self, client: JobsClient, job: dict, poll_interval: float) -> dict:
        """Poll until the job finishes, drawing the progress bar; Ctrl-C cancels it."""
        try:
            while True:
                self._draw(progress_line(job))
                if job["status"] in FINISHED_STATUSES:
                    self._end_line()
                    return job
                time.sleep(poll_interval)
                job = client.job(job["id"])
        except KeyboardInterrupt:
            self._end_line()
            try:
                client.cancel(job["id"])
            except JobsApiError as error:
                raise CommandError(
                    f"interrupted; cancelling job {job['id']} failed: {error}", returncode=130
                ) from None
            raise CommandError(f"interrupted: job {job['id']} cancelled", returncode=130) from None

    def _draw(self, line: str) -> None:
        # A terminal sees one line redrawn; a log file a line per change.
        stream = self.stderr._out
        if stream.isatty():
            stream.write("\r" + line)
            stream.flush()
        elif line != getattr(self, "_last_line", None):
            stream.write(line + "\n")
        self._last_line = line

    def _end_line(self) -> None:
        if self.stderr._out.isatty():
            self.stderr._out.write("\n")
