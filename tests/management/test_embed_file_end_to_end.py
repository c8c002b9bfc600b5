"""`manage.py embed_file` run as a user runs it, in a subprocess, against a real stack (uvicorn, a
Celery worker, Triton, Redis, one database): the vectors it writes equal the synchronous
/v1/embeddings of the same texts, JSONL ids come back in order, a bad key fails cleanly, and a
real SIGINT (Ctrl-C) cancels a running job, or stops a download, leaving no file behind."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import orjson
import pytest

from tests.job_stack import JobStack, job_stack_running
from tests.processes import REPO_ROOT, ctrl_c_as_in_a_terminal, run_python

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"line {i} of the corpus: {'some more words ' * (i % 3)}about vectors" for i in range(10)]
# A job far longer than it takes embed_file to show its progress (5,000 chunks of 4): interrupted
# while it runs, and it never has to run to the end.
LONG_JOB_INPUTS = 20_000
# Deadlines against hanging only (never timings): generous for a loaded machine.
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def job_stack(triton_server, redis_server, tmp_path_factory) -> Iterator[JobStack]:
    # Chunks of 4: three chunks, the last one short.
    with job_stack_running(
        triton_server=triton_server,
        redis_server=redis_server,
        workdir=tmp_path_factory.mktemp("embed_file_stack"),
        chunk_size=4,
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected(job_stack) -> np.ndarray:
    """The synchronous float vectors of TEXTS."""
    response = httpx2.post(
        f"{job_stack.base_url}/v1/embeddings",
        json={"model": MODEL, "input": TEXTS},
        headers=job_stack.headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


def embed_file(
    stack: JobStack, input: Path, out: Path, *, key: str | None = None
) -> subprocess.CompletedProcess:
    return run_python(
        ["manage.py", "embed_file", str(input), "--model", MODEL, "--out", str(out),
         "--url", stack.base_url, "--key", key or stack.api_key, "--poll-interval", "0.2"],
        stack.env, timeout_s=180,
    )  # fmt: skip


def test_a_text_file_to_npy(job_stack, expected, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS))
    out = tmp_path / "vectors.npy"
    done = embed_file(job_stack, corpus, out)
    assert done.returncode == 0, f"{done.stderr}\n{job_stack.logs_tail()}"
    assert "wrote 10 vectors" in done.stderr, done.stderr
    # Not a terminal: the bar's lines as a log gets them; the finished one with the average rate.
    assert re.search(r"\] 0/10 +0% queued  -- emb/s  --:-- left\n", done.stderr), done.stderr
    assert re.search(r"\] 10/10 100% completed  [\d.,]+ emb/s  took \d+s\n", done.stderr), done.stderr
    assert "\r" not in done.stderr
    vectors = np.load(out)
    assert vectors.dtype == np.float32 and vectors.shape == (10, 384)
    np.testing.assert_allclose(vectors, expected, atol=2e-5)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "vectors.npy"]


def test_a_jsonl_file_keeps_its_ids_in_order(job_stack, expected, tmp_path):
    ids = [f"doc-{index:02d}" for index in reversed(range(10))]  # not sorted: order is the file's
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b"".join(
            orjson.dumps({"id": doc_id, "text": text}) + b"\n"
            for doc_id, text in zip(ids, TEXTS, strict=True)
        )
    )
    out = tmp_path / "vectors.jsonl"
    done = embed_file(job_stack, corpus, out)
    assert done.returncode == 0, f"{done.stderr}\n{job_stack.logs_tail()}"
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [record["id"] for record in records] == ids
    assert [record["index"] for record in records] == list(range(10))
    np.testing.assert_allclose(np.array([r["embedding"] for r in records]), expected, atol=2e-5)


def test_an_invalid_key_fails_with_the_servers_message_and_writes_nothing(job_stack, tmp_path):
    bad_key = "emb_not_a_real_key"
    refused = httpx2.get(f"{job_stack.base_url}/v1/jobs", headers={"Authorization": f"Bearer {bad_key}"})
    assert refused.status_code == 401
    message = refused.json()["error"]["message"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS))
    done = embed_file(job_stack, corpus, tmp_path / "vectors.npy", key=bad_key)
    assert done.returncode != 0
    assert f"401: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt"]


class StderrLines:
    """A process's stderr read line by line on a thread, so a test can wait for a line (with a
    deadline against hanging) while the process runs."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + HANG_GUARD_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"embed_file ended before a line matching {pattern!r}:\n{self.text()}")
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"no line matching {pattern!r} within {HANG_GUARD_S} s:\n{self.text()}")

    def rest(self) -> str:
        """Everything up to the end of the stream (the process has exited)."""
        self._thread.join(timeout=HANG_GUARD_S)
        while (line := self._queue.get_nowait()) is not None:
            self.lines.append(line)
        return self.text()

    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def embed_file_running(stack_url: str, api_key: str, env: dict, input: Path, out: Path):
    process = subprocess.Popen(
        [sys.executable, "manage.py", "embed_file", str(input), "--model", MODEL, "--out", str(out),
         "--url", stack_url, "--key", api_key, "--poll-interval", "0.2"],
        cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_in_a_terminal,
    )  # fmt: skip
    try:
        yield process, StderrLines(process)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=HANG_GUARD_S)


