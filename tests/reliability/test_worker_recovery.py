"""A job outlives the loss of a worker: real Celery workers and beat (tests/worker_stack.py), the real
Triton and Redis. A worker SIGKILLed mid-chunk has its chunk re-run once its lease lapses, within
JOB_CHUNK_LEASE_S + JOB_WATCHDOG_INTERVAL_S (plus the queue the re-sent chunk joins), every result
exactly once; a chunk that runs far longer than its lease is never re-sent while its worker lives."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

from embeddings.redis.connections import redis_job_store
from embeddings.services.jobs.leases import chunk_runs
from embeddings.services.jobs.store import JobStore
from tests import worker_stack
from tests.processes import process_group_paused
from tests.worker_stack import JobStack, job_usage, texts

job_stack = worker_stack.job_stack
start_worker = worker_stack.start_worker

# How many leases the long chunk is kept in hand (at least three are asserted).
HELD_LEASES = 4

WORDS = (
    "a worker keeps a lease on every chunk it embeds and renews it while it runs so that the "
    "watchdog can tell a long chunk from one whose worker is gone"
).split()


def long_texts(prefix: str, count: int) -> list[str]:
    """Texts of 120 words (about 140 tokens, half the model's 256), so a chunk takes a while."""
    return [
        f"{prefix} {index}: " + " ".join(WORDS[(index + k) % len(WORDS)] for k in range(120))
        for index in range(count)
    ]


def job_store_of(stack: JobStack, job_id: int) -> JobStore:
    return JobStore(redis_job_store(), stack.job(job_id)["public_id"], ttl_s=3600)


def redis_now_ms() -> int:
    """The job store's clock, which leases are timed by."""
    seconds, microseconds = redis_job_store().time()
    return seconds * 1000 + microseconds // 1000


def logged_at(line: str) -> float:
    """The unix time of a worker's log line `2026-11-23 18:05:56,367 INFO celery.app.trace [...]: ...`
    (Celery logs through Django's LOGGING, LOG_FORMAT=text)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def task_lines(logs: list[Path], task: str, outcome: str = "succeeded") -> list[str]:
    pattern = re.compile(rf"embeddings\.tasks\.{task}\[[^\]]+\] {outcome}")
    return [line for log in logs for line in log.read_text().splitlines() if pattern.search(line)]


def test_a_worker_killed_mid_chunk_is_replaced_within_the_lease(job_stack, start_worker):
    """Two workers and beat as shipped (lease 3 s, watchdog every 1 s); SIGKILL the process group of
    the worker holding a chunk's lease, stopped (SIGSTOP) first so that the chunk is known unfinished
    when it dies; the other worker re-runs that chunk."""
    lease_s, interval_s = 3.0, 1.0
    chunk_size, chunks = 8, 10
    settings_env = {"JOB_CHUNK_LEASE_S": str(lease_s), "JOB_STALL_S": "600"}
    workers = {}
    for _ in range(2):
        process, log = start_worker(**settings_env)
        workers[process.pid] = (process, log)
    _, beat_log = start_worker("beat", JOB_WATCHDOG_INTERVAL_S=str(interval_s))
    logs = [log for _, log in workers.values()] + [beat_log]
    inputs = long_texts("recover", chunk_size * chunks)
    (job_id,) = job_stack.submit([("alpha", inputs)], chunk_size=chunk_size)
    store = job_store_of(job_stack, job_id)

    # Wait for a chunk in hand after the job got going; its worker, stopped, can neither finish it
    # nor renew its lease: killed if the chunk is still unfinished and its own, else let go on.
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, f"no chunk started:\n{job_stack.job(job_id)}"
        now = redis_now_ms()
        for field, value in store.client.hgetall(store.key("lease")).items():
            chunk, (due, owner) = int(field), value.decode().split(" ")
            if chunk >= 2 and int(due) > now and not store.is_chunk_done(chunk):
                pid = int(owner.rsplit(":", 1)[1])
                killed_at = time.time()  # it does nothing after this
                os.killpg(pid, signal.SIGSTOP)
                lease = store.client.hget(store.key("lease"), field)
                if (
                    lease is not None
                    and lease.decode().split(" ")[1] == owner
                    and not store.is_chunk_done(chunk)
                ):
                    victim = chunk, pid
                    break
                os.killpg(pid, signal.SIGCONT)
        time.sleep(0.02)
    chunk, pid = victim
    killed, _ = workers.pop(pid)
    os.killpg(pid, signal.SIGKILL)
    killed.wait(timeout=10)
    assert not store.is_chunk_done(chunk), "the chunk finished before its worker died; nothing to recover"

    job = job_stack.wait(job_id, {"completed", "failed"}, logs, timeout_s=180)
    total = chunk_size * chunks
    assert (job["status"], job["completed"], job["failed"], job["total"]) == ("completed", total, 0, total)
    # Every result exactly once: the vectors are the synchronous ones, usage counted once per chunk.
    rows, max_difference, tokens = job_stack.compare(job_id, inputs)
    assert rows == total and max_difference < 1e-5 and job["prompt_tokens"] == tokens
    usage = job_usage()
    assert (usage["requests"], usage["succeeded"], usage["inputs"], usage["tokens"]) == (
        chunks,
        chunks,
        total,
        tokens,
    )
    runs = chunk_runs(store)
    assert runs.runs == {number: 2 if number == chunk else 1 for number in range(chunks)}, runs
    survivor_log = next(iter(workers.values()))[1]
    assert f"re-sent (worker lost mid-chunk): [{chunk}]" in survivor_log.read_text()

    # The re-run started once the lease lapsed (never before: the last heartbeat renewed it for
    # lease_s, at most lease_s / 3 before the kill) and within lease + watchdog interval, plus the
    # chunks the survivor was running meanwhile: the watchdog's tick and the re-sent chunk go ahead
    # of queued chunks, but each waits for the chunk in hand; at worst two (the tick arriving just
    # after the survivor took another). Chunk times as the workers logged them in this test.
    longest_chunk_s = max(
        float(re.search(r"succeeded in ([\d.]+)s", line).group(1))
        for line in task_lines(logs, "job_chunk_task")
    )
    recovery_s = runs.started_ms[chunk] / 1000 - killed_at
    bound_s = lease_s + interval_s + 2 * longest_chunk_s
    print(
        f"\nworker killed mid-chunk: chunk {chunk} re-run {recovery_s:.2f} s after the kill (lease "
        f"{lease_s} s, watchdog every {interval_s} s, longest chunk {longest_chunk_s:.2f} s; "
        f"bound {bound_s:.2f} s)"
    )
    assert lease_s * 2 / 3 - 0.1 <= recovery_s <= bound_s

    # Celery delivers the dead worker's message again after its visibility timeout: nothing changes.
    before = len(task_lines([survivor_log], "job_chunk_task"))
    job_stack.django.run(
        f"from embeddings.services.jobs.engine import chunk_send; chunk_send({job_id}, {chunk})"
    )
    deadline = time.monotonic() + 60
    while len(task_lines([survivor_log], "job_chunk_task")) == before:
        assert time.monotonic() < deadline, survivor_log.read_text()[-3000:]
        time.sleep(0.1)
    assert job_stack.job(job_id)["completed"] == total and job_usage() == usage
    assert chunk_runs(store).runs[chunk] == 2


def test_a_chunk_longer_than_many_leases_is_not_resent_while_its_worker_lives(
    job_stack, start_worker, triton_server
):
    """One chunk that takes several leases (a 2 s lease) with the watchdog every 0.5 s on a second
    worker: the heartbeat keeps the lease, the chunk runs once. The chunk is long because its Triton
    answers late, as a saturated one does: Triton is paused (SIGSTOP) from before the chunk starts
    until it has been in hand for HELD_LEASES leases by the job store's clock, whatever the
    machine's speed; no other work keeps it waiting that long. So the texts can be short."""
    lease_s, interval_s = 2.0, 0.5
    count = 16
    env = {"JOB_CHUNK_LEASE_S": str(lease_s), "JOB_STALL_S": "600"}
    _, first_log = start_worker(**env)
    _, second_log = start_worker(**env)
    _, beat_log = start_worker("beat", JOB_WATCHDOG_INTERVAL_S=str(interval_s))
    logs = [first_log, second_log, beat_log]
    inputs = texts("long", count)
    with process_group_paused(triton_server.process):
        (job_id,) = job_stack.submit([("beta", inputs)], chunk_size=count)
        store = job_store_of(job_stack, job_id)
        deadline = time.monotonic() + 120  # against hanging
        while (started_ms := chunk_runs(store).started_ms.get(0)) is None:
            assert time.monotonic() < deadline, f"the chunk did not start:\n{job_stack.job(job_id)}"
            time.sleep(0.02)
        while redis_now_ms() < started_ms + HELD_LEASES * lease_s * 1000:
            assert not store.is_chunk_done(0), "the chunk finished while Triton was paused"
            time.sleep(0.05)
    job = job_stack.wait(job_id, {"completed", "failed"}, logs, timeout_s=180)
    assert (job["status"], job["completed"], job["chunks"]) == ("completed", count, 1)
    rows, max_difference, tokens = job_stack.compare(job_id, inputs)
    assert rows == count and max_difference < 1e-5 and job["prompt_tokens"] == tokens

    runs = chunk_runs(job_store_of(job_stack, job_id))
    assert runs.runs == {0: 1}
    (chunk_line,) = task_lines(logs, "job_chunk_task")
    chunk_s = float(re.search(r"succeeded in ([\d.]+)s", chunk_line).group(1))
    started = runs.started_ms[0] / 1000
    ticks = [
        at for at in map(logged_at, task_lines(logs, "job_watchdog_task")) if started < at < started + chunk_s
    ]
    print(
        f"\nlong chunk: {count} texts ran {chunk_s:.2f} s = {chunk_s / lease_s:.1f} leases, "
        f"{len(ticks)} watchdog passes meanwhile, run once"
    )
    assert chunk_s >= 3 * lease_s, "the chunk was not long enough to outlive its lease without heartbeats"
    assert len(ticks) >= chunk_s / interval_s / 3, "the watchdog did not run while the chunk ran"
    assert not any("re-sent" in log.read_text() for log in logs)
