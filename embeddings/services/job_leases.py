"""Where each chunk of a job is: handed out, running under a lease its worker keeps alive, finished;
and what the watchdog reads to re-send the chunks a dead worker left behind.

Keys beside JobStore's in the job store (same `{job id}` hash tag), every time in milliseconds of
the job store's own clock (TIME inside the scripts), so workers on other machines need no
synchronised clocks:

    job:{<id>}:sent      hash chunk -> when it was handed out (to the broker), or when its retry
                         is due; removed once the chunk is finished and has handed out its successor
    job:{<id>}:lease     hash chunk -> "<deadline> <host>:<pid>": the chunk is running; its worker
                         moves the deadline on every JOB_CHUNK_LEASE_S / 3 (a heartbeat thread)
    job:{<id>}:runs      hash chunk -> how many times its embedding started (1 unless re-run)
    job:{<id>}:started   hash chunk -> when its embedding last started

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
because chunk tasks are idempotent (embeddings.services.jobs).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass

import redis
from django.conf import settings

from embeddings.services.job_store import JobStore

logger = logging.getLogger(__name__)

LEASE_KINDS = ("sent", "lease", "runs", "started")

_NOW = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function deadline(lease)
    if not lease then return nil end
    return tonumber(string.match(lease, '^%d+'))
end
"""

# Takes the next chunk number from the job's counter and records it handed out.
# KEYS: next, sent. ARGV: ttl, chunks. Returns the number (>= chunks: none left).
_TAKE_NEXT_BODY = """
local function take_next(next_key, sent_key, ttl, chunks, now)
    local chunk = redis.call('INCR', next_key) - 1
    redis.call('EXPIRE', next_key, ttl)
    if chunk < chunks then
        redis.call('HSET', sent_key, chunk, now)
        redis.call('EXPIRE', sent_key, ttl)
    end
    return chunk
end
"""

TAKE_NEXT = (
    _NOW
    + _TAKE_NEXT_BODY
    + """
return take_next(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), now_ms())
"""
)

