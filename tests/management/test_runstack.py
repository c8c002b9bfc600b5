"""`manage.py runstack` (what `make run` runs), whole, on free ports, as a process manager: each child
that dies is restarted, and while it is down the service answers as documented (503 naming what is
missing), after it serves again: Triton SIGKILLed with its backend stubs hung (ended, no stub or
shared memory left, the catalog's model loaded again), the critical Redis, the job store (its data
kept), the Celery worker (a job sent meanwhile completes), the web server (its orphaned worker ended,
the dead processes' live gauges dropped). A child that keeps dying fast makes runstack give up naming
it and its log; Ctrl-C stops everything, a restart pending included. Nothing is ever left.

One stack serves the restart tests (module fixture, give-up last: it ends the stack); Ctrl-C gets a
small stack of its own (no catalog model) that runs first. Each outage is held open by pausing
runstack itself (SIGSTOP; its children run in sessions of their own), so the test sees the outage
before the restart, however fast, and the restart then starts when runstack is continued.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest

from embeddings.tooling.triton_server import die_with_parent, free_port, shared_memory_regions
from tests.conftest import require_exported_model
from tests.database_backend import migrated_sqlite_url
from tests.processes import (
    REPO_ROOT,
    children_of,
    manage_commands,
    process_group_paused,
    stop_process_group,
    wait_until_healthy,
)
from tests.triton.test_server_process_group import group_processes, stubs_of, wait_until_no_live_member

CELERY_SIGNAL_NOTICE = re.compile(r"worker: (Warm|Cold) shutdown \(MainProcess\)")
# Against hanging only: Triton, Celery and uvicorn start (and restart) on a loaded 2-core machine.
START_DEADLINE_S = 240
MODEL = "all-MiniLM-L6-v2"


@dataclass
class Stack:
    """A running `manage.py runstack`, its settings and a key of a tenant with quotas (so every
    embedding goes through the critical Redis)."""

    process: subprocess.Popen
    env: dict[str, str]
    run_dir: Path
    log: Path
    base_url: str
    api_key: str = ""
    # Every child seen, restarted ones included: none may be left at the end.
    seen: dict[int, str] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def children(self, part: str) -> list[int]:
        """The pids of runstack's live children whose command line (or title: Redis sets its own,
        `redis-server 127.0.0.1:<port>`) holds `part`."""
        found = []
        for pid in children_of(self.process.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
            except OSError:
                continue
            if part in f" {command} ":
                found.append(pid)
                self.seen[pid] = command[:80]
        return found

    def child(self, part: str) -> int:
        [pid] = self.children(part)
        return pid

    def records(self, path: Path | None = None) -> list[dict]:
        """Every line of a log as JSON, but the notice Celery's signal handler writes straight to the
        worker's stdout (no logging in a signal handler)."""
        lines = (path or self.log).read_text().splitlines()
        return [
            json.loads(line) for line in lines if line.strip() and not CELERY_SIGNAL_NOTICE.fullmatch(line)
        ]

    def said(self, level: str | None = None) -> list[str]:
        return [
            record["message"]
            for record in self.records()
            if record.get("logger") == "embedsite.runstack" and level in (None, record["level"])
        ]

    def said_once(self, start: str) -> str:
        """runstack's one line that starts with `start`, once it has said it."""
        self.wait_for(lambda: any(line.startswith(start) for line in self.said()), f"a line {start!r}")
        [line] = [line for line in self.said() if line.startswith(start)]
        return line

    def embed(self) -> httpx2.Response:
        return httpx2.post(
            f"{self.base_url}/v1/embeddings",
            json={"model": MODEL, "input": "hello"},
            headers=self.headers,
            timeout=60,
        )

    def ready(self) -> httpx2.Response:
        return httpx2.get(f"{self.base_url}/ready", timeout=30)

    def wait_for(self, condition, what: str, timeout_s: float = START_DEADLINE_S) -> float:
        """Seconds until `condition()` holds; fails with runstack's log if it exits or never does."""
        started = time.monotonic()
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"runstack exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            if time.monotonic() - started > timeout_s:
                pytest.fail(f"{what}: not within {timeout_s:g} s:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)
        return time.monotonic() - started

    def assert_nothing_left(self) -> None:
        """Each child (restarted ones too) ran in a group of its own: no member of any is alive."""
        for pid, name in self.seen.items():
            live = {member: state for member, state in group_processes(pid).items() if state != "Z"}
            assert live == {}, f"{name} ({pid}) left: {live}"


def _answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=5).status_code == 200
    except httpx2.TransportError:
        return False


