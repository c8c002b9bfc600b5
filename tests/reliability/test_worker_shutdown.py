"""A Celery worker stopped by SIGTERM in the middle of a job (a rolling restart) finishes the chunks it
holds and leaves the rest queued; its replacement completes the job, every chunk run and counted once.
Real workers as runstack starts them (solo pool) and as compose/Kubernetes do (prefork, concurrency 2),
the real Triton and Redis (tests/worker_stack.py).

The texts are short (chunks take milliseconds): what holds a chunk in the worker's hands while it is
told to stop is Triton, paused (SIGSTOP) meanwhile, not the chunk's length."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embeddings.management.commands.runstack import start_celery
from embeddings.services.jobs.leases import chunk_runs
from embeddings.tooling.triton_server import die_with_parent
from tests import worker_stack
from tests.processes import REPO_ROOT, process_group_paused, stop_process_group
from tests.reliability.test_worker_recovery import job_store_of, task_lines
from tests.worker_stack import job_usage, texts

job_stack = worker_stack.job_stack

HANG_S = 180  # against hanging only


def start_deployed_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`celery -A embedsite worker --concurrency 2` (prefork), the command compose and Kubernetes run."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "embedsite", "worker", "--concurrency", "2",
             "--loglevel", "INFO"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_job_spanning_a_worker_restart_completes_exactly_once(
    job_stack, service_redis, triton_server, tmp_path, pool
):
    chunk_size, chunks = 8, 8
    # No beat, hence no watchdog: nothing but the workers themselves can finish or re-send a chunk.
    env = {**job_stack.env, "JOB_STALL_S": "600"}
    processes: list[subprocess.Popen] = []

    def start(name: str) -> tuple[subprocess.Popen, Path]:
        log_path = tmp_path / f"{name}.log"
        if pool == "solo":
            process = start_celery("worker", log_path, env=env)
        else:
            process = start_deployed_worker(env, log_path)
        processes.append(process)
        return process, log_path

    try:
        first, first_log = start("first")
        inputs = texts(f"restart {pool}", chunk_size * chunks)
        (job_id,) = job_stack.submit([("alpha", inputs)], chunk_size=chunk_size)
        store = job_store_of(job_stack, job_id)
        # SIGTERM once the worker holds a chunk after the first (the job well under way, most still
        # queued). Triton is paused from when a chunk after the first has started: the chunk the
        # worker holds then, or the one it takes next, cannot finish before the SIGTERM.
        deadline = time.monotonic() + HANG_S
        while not any(chunk >= 1 for chunk in chunk_runs(store).started_ms):
            assert time.monotonic() < deadline, f"no chunk started:\n{first_log.read_text()[-3000:]}"
            time.sleep(0.01)
        with process_group_paused(triton_server.process):
            while True:
                assert time.monotonic() < deadline, f"no chunk in hand:\n{first_log.read_text()[-3000:]}"
                in_hand = [chunk for chunk in chunk_runs(store).started_ms if not store.is_chunk_done(chunk)]
                if any(chunk >= 1 for chunk in in_hand):
                    break
                assert not all(store.is_chunk_done(chunk) for chunk in range(chunks)), "the job ran out"
                time.sleep(0.01)
            signalled_at = time.monotonic()
            first.send_signal(signal.SIGTERM)
        first.wait(timeout=HANG_S)
        stop_s = time.monotonic() - signalled_at
        first_text = first_log.read_text()
        assert first.returncode == 0, first_text[-3000:]
        assert "Warm shutdown" in first_text
        # It finished what it held; the rest is still to do.
        assert all(store.is_chunk_done(chunk) for chunk in in_hand), first_text[-3000:]
        done_by_first = [chunk for chunk in range(chunks) if store.is_chunk_done(chunk)]
        assert len(done_by_first) < chunks and job_stack.job(job_id)["status"] != "completed"

        _, second_log = start("second")
        job = job_stack.wait(job_id, {"completed", "failed"}, [first_log, second_log], timeout_s=HANG_S)
    finally:
        for process in processes:
            stop_process_group(process)

    total = chunk_size * chunks
    assert (job["status"], job["completed"], job["failed"], job["total"]) == ("completed", total, 0, total)
    rows, max_difference, tokens = job_stack.compare(job_id, inputs)
    assert rows == total and max_difference < 1e-5 and job["prompt_tokens"] == tokens
    usage = job_usage()
    assert (usage["requests"], usage["succeeded"], usage["inputs"], usage["tokens"]) == (
        chunks,
        chunks,
        total,
        tokens,
    )
    assert chunk_runs(store).runs == dict.fromkeys(range(chunks), 1)
    # (The replacement's log may still be catching up when it is stopped: its count is the rest.)
    first_lines = task_lines([first_log], "job_chunk_task")
    assert len(first_lines) == len(done_by_first)
    chunk_s = min(float(re.search(r"succeeded in ([\d.]+)s", line).group(1)) for line in first_lines)
    print(
        f"\nworker ({pool}) SIGTERMed holding chunk(s) {in_hand} of {chunks}: stopped {stop_s:.2f} s later "
        f"(a chunk took {chunk_s:.2f} s at least) after finishing them; {len(done_by_first)} chunks by it, "
        f"{chunks - len(done_by_first)} by its replacement, each once"
    )