# One successor per finished chunk (a redelivered chunk hands out none).
# KEYS: handoff, next, sent. ARGV: chunk, ttl, chunks. Returns the successor, or -1.
HANDOFF = (
    _NOW
    + _TAKE_NEXT_BODY
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 0 then
    return -1
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return take_next(KEYS[2], KEYS[3], ARGV[2], tonumber(ARGV[3]), now_ms())
"""
)

# Marks a chunk handed out again, due in ARGV[2] ms (a watchdog re-send, or a retry's countdown).
# KEYS: sent. ARGV: chunk, delay ms, ttl.
MARK_SENT = (
    _NOW
    + """
redis.call('HSET', KEYS[1], ARGV[1], now_ms() + tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# A chunk starts: its lease, and a run counted unless it was finished before (a redelivery).
# KEYS: lease, runs, started, done. ARGV: chunk, lease ms, owner, ttl.
LEASE_TAKE = (
    _NOW
    + """
local now = now_ms()
redis.call('HSET', KEYS[1], ARGV[1], (now + tonumber(ARGV[2])) .. ' ' .. ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
    redis.call('HSET', KEYS[3], ARGV[1], now)
    redis.call('EXPIRE', KEYS[2], ARGV[4])
    redis.call('EXPIRE', KEYS[3], ARGV[4])
end
return now
"""
)

# The heartbeat. KEYS: lease. ARGV: chunk, lease ms, owner.
LEASE_RENEW = (
    _NOW
    + """
redis.call('HSET', KEYS[1], ARGV[1], (now_ms() + tonumber(ARGV[2])) .. ' ' .. ARGV[3])
return 1
"""
)

# The chunk's run ended (finished, failed, or gave up for a retry). KEYS: lease, sent, done,
# handoff. ARGV: chunk. A finished chunk that handed out its successor is no longer in flight.
LEASE_RELEASE = """
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 and redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
"""

# Live leases of a job (a cancelled job ends once none is left). KEYS: lease.
LIVE_LEASES = (
    _NOW
    + """
local now, live = now_ms(), 0
local leases = redis.call('HGETALL', KEYS[1])
for i = 1, #leases, 2 do
    local due = deadline(leases[i + 1])
    if due and due > now then live = live + 1 end
end
return live
"""
)

# The watchdog's pass over one job (see the module docstring). KEYS: sent, lease, done, handoff,
# next. ARGV: stall ms, ttl, chunks. Returns {lost running, never started, successors handed
# out, chunks still in flight}; the first three are marked handed out now.
SCAN = (
    _NOW
    + _TAKE_NEXT_BODY
    + """
local now, stall, ttl, chunks = now_ms(), tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local lost, stalled, successors = {}, {}, {}
local sent = redis.call('HGETALL', KEYS[1])
for i = 1, #sent, 2 do
    local chunk, handed_at = sent[i], tonumber(sent[i + 1])
    local due = deadline(redis.call('HGET', KEYS[2], chunk))
    local alive = due and due > now
    if redis.call('SISMEMBER', KEYS[3], chunk) == 1 then
        if not alive then
            if redis.call('HSETNX', KEYS[4], chunk, 1) == 1 then
                redis.call('EXPIRE', KEYS[4], ttl)
                local successor = take_next(KEYS[5], KEYS[1], ttl, chunks, now)
                if successor < chunks then table.insert(successors, successor) end
            end
            redis.call('HDEL', KEYS[1], chunk)
            redis.call('HDEL', KEYS[2], chunk)
        end
    elseif alive then
        -- running: its worker's heartbeat keeps the lease
    elseif due then
        redis.call('HDEL', KEYS[2], chunk)
        redis.call('HSET', KEYS[1], chunk, now)
        table.insert(lost, tonumber(chunk))
    elseif now - handed_at >= stall then
        redis.call('HSET', KEYS[1], chunk, now)
        table.insert(stalled, tonumber(chunk))
    end
end
return {lost, stalled, successors, redis.call('HLEN', KEYS[1])}
"""
)


def _script(client: redis.Redis, source: str):
    cache = client.__dict__.setdefault("_embedsite_lease_scripts", {})
    if source not in cache:
        cache[source] = client.register_script(source)
    return cache[source]


def lease_keys(store: JobStore) -> list[str]:
    """This module's keys of the job (for deleting a job's data)."""
    return [store.key(kind) for kind in LEASE_KINDS]


def chunk_take_next(store: JobStore, *, chunks: int) -> int:
    """The next chunk to hand out, recorded as handed out; >= chunks when none is left."""
    keys = [store.key("next"), store.key("sent")]
    return int(_script(store.client, TAKE_NEXT)(keys=keys, args=[store.ttl_s, chunks]))


def chunk_hand_off(store: JobStore, *, chunk: int, chunks: int) -> int:
    """The successor of a finished chunk, once per chunk; -1 (or >= chunks) when none is due."""
    keys = [store.key("handoff"), store.key("next"), store.key("sent")]
    return int(_script(store.client, HANDOFF)(keys=keys, args=[chunk, store.ttl_s, chunks]))


def chunk_mark_sent(store: JobStore, *, chunk: int, delay_s: float = 0.0) -> None:
    """Record the chunk handed out again now, or due after `delay_s` (a retry's countdown), so the
    stall timer counts from then."""
    args = [chunk, round(delay_s * 1000), store.ttl_s]
    _script(store.client, MARK_SENT)(keys=[store.key("sent")], args=args)


def live_leases(store: JobStore) -> int:
    return int(_script(store.client, LIVE_LEASES)(keys=[store.key("lease")]))


@dataclass(frozen=True)
class ScanResult:
    lost: list[int]  # their worker died mid-chunk
    stalled: list[int]  # handed out JOB_STALL_S ago and never started
    successors: list[int]  # of chunks finished by a worker that died before handing them out
    in_flight: int  # chunks handed out and not finished (after the re-sends)


def chunks_scan(store: JobStore, *, chunks: int, stall_s: float) -> ScanResult:
    """Classify the job's handed-out chunks (module docstring); the ones to send are marked sent."""
    keys = [store.key(kind) for kind in ("sent", "lease", "done", "handoff", "next")]
    args = [round(stall_s * 1000), store.ttl_s, chunks]
    lost, stalled, successors, in_flight = _script(store.client, SCAN)(keys=keys, args=args)
    return ScanResult(
        [int(c) for c in lost], [int(c) for c in stalled], [int(c) for c in successors], int(in_flight)
    )


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
        keys = [store.key(kind) for kind in ("lease", "runs", "started", "done")]
        args = [self.chunk, self._lease_ms, self.owner, store.ttl_s]
        _script(store.client, LEASE_TAKE)(keys=keys, args=args)
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
        keys = [store.key(kind) for kind in ("lease", "sent", "done", "handoff")]
        try:
            _script(store.client, LEASE_RELEASE)(keys=keys, args=[self.chunk])
        except redis.RedisError as error:  # the lease lapses by itself; don't hide the chunk's own error
            logger.warning("job %s chunk %s: lease not released: %s", store.job_id, self.chunk, error)

    @property
    def _lease_ms(self) -> int:
        return round(self.lease_s * 1000)

    def _renew_until_stopped(self) -> None:
        renew = _script(self.store.client, LEASE_RENEW)
        key = [self.store.key("lease")]
        while not self._stop.wait(self.lease_s / 3):
            try:
                renew(keys=key, args=[self.chunk, self._lease_ms, self.owner])
            except redis.RedisError as error:  # try again at the next beat; the lease may lapse
                logger.warning("job %s chunk %s: lease not renewed: %s", self.store.job_id, self.chunk, error)
