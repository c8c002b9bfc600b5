"""Where each chunk of a job is: handed out, running under a lease its worker keeps alive, finished;
and what the watchdog reads to re-send the chunks a dead worker left behind.

Keys beside JobStore's in the job store (same `{job id}` hash tag; all in embeddings.redis.keys,
the scripts in embeddings.redis.scripts), every time in milliseconds of the job store's own clock
(TIME inside the scripts), so workers on other machines need no synchronised clocks:

    job:{<id>}:sent      hash chunk -> when it was handed out (to the broker), or when its retry
                         is due; removed once the chunk is finished and has handed out its successor
    job:{<id>}:lease     hash chunk -> "<deadline> <host>:<pid>": the chunk is running; its worker
                         moves the deadline on every JOB_CHUNK_LEASE_S / 3 (a heartbeat thread)
    job:{<id>}:runs      hash chunk -> how many times its embedding started (1 unless re-run)
    job:{<id>}:started   hash chunk -> when its embedding last started
    job:{<id>}:requeue   list of chunks re-opened for a retry: handed out (as successors, and by
                         the watchdog's fresh window) once every chunk number was
    job:{<id>}:errors    hash chunk -> its last error: why it failed (written with its failure,
                         JobStore.fail_chunk), or why its Celery retry is due (chunk_mark_sent)

What the watchdog concludes for a chunk handed out and not finished (one script per job, so two
watchdogs at once cannot both re-send a chunk):

    lease deadline ahead            running: left alone, however long it takes
    lease deadline passed           its worker died mid-chunk: re-sent at once
    no lease, handed out long ago   its message was lost (a worker killed between taking it and
                                    starting it, or between handing it out and sending it):
                                    re-sent after JOB_STALL_S (a message still queued is re-sent
                                    too then, a harmless duplicate)
    finished, no successor handed   its worker died in between: the successor is handed out now

A queued chunk has no lease, so it is never mistaken for a lost running one. Re-sending is safe
because chunk tasks are idempotent (embeddings.services.jobs.engine).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass

import redis
from django.conf import settings

from embeddings.redis import scripts
from embeddings.redis.scripts import Script
from embeddings.redis.transport import ScriptCall, operation_run_sync, single
from embeddings.services.jobs.store import JobStore, error_text

logger = logging.getLogger(__name__)


def _run(store: JobStore, script: Script, kinds: tuple[str, ...], args: list):
    """Run one of the lease scripts on the job's keys of `kinds` (in that order)."""
    keys = [store.key(kind) for kind in kinds]
    return operation_run_sync(single(ScriptCall(script, keys, args)), store.client)


def chunk_take_next(store: JobStore, *, chunks: int) -> int:
    """The next chunk to hand out, recorded as handed out; >= chunks when none is left."""
    return int(_run(store, scripts.JOB_CHUNK_TAKE_NEXT, ("next", "sent", "requeue"), [store.ttl_s, chunks]))


def chunk_hand_off(store: JobStore, *, chunk: int, chunks: int) -> int:
    """The successor of a finished chunk, once per chunk; -1 (or >= chunks) when none is due."""
    kinds = ("handoff", "next", "sent", "requeue")
    return int(_run(store, scripts.JOB_CHUNK_HANDOFF, kinds, [chunk, store.ttl_s, chunks]))


def chunk_mark_sent(store: JobStore, *, chunk: int, delay_s: float = 0.0, error: str = "") -> None:
    """Record the chunk handed out again now, or due after `delay_s` (a retry's countdown), so the
    stall timer counts from then; `error`, why it is retried, becomes its last error."""
    arguments = [chunk, round(delay_s * 1000), store.ttl_s, error_text(error)]
    _run(store, scripts.JOB_CHUNK_MARK_SENT, ("sent", "errors"), arguments)


def live_leases(store: JobStore) -> int:
    return int(_run(store, scripts.JOB_LIVE_LEASES, ("lease",), []))


@dataclass(frozen=True)
class ScanResult:
    lost: list[int]  # their worker died mid-chunk
    stalled: list[int]  # handed out JOB_STALL_S ago and never started
    successors: list[int]  # of chunks finished by a worker that died before handing them out
    in_flight: int  # chunks handed out and not finished (after the re-sends)


def chunks_scan(store: JobStore, *, chunks: int, stall_s: float) -> ScanResult:
    """Classify the job's handed-out chunks (module docstring); the ones to send are marked sent."""
    kinds = ("sent", "lease", "done", "handoff", "next", "requeue")
    args = [round(stall_s * 1000), store.ttl_s, chunks]
    lost, stalled, successors, in_flight = _run(store, scripts.JOB_CHUNKS_SCAN, kinds, args)
    return ScanResult(
        [int(c) for c in lost], [int(c) for c in stalled], [int(c) for c in successors], int(in_flight)
    )


@dataclass(frozen=True)
class ChunksReopened:
    reopened: list[int]  # chunks counted failed until now, to run again
    to_send: list[int]  # of them, those handed out now (the job's first window); the rest follow


def chunks_reopen(store: JobStore, *, rows: dict[int, int], chunks: int, window: int) -> ChunksReopened:
    """Re-open a failed job's failed chunks (`rows`: chunk -> its inputs) to run again, and take the
    first `window` of them to hand out (scripts.JOB_CHUNKS_REOPEN says how): a chunk no longer
    counted failed (re-opened by a retry at the same time) is left out."""
    kinds = ("done", "failed", "progress", "handoff", "requeue", "cancel", "next", "sent", "lease")
    args: list = [store.ttl_s, chunks, window]
    for chunk, count in rows.items():
        args += [chunk, count]
    reopened, to_send = _run(store, scripts.JOB_CHUNKS_REOPEN, kinds, args)
    return ChunksReopened([int(chunk) for chunk in reopened], [int(chunk) for chunk in to_send])


