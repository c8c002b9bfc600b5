"""`manage.py embed_file` against a local HTTP server that imitates the jobs API: what it sends, the
download written whole, clear errors, and Ctrl-C cancelling the job."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from embeddings.management.commands import embed_file

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
                return self._reply(200, RESULTS, "application/octet-stream")
            return self._reply(404, b"{}")

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
        "--poll-interval",
        "0.01",
    )
    assert api.requests[-1][1] == "/v1/jobs/job_fake/results?format=jsonl&encoding_format=base64"
    assert b'name="encoding_format"\r\n\r\nbase64\r\n' in api.requests[0][3]
    assert out.read_bytes() == RESULTS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "vectors.csv"], "--out must end in .npy or .jsonl"),
        (["--out", "vectors.npy", "--encoding-format", "base64"], "--encoding-format applies to .jsonl"),
        (["--out", "vectors.npy", "--poll-interval", "0"], "--poll-interval must be positive"),
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