def _dead(pid: int) -> bool:
    """Whether `pid` has exited (a zombie while runstack, its parent, is paused)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill(pid: int, signum: int = signal.SIGKILL) -> None:
    os.kill(pid, signum)
    deadline = time.monotonic() + 10
    while not _dead(pid):
        assert time.monotonic() < deadline, f"{pid} did not die"
        time.sleep(0.02)


def start_stack(tmp_path: Path, *, catalog: bool, **settings_env: str) -> Stack:
    """runstack with `--workers 2` as `make run` starts it (two Redis servers, JSON logs), on free
    ports and its own SQLite database (as `make run`), migrated (tests/database_backend.py), with `catalog`
    the local model registered (it loads when the stack starts) and a tenant with quotas and its key."""
    require_exported_model(REPO_ROOT / "model_repository")
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": migrated_sqlite_url(tmp_path),
        "EMBEDSITE_RUN_DIR": str(tmp_path),
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        # As `make run` sets it: the job store on a Redis server of its own.
        "JOB_STORE_URL": f"redis://127.0.0.1:{free_port()}/0",
        "SERVER_PORT": str(port),
        "TRITON_SERVER_URL": "127.0.0.1",
        "TRITON_SERVER_GRPC_PORT": str(free_port()),
        "TRITON_HTTP_PORT": str(free_port()),
        "TRITON_METRICS_PORT": str(free_port()),
        "TRITON_STOP_TIMEOUT_S": "2",
        # MiniLM is not among the models Triton loads at start: the catalog's reconcile loads it
        # (at start and after each restart), as it loads every registered model.
        "TRITON_STARTUP_MODELS": "minilm_tokenizer",
        # Every process's lines as JSON (README "Observability"), runstack's own included.
        "LOG_FORMAT": "json",
        **settings_env,
    }
    for inherited in ("PROMETHEUS_MULTIPROC_DIR", "CELERY_BROKER_URL"):
        env.pop(inherited, None)
    api_key = ""
    if catalog:
        quotas = ["--requests-per-minute", "1000000", "--tokens-per-day", "1000000000"]
        registered, _, api_key = manage_commands(
            env,
            ["register_local_model"],
            ["create_tenant", "--name", "Stack", "--slug", "stack", *quotas],
            ["create_api_key", "--tenant", "stack"],
        )
        assert "loads when the stack starts" in registered, registered
    log = tmp_path / "runstack.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "runstack", "--workers", "2"],
            cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    stack = Stack(process, env, tmp_path, log, f"http://127.0.0.1:{port}", api_key)
    try:
        wait_until_healthy(
            process,
            stack.base_url,
            log,
            ready=lambda: "embedsite on" in log.read_text(),
            timeout_s=START_DEADLINE_S,
        )
        stack.seen.update(children_of(process.pid))
        # Both Redis servers (the critical one, the job store), Triton, the worker, beat, the web server.
        assert sorted(stack.seen.values()).count("redis-server") == 2, stack.seen
        for part in ("tritonserver", " worker ", " beat ", " serve "):
            stack.child(part)
    except BaseException:
        stop_process_group(process)
        raise
    return stack


def test_ctrl_c_stops_everything_even_with_a_restart_pending(tmp_path):
    """Beat killed and its restart 20 s away: Ctrl-C stops the stack at once, beat never restarted,
    exit status 0, every line JSON, nothing left."""
    stack = start_stack(tmp_path, catalog=False, RUNSTACK_RESTART_DELAY_S="20")
    try:
        beat = stack.child(" beat ")
        kill(beat)
        stack.wait_for(
            lambda: any("restarting it in 20 s" in line for line in stack.said("WARNING")), "death"
        )
        stopping = time.monotonic()
        os.kill(stack.process.pid, signal.SIGINT)
        stack.process.wait(timeout=120)
        stopped_s = time.monotonic() - stopping
    finally:
        stop_process_group(stack.process)
    assert stack.process.returncode == 0, stack.log.read_text()[-3000:]
    said = stack.said()
    assert said[-1] == "Stopped.", said
    assert not any(line.startswith("Restarting the Celery beat") for line in said)
    assert [record for record in stack.records() if record["level"] == "ERROR"] == []
    for role in ("worker", "beat"):
        assert stack.records(tmp_path / f"celery-{role}.log")
    assert stopped_s < 20
    stack.assert_nothing_left()
    print(f"\nCtrl-C with a restart pending: stopped in {stopped_s:.1f} s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """The stack the restart tests share, with the shipped delays (0.5 s, doubling), two restarts in
    a row allowed before giving up (the give-up test needs three fast deaths, not six), and a child up
    5 s counted as stable (the tests kill the job store twice, seconds apart, for different reasons)."""
    stack = start_stack(
        tmp_path_factory.mktemp("runstack"),
        catalog=True,
        RUNSTACK_RESTART_ATTEMPTS="2",
        RUNSTACK_RESTART_STABLE_S="5",
    )
    try:
        ready = stack.ready()
        assert ready.status_code == 200, ready.text
        assert ready.json()["models"][MODEL]["state"] == "READY", ready.text
        yield stack
    finally:
        stop_process_group(stack.process)


def _model_ready(stack: Stack) -> bool:
    ready = stack.ready()
    return ready.status_code == 200 and ready.json()["models"][MODEL]["state"] == "READY"


def test_triton_killed_with_hung_stubs_is_restarted_and_loads_the_catalog_again(stack):
    triton = stack.child("tritonserver")
    stubs = stubs_of(triton)
    regions = shared_memory_regions([triton, *stubs])
    assert stubs and regions
    with process_group_paused(stack.process):
        for stub in stubs:
            os.kill(stub, signal.SIGSTOP)  # only SIGKILL ends them now
        kill(triton)
        refused, ready = stack.embed(), stack.ready()
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "model_unavailable"), refused.text
    assert ready.status_code == 503 and "triton" in ready.json()["failed"], ready.text
    model_ready_s = stack.wait_for(lambda: _model_ready(stack), "Triton and its model ready again")
    embedded = stack.embed()
    assert embedded.status_code == 200, embedded.text
    assert len(embedded.json()["data"][0]["embedding"]) == 384
    assert stack.child("tritonserver") != triton
    wait_until_no_live_member(triton)
    assert [name for name in regions if Path("/dev/shm", name).exists()] == []
    [death] = [line for line in stack.said("WARNING") if line.startswith("Triton ")]
    assert (
        death.startswith("Triton was killed by SIGKILL after ") and str(stack.run_dir / "triton.log") in death
    )
    assert "restarting it in 0.5 s" in death
    back = stack.said_once("Triton is back")
    print(
        f"\nTriton SIGKILLed, stubs hung: {back}; /ready 200 with the model READY {model_ready_s:.1f} s after"
    )


def test_the_critical_redis_killed_is_restarted_on_its_port(stack):
    address = f"127.0.0.1:{urlsplit(stack.env['REDIS_URL']).port}"
    redis = stack.child(address)
    with process_group_paused(stack.process):
        kill(redis)
        refused, ready = stack.embed(), stack.ready()
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "quota_unavailable"), refused.text
    assert ready.status_code == 503 and ready.json()["failed"] == ["redis"], ready.text
    resumed = time.monotonic()
    stack.wait_for(lambda: stack.embed().status_code == 200, "an embedding through Redis answered again")
    first_200_s = time.monotonic() - resumed
    # Each web process's redis-py pool (which /ready uses) fails once on a connection the old Redis
    # had closed, then reconnects: /ready is 200 again within a few probes.
    stack.wait_for(lambda: stack.ready().status_code == 200, "/ready 200 again", timeout_s=30)
    assert stack.child(address) != redis
    back = stack.said_once("Redis (critical) is back")
    print(f"\nCritical Redis SIGKILLed: {back}; first 200 {first_200_s:.2f} s after runstack resumed")


def test_the_job_store_killed_comes_back_with_its_jobs(stack):
    job = _submitted_job(stack, ["kept across a restart"])
    stack.wait_for(lambda: _job(stack, job)["status"] == "completed", "the job completed")
    address = f"127.0.0.1:{urlsplit(stack.env['JOB_STORE_URL']).port}"
    time.sleep(1.1)  # the append-only file is fsynced every second
    with process_group_paused(stack.process):
        kill(stack.child(address))
        ready = stack.ready()
    # ("redis" may fail too, once per web process: see the critical Redis's test.)
    assert ready.status_code == 503 and "job_store" in ready.json()["failed"], ready.text
    stack.wait_for(lambda: stack.ready().status_code == 200, "the job store answered again")
    results = httpx2.get(
        f"{stack.base_url}/v1/jobs/{job}/results?format=jsonl", headers=stack.headers, timeout=30
    )
    assert results.status_code == 200, results.text
    [line] = results.text.splitlines()
    assert len(json.loads(line)["embedding"]) == 384


def _submitted_job(stack: Stack, texts: list[str]) -> str:
    answer = httpx2.post(
        f"{stack.base_url}/v1/jobs", json={"model": MODEL, "input": texts}, headers=stack.headers, timeout=60
    )
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def _job(stack: Stack, job: str) -> dict:
    return httpx2.get(f"{stack.base_url}/v1/jobs/{job}", headers=stack.headers, timeout=30).json()


def test_the_celery_worker_killed_is_restarted_and_runs_what_was_sent_meanwhile(stack):
    worker = stack.child(" worker ")
    log = stack.run_dir / "celery-worker.log"
    readies = sum("ready." in record["message"] for record in stack.records(log))
    with process_group_paused(stack.process):
        kill(worker)
        job = _submitted_job(stack, ["sent while the worker was down", "and another"])
        assert _job(stack, job)["status"] == "queued"
    completed_s = stack.wait_for(lambda: _job(stack, job)["status"] == "completed", "the job completed")
    assert stack.child(" worker ") != worker
    assert sum("ready." in record["message"] for record in stack.records(log)) == readies + 1
    back = stack.said_once("The Celery worker is back")
    print(f"\nCelery worker SIGKILLed: {back}; the job sent meanwhile completed {completed_s:.1f} s after")


def web_workers(web: int) -> list[int]:
    """The web server's worker processes (multiprocessing's resource tracker is its child too)."""
    return [pid for pid in children_of(web) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def live_gauges(stack: Stack) -> set[int]:
    """The processes whose live gauges /metrics sums (prometheus_client's files, by pid)."""
    return {
        int(path.stem.rpartition("_")[2]) for path in (stack.run_dir / "prometheus").glob("gauge_live*_*.db")
    }


def test_a_web_worker_killed_is_replaced_and_its_live_gauges_dropped(stack):
    """uvicorn's own supervisor replaces a dead worker; ours (embedsite/server.py) also drops the
    dead one's live gauges, which it could not drop itself."""
    web = stack.child(" serve ")
    workers = web_workers(web)
    assert len(workers) == 2 and set(workers) <= live_gauges(stack)
    kill(workers[0])
    stack.wait_for(lambda: len(set(web_workers(web)) - set(workers)) == 1, "a new worker")
    stack.wait_for(lambda: workers[0] not in live_gauges(stack), "the dead worker's gauges dropped", 30)
    # The new worker has loaded the app (its own gauges) and serves.
    stack.wait_for(lambda: set(web_workers(web)) <= live_gauges(stack), "the new worker loaded")
    assert stack.child(" serve ") == web
    assert stack.embed().status_code == 200


def test_the_web_server_killed_is_restarted_and_its_orphans_ended(stack):
    """uvicorn's supervisor and one of its two workers SIGKILLed: the other worker, orphaned, still
    holds the port until runstack ends it; the killed worker's live gauges are dropped."""
    web = stack.child(" serve ")
    workers = web_workers(web)
    assert len(workers) == 2 and set(workers) <= live_gauges(stack)
    with process_group_paused(stack.process):
        kill(web)
        kill(workers[0])
    serving_s = stack.wait_for(
        lambda: _answers(f"{stack.base_url}/health") and stack.children(" serve ") not in ([], [web]),
        "a new web server",
    )
    wait_until_no_live_member(web)
    assert {web, *workers}.isdisjoint(live_gauges(stack))
    assert _answers(f"{stack.base_url}/metrics")
    assert stack.embed().status_code == 200
    back = stack.said_once("The web server is back")
    print(f"\nWeb server SIGKILLed: {back}; serving {serving_s:.1f} s after runstack resumed")


def test_a_child_dying_fast_again_and_again_makes_runstack_give_up_naming_it(stack):
    """The job store's append-only file made unreadable (as a disk fault would): each restart exits
    at once; the third death in a row stops the stack, with an error naming the job store and its
    log, which says why, and nothing left."""
    manifest = stack.run_dir / "redis-jobs" / "appendonlydir" / "appendonly.aof.manifest"
    assert manifest.is_file()
    with process_group_paused(stack.process):
        kill(stack.child(f"127.0.0.1:{urlsplit(stack.env['JOB_STORE_URL']).port}"))
        manifest.write_text("not a manifest\n")
    stack.process.wait(timeout=120)
    assert stack.process.returncode == 1
    [failure] = stack.said("ERROR")
    log = stack.run_dir / "redis-jobs.log"
    assert failure.startswith(
        f"Redis (job store) exited with status 1, 3 times in a row within 5 s of its start: giving up; "
        f"see {log}. Its last lines:\n"
    ), failure
    assert "Invalid AOF manifest file format" in failure
    # Killed (the test's SIGKILL), then one restart that exited at once, then the third death.
    killed, exited = [line for line in stack.said("WARNING") if line.startswith("Redis (job store) ")][-2:]
    assert killed.startswith("Redis (job store) was killed by SIGKILL") and "restarting it in 0.5 s" in killed
    assert exited.startswith("Redis (job store) exited with status 1") and "restarting it in 1 s" in exited
    assert stack.said("INFO")[-1] == "Stopped."
    stack.assert_nothing_left()