def chunks_requeued(store: JobStore) -> list[int]:
    """Re-opened chunks not handed out yet, in the order they will be."""
    return [int(chunk) for chunk in store.client.lrange(store.key("requeue"), 0, -1)]


@dataclass(frozen=True)
class ChunkState:
    """Where one chunk of a job is, as an operator reads it (the admin's job page)."""

    chunk: int
    # running (leased), lease lapsed (its worker died; the watchdog re-sends it), sent (in the
    # broker), requeued (re-opened for a retry, not handed out yet), queued (not handed out yet),
    # not run (its job ended first), done, failed.
    state: str
    attempts: int  # how often its embedding started
    lease_owner: str  # "<host>:<pid>" of the worker holding its lease (running, or lapsed)
    lease_deadline_ms: int | None  # the job store's clock
    started_ms: int | None  # when its embedding last started
    error: str  # its last error: why it failed, or why it was last retried


def chunk_states(store: JobStore, *, chunks: int, ended: bool) -> tuple[list[ChunkState], int]:
    """Every chunk's state (`ended`: the job has finished, so a chunk never handed out was not
    run), and the job store's clock (ms), read in one round trip."""
    pipeline = store.client.pipeline(transaction=False)
    pipeline.smembers(store.key("done"))
    pipeline.smembers(store.key("failed"))
    for kind in ("sent", "lease", "runs", "started", "errors"):
        pipeline.hgetall(store.key(kind))
    pipeline.lrange(store.key("requeue"), 0, -1)
    pipeline.time()
    done, failed, sent, leases, runs, started, errors, requeue, (seconds, microseconds) = pipeline.execute()
    now_ms = seconds * 1000 + microseconds // 1000
    done, failed, requeued = {int(c) for c in done}, {int(c) for c in failed}, {int(c) for c in requeue}
    sent = {int(c) for c in sent}
    leases = {int(c): lease.decode().split(" ", 1) for c, lease in leases.items()}
    runs = {int(c): int(count) for c, count in runs.items()}
    started = {int(c): int(at) for c, at in started.items()}
    errors = {int(c): error.decode(errors="replace") for c, error in errors.items()}
    states = []
    for chunk in range(chunks):
        deadline, owner = leases.get(chunk, (None, ""))
        deadline_ms = None if deadline is None else int(deadline)
        if chunk in failed:
            state = "failed"
        elif chunk in done:
            state = "done"
        elif deadline_ms is not None:
            state = "running" if deadline_ms > now_ms else "lease lapsed"
        elif chunk in sent:
            state = "sent"
        elif chunk in requeued:
            state = "requeued"
        else:
            state = "not run" if ended else "queued"
        states.append(
            ChunkState(
                chunk,
                state,
                runs.get(chunk, 0),
                owner,
                deadline_ms,
                started.get(chunk),
                errors.get(chunk, ""),
            )
        )
    return states, now_ms


@dataclass(frozen=True)
class ChunkRuns:
    """How often each chunk's embedding started, and when last (Redis ms): for operators and tests."""

    runs: dict[int, int]
    started_ms: dict[int, int]


def chunk_runs(store: JobStore) -> ChunkRuns:
    runs = store.client.hgetall(store.key("runs"))
    started = store.client.hgetall(store.key("started"))
    return ChunkRuns(
        {int(chunk): int(count) for chunk, count in runs.items()},
        {int(chunk): int(at) for chunk, at in started.items()},
    )


class ChunkLease:
    """Held while a worker runs a chunk: taken on entry, renewed by a daemon thread every third of
    JOB_CHUNK_LEASE_S (a thread, so a long Triton call or tokenisation cannot starve it; gRPC and
    the tokenizer release the GIL), dropped on exit. A worker killed stops renewing it, and the
    watchdog re-sends the chunk once the deadline has passed."""

    def __init__(self, store: JobStore, chunk: int, *, lease_s: float | None = None) -> None:
        self.store = store
        self.chunk = chunk
        self.lease_s = settings.JOB_CHUNK_LEASE_S if lease_s is None else lease_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ChunkLease:
        store = self.store
        args = [self.chunk, self._lease_ms, self.owner, store.ttl_s]
        _run(store, scripts.JOB_LEASE_TAKE, ("lease", "runs", "started", "done"), args)
        self._thread = threading.Thread(
            target=self._renew_until_stopped, name=f"lease {store.job_id}:{self.chunk}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            # Joined before the release, so a late renewal cannot bring the lease back.
            self._thread.join(timeout=settings.JOB_STORE_TIMEOUT_S * 3 + 1)
        store = self.store
        try:
            _run(store, scripts.JOB_LEASE_RELEASE, ("lease", "sent", "done", "handoff"), [self.chunk])
        except redis.RedisError as error:  # the lease lapses by itself; don't hide the chunk's own error
            logger.warning("job %s chunk %s: lease not released: %s", store.job_id, self.chunk, error)

    @property
    def _lease_ms(self) -> int:
        return round(self.lease_s * 1000)

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                _run(
                    self.store, scripts.JOB_LEASE_RENEW, ("lease",), [self.chunk, self._lease_ms, self.owner]
                )
            except redis.RedisError as error:  # try again at the next beat; the lease may lapse
                logger.warning("job %s chunk %s: lease not renewed: %s", self.store.job_id, self.chunk, error)
