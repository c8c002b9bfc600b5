"""`manage.py embed_file` against a local HTTP server that imitates the jobs API: what it sends, the
download written whole, clear errors, Ctrl-C cancelling the job or stopping the download; and the
progress bar's rate and time left, driven by a controllable clock."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from embeddings.management.commands import embed_file
from tests.processes import ctrl_c_raises_keyboard_interrupt

KEY = "emb_test_secret"
RESULTS = bytes(range(256)) * 20_000  # ~5 MB: several download blocks


def job(status: str, completed: int = 0, error: dict | None = None) -> dict:
    return {
        "id": "job_fake",
        "object": "embedding.job",
        "status": status,
        "counts": {"total": 3, "completed": completed, "failed": 0},
        "error": error,
    }


@dataclass
class FakeApi:
    url: str = ""
    states: list[dict] = field(default_factory=lambda: [job("running", 1), job("completed", 3)])
    submit_status: int = 202
    results_status: int = 200
    # When set, the results are sent in part and the rest only once this event is set.
    results_held_until: threading.Event | None = None
    requests: list[tuple[str, str, dict, bytes]] = field(default_factory=list)


@pytest.fixture
def api() -> Iterator[FakeApi]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _record(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.requests.append((self.command, self.path, dict(self.headers), body))

        def do_POST(self) -> None:
            self._record()
            if self.headers["Authorization"] != f"Bearer {KEY}":
                error = {"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}}
                return self._reply(401, json.dumps(error).encode())
            if self.path == "/v1/jobs":
                if state.submit_status >= 400:
                    error = {"error": {"message": "file: line 2: not UTF-8", "code": "invalid_value"}}
                    return self._reply(state.submit_status, json.dumps(error).encode())
                return self._reply(202, json.dumps(job("queued")).encode())
            if self.path == "/v1/jobs/job_fake/cancel":
                return self._reply(200, json.dumps(job("cancelling")).encode())
            return self._reply(404, b"{}")

        def do_GET(self) -> None:
            self._record()
            if self.path == "/v1/jobs/job_fake":
                current = state.states.pop(0) if len(state.states) > 1 else state.states[0]
                return self._reply(200, json.dumps(current).encode())
            if self.path.startswith("/v1/jobs/job_fake/results"):
                if state.results_status != 200:
                    return self._reply(state.results_status, b"oops", "text/plain")
                if state.results_held_until is not None:
                    return self._reply_held(state.results_held_until)
                return self._reply(200, RESULTS, "application/octet-stream")
            return self._reply(404, b"{}")

        def _reply_held(self, release: threading.Event) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(RESULTS)))
            self.end_headers()
            self.wfile.write(RESULTS[:1000])
            self.wfile.flush()
            release.wait(timeout=60)  # a guard: the test sets it at its end
            self.wfile.write(RESULTS[1000:])

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    path = tmp_path / "texts.txt"
    path.write_text("first text\nsecond text\nthird text\n")
    return path


def run(*args: str, **kwargs) -> str:
    stderr = StringIO()
    call_command("embed_file", *args, stderr=stderr, stdout=StringIO(), **kwargs)
    return stderr.getvalue()


def test_submits_the_file_polls_and_downloads(api, texts, tmp_path):
    out = tmp_path / "vectors.npy"
    log = run(
        str(texts),
        "--model",
        "minilm",
        "--out",
        str(out),
        "--url",
        api.url,
        "--key",
        KEY,
        "--poll-interval",
        "0.01",
    )

    assert out.read_bytes() == RESULTS
    assert not (tmp_path / "vectors.npy.part").exists()
    method, path, headers, body = api.requests[0]
    assert (method, path) == ("POST", "/v1/jobs")
    assert headers["Content-Type"].startswith("multipart/form-data; boundary=")
    assert b'name="model"\r\n\r\nminilm\r\n' in body
    assert (
        b'filename="texts.txt"\r\nContent-Type: text/plain\r\n\r\nfirst text\nsecond text\nthird text\n'
        in body
    )
    assert [path for _, path, _, _ in api.requests[1:]] == [
        "/v1/jobs/job_fake",
        "/v1/jobs/job_fake",
        "/v1/jobs/job_fake/results?format=npy",
    ]
    assert "[##########....................] 1/3  33% running" in log
    assert "3/3 100% completed" in log
    assert f"wrote 3 vectors ({len(RESULTS)} bytes)" in log


def test_jsonl_output_and_the_key_from_the_environment(api, texts, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDSITE_API_KEY", KEY)
    out = tmp_path / "vectors.jsonl"
    run(
        str(texts),
        "--model",
        "minilm",
        "--out",
        str(out),
        "--url",
        api.url,
        "--encoding-format",
        "base64",
        "--result-dtype",
        "float16",
        "--poll-interval",
        "0.01",
    )
    assert api.requests[-1][1] == "/v1/jobs/job_fake/results?format=jsonl&encoding_format=base64"
    assert b'name="encoding_format"\r\n\r\nbase64\r\n' in api.requests[0][3]
    assert b'name="result_dtype"\r\n\r\nfloat16\r\n' in api.requests[0][3]
    assert out.read_bytes() == RESULTS


def test_output_and_input_types_are_sent_with_the_file(api, texts, tmp_path):
    out = tmp_path / "vectors.npy"
    run(
        str(texts), "--model", "minilm", "--out", str(out), "--url", api.url, "--key", KEY,
        "--output-dtype", "int8", "--input-type", "search_document", "--poll-interval", "0.01",
    )  # fmt: skip
    body = api.requests[0][3]
    assert b'name="output_dtype"\r\n\r\nint8\r\n' in body
    assert b'name="input_type"\r\n\r\nsearch_document\r\n' in body
    assert b'name="encoding_format"' not in body and b'name="result_dtype"' not in body
    assert api.requests[-1][1] == "/v1/jobs/job_fake/results?format=npy"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "vectors.csv"], "--out must end in .npy or .jsonl"),
        (["--out", "vectors.npy", "--encoding-format", "base64"], "--encoding-format applies to .jsonl"),
        (["--out", "vectors.npy", "--poll-interval", "0"], "--poll-interval must be positive"),
        (["--out", "vectors.npy", "--result-dtype", "float64"], "invalid choice: 'float64'"),
        (["--out", "vectors.npy", "--output-dtype", "int4"], "invalid choice: 'int4'"),
        (["--out", "vectors.npy", "--input-type", "image"], "invalid choice: 'image'"),
        (["--out", "missing-dir/vectors.npy"], "is not a directory"),
    ],
)
def test_bad_arguments_are_refused_before_any_request(api, texts, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CommandError, match=message):
        run(str(texts), "--model", "minilm", "--url", api.url, "--key", KEY, *args)
    assert api.requests == []


def test_no_key_and_no_input_file_are_refused(api, texts, tmp_path, monkeypatch):
    monkeypatch.delenv("EMBEDSITE_API_KEY", raising=False)
    with pytest.raises(CommandError, match="No API key"):
        run(str(texts), "--model", "m", "--out", str(tmp_path / "v.npy"), "--url", api.url)
    with pytest.raises(CommandError, match="is not a file"):
        run(
            str(tmp_path / "nope.txt"),
            "--model",
            "m",
            "--out",
            str(tmp_path / "v.npy"),
            "--url",
            api.url,
            "--key",
            KEY,
        )


def test_api_refusals_are_shown_with_the_servers_message(api, texts, tmp_path):
    out = tmp_path / "vectors.npy"
    with pytest.raises(CommandError, match=re.escape("401: Incorrect API key provided.")):
        run(str(texts), "--model", "m", "--out", str(out), "--url", api.url, "--key", "emb_wrong")
    api.submit_status = 400
    with pytest.raises(CommandError, match="400: file: line 2: not UTF-8"):
        run(str(texts), "--model", "m", "--out", str(out), "--url", api.url, "--key", KEY)
    assert not out.exists()


def test_a_failed_download_leaves_no_file(api, texts, tmp_path):
    api.results_status = 503
    out = tmp_path / "vectors.npy"
    with pytest.raises(CommandError, match="503: oops"):
        run(
            str(texts),
            "--model",
            "m",
            "--out",
            str(out),
            "--url",
            api.url,
            "--key",
            KEY,
            "--poll-interval",
            "0.01",
        )
    assert list(tmp_path.glob("vectors.npy*")) == []


def test_an_unreachable_server_is_a_clear_error(texts, tmp_path):
    with pytest.raises(CommandError, match=re.escape("cannot reach http://127.0.0.1:9")):
        run(
            str(texts),
            "--model",
            "m",
            "--out",
            str(tmp_path / "v.npy"),
            "--url",
            "http://127.0.0.1:9",
            "--key",
            KEY,
        )


@pytest.mark.parametrize("status", ["failed", "cancelled", "expired"])
def test_a_job_that_does_not_complete_is_an_error(api, texts, tmp_path, status):
    api.states = [job(status, 1, error={"code": "triton_unavailable", "message": "Triton is down"})]
    out = tmp_path / "vectors.npy"
    with pytest.raises(CommandError, match=f"job job_fake {status}: Triton is down"):
        run(
            str(texts),
            "--model",
            "m",
            "--out",
            str(out),
            "--url",
            api.url,
            "--key",
            KEY,
            "--poll-interval",
            "0.01",
        )
    assert not out.exists()
    assert not any("/results" in path for _, path, _, _ in api.requests)


def test_ctrl_c_cancels_the_job(api, texts, tmp_path, monkeypatch):
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(embed_file.time, "sleep", interrupted)
    with pytest.raises(CommandError, match="interrupted: job job_fake cancelled") as raised:
        run(str(texts), "--model", "m", "--out", str(tmp_path / "v.npy"), "--url", api.url, "--key", KEY)
    assert raised.value.returncode == 130
    assert api.requests[-1][:2] == ("POST", "/v1/jobs/job_fake/cancel")


def test_a_jsonl_input_is_sent_as_jsonl(api, tmp_path):
    source = tmp_path / "inputs.jsonl"
    source.write_text('{"id": "a", "text": "first"}\n')
    run(
        str(source),
        "--model",
        "m",
        "--out",
        str(tmp_path / "v.jsonl"),
        "--url",
        api.url,
        "--key",
        KEY,
        "--poll-interval",
        "0.01",
    )
    assert b"Content-Type: application/jsonl\r\n\r\n" in api.requests[0][3]


def test_ctrl_c_during_the_download_leaves_no_file_and_does_not_cancel(api, texts, tmp_path):
    """A real SIGINT to this (main) thread while the results are half sent: the partial file goes,
    the job is not cancelled (it completed), exit status 130."""
    api.results_held_until = threading.Event()
    partial = tmp_path / "v.npy.part"
    main_thread = threading.main_thread().ident

    def interrupt_once_downloading() -> None:
        deadline = time.monotonic() + 60  # a guard against hanging, not a timing
        while not partial.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main_thread, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_downloading)
    interrupter.start()
    try:
        with (
            ctrl_c_raises_keyboard_interrupt(),
            pytest.raises(CommandError, match="interrupted: download stopped") as raised,
        ):
            run(
                str(texts),
                "--model",
                "m",
                "--out",
                str(tmp_path / "v.npy"),
                "--url",
                api.url,
                "--key",
                KEY,
                "--poll-interval",
                "0.01",
            )
    except KeyboardInterrupt:  # escaped the command: a traceback for the user; fail this test only
        pytest.fail("Ctrl-C during the download escaped embed_file")
    finally:
        interrupter.join()
        api.results_held_until.set()
    assert raised.value.returncode == 130
    assert "job job_fake stays completed" in str(raised.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["texts.txt"]
    assert not any(path.endswith("/cancel") for _, path, _, _ in api.requests)


# --- The progress bar's rate and time left ---------------------------------------------------------


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Stream(StringIO):
    def __init__(self, *, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def running(completed: int, total: int = 1000, status: str = "running", failed: int = 0) -> dict:
    counts = {"total": total, "completed": completed, "failed": failed}
    return {"id": "job_x", "status": status, "counts": counts}


@pytest.mark.unit
def test_the_rate_is_unknown_until_two_polls_then_follows_the_last_window():
    clock = Clock()
    rate = embed_file.ProgressRate(window_s=10, clock=clock)
    assert rate.per_second() is None and rate.seconds_left(100) is None
    rate.observe(0)
    assert rate.per_second() is None
    for _ in range(10):  # 10 s at 50/s
        clock.now += 1
        rate.observe(rate.done + 50)
    assert rate.per_second() == pytest.approx(50)
    for _ in range(5):  # then 5 s at 10/s: the window (10 s) holds 5 s of each
        clock.now += 1
        rate.observe(rate.done + 10)
    assert rate.per_second() == pytest.approx((5 * 50 + 5 * 10) / 10)
    for _ in range(10):  # 10 s more at 10/s: the fast start has left the window
        clock.now += 1
        rate.observe(rate.done + 10)
    assert rate.per_second() == pytest.approx(10)
    assert rate.average_per_second() == pytest.approx(rate.done / 25)
    assert rate.seconds_left(rate.done + 300) == pytest.approx(30)


@pytest.mark.unit
def test_polls_further_apart_than_the_window_still_give_a_rate():
    clock = Clock()
    rate = embed_file.ProgressRate(window_s=10, clock=clock)
    rate.observe(0)
    clock.now += 60
    rate.observe(120)
    assert rate.per_second() == pytest.approx(2)
    clock.now += 60
    rate.observe(120)  # nothing finished in the last minute
    assert rate.per_second() == 0.0
    assert rate.seconds_left(1000) is None  # no finite estimate from a rate of 0


@pytest.mark.unit
def test_a_count_going_back_or_the_same_instant_is_no_absurd_rate():
    clock = Clock()
    rate = embed_file.ProgressRate(window_s=10, clock=clock)
    rate.observe(5)
    rate.observe(9)  # the same instant: no division by zero
    assert rate.per_second() is None
    clock.now += 1
    rate.observe(0)
    assert rate.per_second() == 0.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "--:-- left"),
        (0, "~0s left"),
        (44.6, "~45s left"),
        (83, "~1m23s left"),
        (3599, "~59m59s left"),
        (7500, "~2h05m left"),
        (99 * 3600 + 1, ">99h left"),
        (1e12, ">99h left"),
    ],
)
def test_time_left_text(seconds, text):
    assert embed_file.time_left_text(seconds) == text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("per_second", "text"),
    [(None, "-- emb/s"), (0.0, "0.0 emb/s"), (12.345, "12.3 emb/s"), (1234.5, "1,234 emb/s")],
)
def test_rate_text(per_second, text):
    assert embed_file.rate_text(per_second) == text


@pytest.mark.unit
def test_the_line_shows_rate_and_time_left_then_the_average_and_duration_when_finished():
    clock = Clock()
    rate = embed_file.ProgressRate(clock=clock)
    rate.observe(0)
    assert embed_file.progress_line(running(0, status="queued"), rate).endswith(
        "0/1000   0% queued  -- emb/s  --:-- left"
    )
    clock.now += 4
    rate.observe(200)
    line = embed_file.progress_line(running(196, failed=4), rate)
    assert line == "[######........................] 200/1000  20% running, 4 failed  50.0 emb/s  ~16s left"
    clock.now += 16
    rate.observe(1000)
    assert embed_file.progress_line(running(1000, status="completed"), rate).endswith(
        "1000/1000 100% completed  50.0 emb/s  took 20s"
    )


@pytest.mark.unit
def test_a_terminal_gets_one_line_redrawn_at_every_poll():
    clock, stream = Clock(), Stream(terminal=True)
    display = embed_file.ProgressDisplay(stream, clock=clock, window_s=10)
    display.update(running(0, total=100_000, status="queued"))
    clock.now += 1
    display.update(running(1000, total=100_000))
    clock.now += 10
    display.update(running(1000, total=100_000))  # stalled for the whole window: rate 0, no estimate
    display.end()
    output = stream.getvalue()
    frames = output.removesuffix("\n").split("\r")[1:]
    assert output.count("\n") == 1 and output.endswith("\n")
    assert frames[1].endswith("1% running  1,000 emb/s  ~1m39s left")
    assert frames[2].rstrip().endswith("1% running  0.0 emb/s  --:-- left")
    # The shorter line is padded to blank what the longer one left on screen.
    assert len(frames[2]) == len(frames[1]) > len(frames[2].rstrip())


@pytest.mark.unit
def test_a_log_gets_a_line_per_status_and_at_most_one_per_interval_between():
    clock, stream = Clock(), Stream(terminal=False)
    display = embed_file.ProgressDisplay(stream, clock=clock, log_interval_s=5)
    display.update(running(0, status="queued"))
    clock.now += 1
    display.update(running(0, status="queued"))  # nothing new: no line
    for done in range(10, 130, 10):  # a poll a second for 12 s
        clock.now += 1
        display.update(running(done))
    clock.now += 1
    display.update(running(1000, status="completed"))
    display.end()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [re.search(r"\] (\d+/\d+) +\d+% (\w+)", line).groups() for line in lines] == [
        ("0/1000", "queued"),
        ("10/1000", "running"),  # the status changed: at once
        ("60/1000", "running"),  # 5 s later
        ("110/1000", "running"),
        ("1000/1000", "completed"),  # the status changed: at once
    ]
    assert all(re.search(r" emb/s  (~\S+|--:--) left$", line) for line in lines[1:-1]), lines
