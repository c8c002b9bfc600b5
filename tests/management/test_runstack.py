"""`manage.py runstack` (what `make run` runs), whole, on free ports: when Triton dies, the stack stops
with an error naming Triton, and nothing it started is left, Triton's backend stubs included even when
they hang (stopped here with SIGSTOP, so only SIGKILL ends them)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx2

from embeddings.triton.server import die_with_parent, free_port, shared_memory_regions
from tests.conftest import require_exported_model
from tests.processes import REPO_ROOT, children_of, manage, stop_process_group, wait_until_healthy
from tests.triton.test_server_process_group import group_processes, stubs_of, wait_until_no_live_member

CELERY_SIGNAL_NOTICE = re.compile(r"worker: (Warm|Cold) shutdown \(MainProcess\)")
START_DEADLINE_S = 240  # against hanging only: Triton, Celery and uvicorn start on a loaded machine


def test_when_triton_dies_runstack_stops_everything_and_leaves_no_stub(tmp_path):
    require_exported_model(REPO_ROOT / "model_repository")
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
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
        # MiniLM is not among the models Triton loads at start: the catalog's reconcile at start
        # loads it, as it loads every registered model.
        "TRITON_STARTUP_MODELS": "minilm_tokenizer",
        # Every process's lines as JSON (README "Observability"), runstack's own included.
        "LOG_FORMAT": "json",
    }
    for inherited in ("PROMETHEUS_MULTIPROC_DIR", "CELERY_BROKER_URL"):
        env.pop(inherited, None)
    manage(env, "migrate", "--noinput")
    assert "loads when the stack starts" in manage(env, "register_local_model")
    log = tmp_path / "runstack.log"
    with log.open("wb") as output:
        runstack = subprocess.Popen(
            [sys.executable, "manage.py", "runstack", "--workers", "1"],
            cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    try:
        wait_until_healthy(
            runstack,
            f"http://127.0.0.1:{port}",
            log,
            ready=lambda: "embedsite on" in log.read_text(),
            timeout_s=START_DEADLINE_S,
        )
        ready = httpx2.get(f"http://127.0.0.1:{port}/ready", timeout=30)
        assert ready.status_code == 200, ready.text
        assert ready.json()["models"]["all-MiniLM-L6-v2"]["state"] == "READY", ready.text
        started = children_of(runstack.pid)
        assert list(started.values()).count("redis-server") == 2  # the critical Redis and the job store
        [triton] = [pid for pid, name in started.items() if name == "tritonserver"]
        stubs = stubs_of(triton)
        regions = shared_memory_regions([triton, *stubs])
        assert stubs and regions
        for stub in stubs:
            os.kill(stub, signal.SIGSTOP)
        os.kill(triton, signal.SIGKILL)
        runstack.wait(timeout=120)
    finally:
        stop_process_group(runstack)
    output = log.read_text()
    assert runstack.returncode != 0
    outputs = {
        "runstack": log,
        "worker": tmp_path / "celery-worker.log",
        "beat": tmp_path / "celery-beat.log",
    }
    # Every line of every process is one JSON object, but the notice Celery's signal handler writes
    # straight to the worker's stdout (no logging in a signal handler).
    records = {
        name: [
            json.loads(line)
            for line in path.read_text().splitlines()
            if line.strip() and not CELERY_SIGNAL_NOTICE.fullmatch(line)
        ]
        for name, path in outputs.items()
    }
    assert all(records.values()), records
    messages = [record["message"] for record in records["runstack"]]
    assert any(message.startswith("embedsite on http://127.0.0.1:") for message in messages), messages
    assert "Stopped." in messages, output[-3000:]
    [failure] = [
        record
        for record in records["runstack"]
        if record["logger"] == "embedsite.runstack" and record["level"] == "ERROR"
    ]
    assert failure["message"].startswith("Triton exited unexpectedly"), failure
    wait_until_no_live_member(triton)
    assert [name for name in regions if Path("/dev/shm", name).exists()] == []
    # Both Redis, the Celery worker and beat, uvicorn: each its own group, none left.
    for pid, name in started.items():
        live = {member: state for member, state in group_processes(pid).items() if state != "Z"}
        assert live == {}, f"{name} ({pid}) left: {live}"
