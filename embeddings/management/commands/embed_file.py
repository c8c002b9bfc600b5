"""`manage.py embed_file INPUT --model M --out vectors.npy|.jsonl [--output-dtype int8] [--input-type
document]`: a whole file embedded through the jobs API (any embedsite server, with a key): submit,
show progress, download the results (an .npy of the output type's dtype)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from django.core.management.base import BaseCommand, CommandError

from embeddings.management.jobs_client import FINISHED_STATUSES, JobsApiError, JobsClient
from embeddings.model_tasks import INPUT_TYPE_NAMES, OUTPUT_TYPES
from embeddings.result_dtypes import RESULT_DTYPES

RESULT_FORMATS = {".npy": "npy", ".jsonl": "jsonl"}
BAR_WIDTH = 30
# The rate is measured over the polls of the last RATE_WINDOW_S seconds: recent enough to follow a
# job that speeds up or slows down (other tenants' jobs share the workers), long enough to even out
# chunks finishing in bursts.
RATE_WINDOW_S = 10.0
# Not a terminal (CI, a pipe, a log file): a line when the status changes, else at most this often.
LOG_INTERVAL_S = 5.0
LONGEST_TIME_LEFT_S = 99 * 3600  # beyond this an estimate says nothing useful
INTERRUPTED = 130  # the shell's exit status for a process stopped by SIGINT (128 + 2)


class ProgressRate:
    """Embeddings per second over the polls of the last `window_s` seconds, and the time left at
    that rate. `clock` is injectable so tests drive it without sleeping."""

    def __init__(self, *, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque()  # (when, done)
        self._first: tuple[float, int] | None = None

    def observe(self, done: int) -> None:
        now = self.clock()
        self._samples.append((now, done))
        self._first = self._first or (now, done)
        # Keep the newest sample at or before the window's start, so the rate spans the whole window
        # (and still has two samples when polls are further apart than the window).
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    @property
    def done(self) -> int:
        return self._samples[-1][1] if self._samples else 0

    def per_second(self) -> float | None:
        """None until two polls some time apart; 0.0 when nothing finished over the window."""
        return _rate(self._samples[0], self._samples[-1]) if self._samples else None

    def average_per_second(self) -> float | None:
        """Since the first poll: the figure for a finished job."""
        return _rate(self._first, self._samples[-1]) if self._first else None

    def elapsed_s(self) -> float:
        return self._samples[-1][0] - self._first[0] if self._first else 0.0

    def seconds_left(self, total: int) -> float | None:
        """None while the rate is unknown or zero (no finite estimate)."""
        rate = self.per_second()
        return max(0, total - self.done) / rate if rate else None


def _rate(start: tuple[float, int], end: tuple[float, int]) -> float | None:
    (started, done_then), (now, done_now) = start, end
    return max(0.0, (done_now - done_then) / (now - started)) if now > started else None


def rate_text(per_second: float | None) -> str:
    if per_second is None:
        return "-- emb/s"
    return f"{per_second:,.0f} emb/s" if per_second >= 100 else f"{per_second:.1f} emb/s"


def duration_text(seconds: float) -> str:
    """45s, 1m23s, 2h05m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def time_left_text(seconds: float | None) -> str:
    if seconds is None:
        return "--:-- left"
    if seconds > LONGEST_TIME_LEFT_S:
        return f">{LONGEST_TIME_LEFT_S // 3600}h left"
    return f"~{duration_text(seconds)} left"


def _counts(job: dict) -> tuple[int, int, int]:
    counts = job.get("counts") or {}
    failed = counts.get("failed", 0)
    return counts.get("total", 0), counts.get("completed", 0) + failed, failed


def progress_line(job: dict, rate: ProgressRate) -> str:
    """`[###...] done/total pct status  rate  time left`; a finished job shows its average rate and
    how long it took instead of the time left."""
    total, done, failed = _counts(job)
    fraction = done / total if total else 0.0
    filled = int(BAR_WIDTH * fraction)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    failures = f", {failed} failed" if failed else ""
    if job.get("status") in FINISHED_STATUSES:
        pace = f"{rate_text(rate.average_per_second())}  took {duration_text(rate.elapsed_s())}"
    else:
        pace = f"{rate_text(rate.per_second())}  {time_left_text(rate.seconds_left(total))}"
    return f"[{bar}] {done}/{total} {fraction:4.0%} {job.get('status')}{failures}  {pace}"


class ProgressDisplay:
    """The progress bar on `stream`: on a terminal one line redrawn with \\r at every poll; anywhere
    else (CI, a pipe) a line when the status changes, else at most every `log_interval_s` and only
    when the counts moved, so a long job does not flood a log."""

    def __init__(
        self,
        stream: TextIO,
        *,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = LOG_INTERVAL_S,
        window_s: float = RATE_WINDOW_S,
    ):
        self.stream = stream
        self.clock = clock
        self.log_interval_s = log_interval_s
        self.rate = ProgressRate(window_s=window_s, clock=clock)
        self.terminal = stream.isatty()
        self._width = 0  # of the line on screen, to blank a longer previous one
        self._logged: tuple[str, int, int] | None = None  # (status, done, failed) last written
        self._logged_at = 0.0

    def update(self, job: dict) -> None:
        _, done, failed = _counts(job)
        self.rate.observe(done)
        line = progress_line(job, self.rate)
        if self.terminal:
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()
            self._width = len(line)
            return
        now, state = self.clock(), (job.get("status"), done, failed)
        status_changed = self._logged is None or state[0] != self._logged[0]
        moved_a_while_ago = state != self._logged and now - self._logged_at >= self.log_interval_s
        if status_changed or moved_a_while_ago:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._logged, self._logged_at = state, now

    def end(self) -> None:
        """Leave the terminal's bar line, so what follows starts on a line of its own."""
        if self.terminal and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def interrupted(message: str) -> CommandError:
    return CommandError(f"interrupted: {message}", returncode=INTERRUPTED)


