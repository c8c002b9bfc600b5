"""What the fault tests run and measure: a site (database, tenant with quotas, key) served by a
uvicorn process that can be SIGKILLed and started again on the same port, and a load of concurrent
clients that records every answer with its timing."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest

from embeddings.tooling.triton_server import free_port
from tests.database_backend import migrated_database_url
from tests.processes import manage_commands, start_python, stop_process_group, wait_until_healthy


def site_prepared(workdir: Path, **settings_env: str) -> tuple[dict[str, str], str]:
    """A migrated database of its own (on the run's backend) with the local model and tenant
    `faults` (generous quotas, so every request goes through Redis) and its key; (the servers'
    environment, key)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": migrated_database_url(workdir),
        "EMBEDSITE_RUN_DIR": str(workdir),
        **settings_env,
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    quotas = ["--requests-per-minute", "1000000", "--tokens-per-day", "1000000000"]
    *_, api_key = manage_commands(
        env,
        ("register_local_model",),
        ("create_tenant", "--name", "Faults", "--slug", "faults", *quotas),
        ("create_api_key", "--tenant", "faults"),
    )
    return env, api_key


@dataclass
class LiveApi:
    """One uvicorn process (as runstack starts it) on a fixed port of its own."""

    env: dict[str, str]
    api_key: str
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def start(self, timeout_s: float = 120) -> None:
        with self.log_path.open("ab") as log:
            self.process = start_python(
                ["manage.py", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until_healthy(self.process, self.base_url, self.log_path, timeout_s=timeout_s)

    def kill(self) -> None:
        """SIGKILL the server's process group, as a crash or the OOM killer would."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)


@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic()
    elapsed_s: float
    status: int | None  # None: no HTTP answer (a transport error, the client's own timeout included)
    code: str | None  # the error body's `code`
    transport_error: str = ""

    @property
    def ended(self) -> float:
        return self.started + self.elapsed_s


class Load:
    """`clients` threads POSTing /v1/embeddings back to back (a short pause between), each answer
    recorded; the client timeout is far above any bound the tests assert, so a hang shows."""

    def __init__(self, api: LiveApi, *, clients: int = 4, timeout_s: float = 60, pause_s: float = 0.02):
        self.api = api
        self.clients = clients
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Load:
        for number in range(self.clients):
            thread = threading.Thread(target=self._run, args=(number,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)

    def _run(self, number: int) -> None:
        body = {"model": "all-MiniLM-L6-v2", "input": [f"client {number} asks about faults", "and recovery"]}
        with httpx2.Client(
            base_url=self.api.base_url, headers=self.api.headers, timeout=self.timeout_s
        ) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    reply = http.post("/v1/embeddings", json=body)
                    code = None if reply.status_code == 200 else reply.json()["error"]["code"]
                    answer = Answer(started, time.monotonic() - started, reply.status_code, code)
                except httpx2.TransportError as error:
                    answer = Answer(started, time.monotonic() - started, None, None, repr(error))
                self.answers.append(answer)
                time.sleep(self.pause_s)

    def between(self, start: float, end: float = float("inf")) -> list[Answer]:
        """The answers to requests started in [start, end)."""
        return [answer for answer in list(self.answers) if start <= answer.started < end]

    def wait_for(self, predicate, after: float, timeout_s: float = 120) -> Answer:
        """The first answer to a request started after `after` that satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [answer for answer in self.between(after) if predicate(answer)]
            if found:
                return min(found, key=lambda answer: answer.ended)
            time.sleep(0.02)
        pytest.fail(f"no such answer within {timeout_s} s; last ones: {self.answers[-5:]}")