def job_when_finished(stack: JobStack, job_id: str) -> dict:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        job = httpx2.get(f"{stack.base_url}/v1/jobs/{job_id}", headers=stack.headers, timeout=30).json()
        if job["status"] in {"completed", "failed", "cancelled", "expired"}:
            return job
        time.sleep(0.2)
    pytest.fail(f"job {job_id} did not finish within {HANG_GUARD_S} s: {job}\n{stack.logs_tail()}")


def test_ctrl_c_while_the_job_runs_cancels_it_and_leaves_no_file(job_stack, tmp_path):
    """SIGINT once embed_file shows the job running, with a rate and the time left: it asks the
    server to cancel and exits 130; the worker stops the job (`cancelled`, not every input done)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"text number {index}\n" for index in range(LONG_JOB_INPUTS)))
    out = tmp_path / "vectors.npy"
    with embed_file_running(job_stack.base_url, job_stack.api_key, job_stack.env, corpus, out) as (
        process,
        stderr,
    ):
        job_id = stderr.wait_for(rf"^job (job_\w+): {LONG_JOB_INPUTS} inputs$").group(1)
        # The bar of a running job, some inputs done, with its rate and an estimate of the time left.
        progress = stderr.wait_for(
            rf"\] (\d+)/{LONG_JOB_INPUTS} +\d+% running  ([\d,.]+) emb/s  ~(\S+) left$"
        )
        process.send_signal(signal.SIGINT)
        returncode = process.wait(timeout=HANG_GUARD_S)
        log = stderr.rest()
    assert returncode == 130, log
    assert f"CommandError: interrupted: job {job_id} cancelled" in log, log
    assert "Traceback" not in log
    # embed_file exits once the server has taken the cancel: no later than now, the job is stopping.
    job = httpx2.get(f"{job_stack.base_url}/v1/jobs/{job_id}", headers=job_stack.headers, timeout=30).json()
    assert job["status"] in {"cancelling", "cancelled"}, job
    job = job_when_finished(job_stack, job_id)
    assert job["status"] == "cancelled", job
    assert int(progress.group(1)) > 0 and float(progress.group(2).replace(",", "")) > 0
    assert job["counts"]["completed"] < LONG_JOB_INPUTS
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt"]


class HoldingProxy:
    """A TCP pass-through on loopback to the stack's server that forwards a results download's
    headers and its first bytes, then holds the rest: the download is under way and cannot finish
    until the proxy closes. Every other request passes whole."""

    BODY_BYTES_BEFORE_HOLD = 100

    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.holding = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            is_download = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, is_download), daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, is_download), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, is_download: threading.Event) -> None:
        first_line = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if b"\r\n" not in first_line:
                    first_line += data
                    if re.match(rb"GET /v1/jobs/\w+/results", first_line):
                        is_download.set()
                server.sendall(data)
            server.shutdown(socket.SHUT_WR)

    def _responses(self, server: socket.socket, client: socket.socket, is_download: threading.Event) -> None:
        sent = b""
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if is_download.is_set():
                    already_sent, sent = len(sent), sent + data
                    headers_end = sent.find(b"\r\n\r\n")
                    limit = headers_end + 4 + self.BODY_BYTES_BEFORE_HOLD
                    if headers_end >= 0 and len(sent) >= limit:
                        client.sendall(data[: limit - already_sent])
                        self.holding.set()
                        self._closed.wait()
                        return
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()


def test_ctrl_c_during_the_download_leaves_no_file_and_the_job_completed(job_stack, tmp_path):
    """SIGINT while the results stream in (the first bytes written to `<out>.part`, the rest held
    back on the way): exit 130, no `.part` and no `<out>`, and the job is not cancelled: it stays
    completed, its results can be downloaded again."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS))
    out = tmp_path / "vectors.jsonl"
    partial = tmp_path / "vectors.jsonl.part"
    proxy = HoldingProxy(job_stack.base_url)
    try:
        with embed_file_running(proxy.url, job_stack.api_key, job_stack.env, corpus, out) as (
            process,
            stderr,
        ):
            job_id = stderr.wait_for(r"^job (job_\w+): 10 inputs$").group(1)
            stderr.wait_for(f"^downloading the results to {re.escape(str(out))}$")
            assert proxy.holding.wait(timeout=HANG_GUARD_S), stderr.text()
            # The response's head has arrived (the proxy sent it), so the file is being opened.
            deadline = time.monotonic() + HANG_GUARD_S
            while not partial.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert partial.exists(), stderr.text()
            process.send_signal(signal.SIGINT)
            returncode = process.wait(timeout=HANG_GUARD_S)
            log = stderr.rest()
    finally:
        proxy.close()
    assert returncode == 130, log
    assert f"CommandError: interrupted: download stopped, nothing written to {out}" in log, log
    assert "Traceback" not in log
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt"]
    assert job_when_finished(job_stack, job_id)["status"] == "completed"
    again = httpx2.get(
        f"{job_stack.base_url}/v1/jobs/{job_id}/results", headers=job_stack.headers, timeout=60
    )
    assert again.status_code == 200 and len(again.content.splitlines()) == 10