class Command(BaseCommand):
    help = (
        'Embed a text file (one input per line) or a JSONL file ({"id", "text"} lines) through the '
        "jobs API and write the vectors to --out (.npy or .jsonl). Ctrl-C cancels the job, or once "
        "it has completed stops the download; either way it writes nothing and exits 130."
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
        parser.add_argument(
            "--result-dtype",
            choices=list(RESULT_DTYPES),
            default=None,
            help="how the server stores the results until downloaded (float16: half the memory); "
            "default: the model's setting. The download is float32 either way",
        )
        parser.add_argument(
            "--output-dtype",
            choices=list(OUTPUT_TYPES),
            default=None,
            help="float (default), or quantised: int8, uint8, binary, ubinary (stored and downloaded in "
            "that type: an .npy of int8/uint8)",
        )
        parser.add_argument(
            "--input-type",
            choices=list(INPUT_TYPE_NAMES),
            default=None,
            help="what the texts are for (query, document, ...): picks the model's prompt for it",
        )
        parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls")

    def handle(
        self,
        *args,
        input,
        model,
        out,
        url,
        key,
        encoding_format,
        result_dtype,
        poll_interval,
        output_dtype=None,
        input_type=None,
        **options,
    ):
        key = key or os.environ.get("EMBEDSITE_API_KEY", "")
        if not key:
            raise CommandError("No API key: pass --key or set EMBEDSITE_API_KEY")
        result_format = RESULT_FORMATS.get(out.suffix.lower())
        if result_format is None:
            raise CommandError(f"--out must end in .npy or .jsonl, not {out.name!r}")
        if encoding_format and result_format == "npy":
            raise CommandError(
                "--encoding-format applies to .jsonl output; .npy holds the output type's values"
            )
        if not input.is_file():
            raise CommandError(f"{input} is not a file")
        if poll_interval <= 0:
            raise CommandError("--poll-interval must be positive")
        if not out.parent.is_dir():
            raise CommandError(f"{out.parent} is not a directory")
        client = JobsClient(url, key)
        try:
            asked = {
                "encoding_format": encoding_format,
                "result_dtype": result_dtype,
                "output_dtype": output_dtype,
                "input_type": input_type,
            }
            job = self._submit(
                client, input, model=model, options={name: v for name, v in asked.items() if v}
            )
            self.stderr.write(f"job {job['id']}: {job['counts']['total']} inputs")
            job = self._wait(client, job, poll_interval)
            if job["status"] != "completed":
                error = job.get("error") or {}
                reason = f": {error.get('message')}" if error.get("message") else ""
                raise CommandError(f"job {job['id']} {job['status']}{reason}")
            written = self._download(client, job, out, result_format, encoding_format)
        except JobsApiError as error:
            raise CommandError(str(error)) from error
        self.stderr.write(f"wrote {job['counts']['completed']} vectors ({written} bytes) to {out}")

    def _submit(
        self,
        client: JobsClient,
        input: Path,
        *,
        model: str,
        options: dict[str, str],
    ) -> dict:
        try:
            return client.submit_file(input, model=model, options=options or None)
        except KeyboardInterrupt:
            # The server may have taken the whole file just before: its answer (the id) never came.
            raise interrupted(
                "stopped during the upload; if the server had already received the whole file, "
                "the job runs on (GET /v1/jobs lists it)"
            ) from None

    def _wait(self, client: JobsClient, job: dict, poll_interval: float) -> dict:
        """Poll until the job finishes, drawing the progress bar; Ctrl-C cancels it."""
        display = ProgressDisplay(self.stderr._out)
        try:
            while True:
                display.update(job)
                if job["status"] in FINISHED_STATUSES:
                    return job
                time.sleep(poll_interval)
                job = client.job(job["id"])
        except KeyboardInterrupt:
            raise self._cancelled(client, job["id"]) from None
        finally:
            display.end()

    def _cancelled(self, client: JobsClient, job_id: str) -> CommandError:
        try:
            status = client.cancel(job_id)["status"]
        except JobsApiError as error:
            return interrupted(f"cancelling job {job_id} failed: {error}")
        except KeyboardInterrupt:
            return interrupted(
                f"a second Ctrl-C while cancelling job {job_id}: it may still run "
                f"(POST /v1/jobs/{job_id}/cancel cancels it)"
            )
        if status == "cancelling":  # the worker stops it after the chunk it is embedding
            return interrupted(f"job {job_id} cancelled (it stops after the chunk in progress)")
        if status == "cancelled":
            return interrupted(f"job {job_id} cancelled")
        return interrupted(f"job {job_id} had already ended ({status}); nothing downloaded")

    def _download(
        self, client: JobsClient, job: dict, out: Path, result_format: str, encoding_format: str | None
    ) -> int:
        self.stderr.write(f"downloading the results to {out}")
        try:
            return client.download(
                job["id"], out, result_format=result_format, encoding_format=encoding_format
            )
        except KeyboardInterrupt:
            # The job is done and paid for: leave it completed, so its results can be fetched again.
            raise interrupted(
                f"download stopped, nothing written to {out}; job {job['id']} stays completed and its "
                f"results can be downloaded until it expires (GET /v1/jobs/{job['id']}/results)"
            ) from None
