"""Every Lua script embedsite runs, each a named `Script` object defined once.

A script is run by name and SHA1 (EVALSHA); the transports (embeddings.redis.transport) load its
source when Redis does not know it (first use, or after a restart), in one place for all of them.
What each script's KEYS and ARGV are is said above it; the keys are named by embeddings.redis.keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


# Gives tokens back to a window counter. A counter whose key has expired meanwhile is not
# recreated: it would only hold a negative count. Shared by every script that refunds.
_REFUND = """
local function refund(counter, amount)
  if redis.call('EXISTS', counter) == 1 then redis.call('DECRBY', counter, amount) end
end
"""

# --- Quotas (embeddings.services.quotas.limits) ---------------------------------------------------------

# KEYS[1..m] rate cells, KEYS[m+1..m+n] budget counters, KEYS[m+n+1..] lease sets.
# ARGV: now (ms, the caller's clock: leases), tokens, lease member, lease expiry (ms), lease set TTL
# (ms), m, n, rate clock (µs; 0: Redis's own TIME, one clock for every host); then per cell: what it
# counts (0 requests, 1 tokens), interval (µs per unit, may be fractional), tolerance (µs: the
# burst); then per counter: limit, window end (ms); then per lease set: limit.
# A cell holds its theoretical arrival time (TAT, µs): admitted when max(TAT, now) + cost - now
# stays within the tolerance, which then becomes the TAT (GCRA). Nothing is written unless every
# cell, counter and lease set admits the request.
# Returns "admitted,ahead,...,count,...,live,...": 0/1; per cell how far its TAT was ahead of the
# clock before this request (µs, 0 when its bucket was full); each counter before this request;
# each set's live leases (one string: far cheaper for the client to read than an array).
QUOTA_RESERVE = Script(
    "quota_reserve",
    """
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local m = tonumber(ARGV[6])
local n = tonumber(ARGV[7])
local clock = tonumber(ARGV[8])
if clock == 0 then
  local time = redis.call('TIME')
  clock = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local admitted = 1
local result = {0}
local arrivals = {}
-- The cells share the tenant's hash tag, so one MGET reads them all.
local tats = {}
if m > 0 then tats = redis.call('MGET', unpack(KEYS, 1, m)) end
for i = 1, m do
  local at = 6 + 3 * i
  local amount = tokens
  if ARGV[at] == '0' then amount = 1 end
  local tat = tonumber(tats[i] or 0)
  if tat < clock then tat = clock end
  local arrival = tat + math.ceil(amount * tonumber(ARGV[at + 1]))
  arrivals[i] = arrival
  result[i + 1] = tat - clock  -- below 1e14: table.concat writes it exactly
  if arrival - clock > tonumber(ARGV[at + 2]) then admitted = 0 end
end
local counters_at = 8 + 3 * m
-- Add first and take back if anything is over: atomic all the same (nothing runs in between),
-- and half the calls of reading every counter before writing it.
for i = 1, n do
  local key = KEYS[m + i]
  local count = redis.call('INCRBY', key, tokens)
  if count == tokens then
    -- A new counter lives for the rest of its window, and a minute more (a late refund finds it).
    redis.call('PEXPIRE', key, tonumber(ARGV[counters_at + 2 * i]) - now + 60000)
  end
  result[m + i + 1] = count - tokens
  if count > tonumber(ARGV[counters_at + 2 * i - 1]) then admitted = 0 end
end
local leases_at = counters_at + 2 * n
for j = 1, #KEYS - m - n do
  local key = KEYS[m + n + j]
  local limit = tonumber(ARGV[leases_at + j])
  local live = redis.call('ZCARD', key)
  if live >= limit then
    -- Full: drop the leases of requests whose process died (expired) and count again.
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    live = redis.call('ZCARD', key)
  end
  result[m + n + j + 1] = live
  if live >= limit then admitted = 0 end
end
if admitted == 1 then
  for i = 1, m do
    -- The cell is worth keeping only while its bucket is not full again.
    local keep_ms = math.ceil((arrivals[i] - clock) / 1000) + 1000
    -- A number argument is written with %.17g: exact for these integers (below 2^53).
    redis.call('SET', KEYS[i], arrivals[i], 'PX', keep_ms)
  end
  for j = 1, #KEYS - m - n do
    redis.call('ZADD', KEYS[m + n + j], tonumber(ARGV[4]), ARGV[3])
    redis.call('PEXPIRE', KEYS[m + n + j], ARGV[5])
  end
else
  for i = 1, n do
    redis.call('DECRBY', KEYS[m + i], tokens)
  end
end
result[1] = admitted
return table.concat(result, ',')
""",
)

# Settles one request in one round trip. KEYS[1..r] token cells and counters to refund (a cell's
# TAT moves back by the tokens' time, a counter by the tokens), then lease sets, then the live usage
# hash, then c hashes of counters that delete themselves (the activity of the minute:
# embeddings.services.quotas.activity). ARGV: r, lease member, c, r refund amounts; then the usage
# hash's field/amount pair count and its pairs; then per counter hash its pair count, when it
# expires (epoch seconds) and its pairs.
QUOTA_SETTLE = Script(
    "quota_settle",
    _REFUND
    + """
local r = tonumber(ARGV[1])
local c = tonumber(ARGV[3])
for i = 1, r do
  refund(KEYS[i], ARGV[3 + i])
end
local usage_at = #KEYS - c
for j = r + 1, usage_at - 1 do
  redis.call('ZREM', KEYS[j], ARGV[2])
end
local at = 4 + r
for h = usage_at, #KEYS do
  local count = tonumber(ARGV[at])
  local expire_at = nil
  at = at + 1
  if h > usage_at then
    expire_at = ARGV[at]
    at = at + 1
  end
  for k = at, at + 2 * count - 1, 2 do
    redis.call('HINCRBY', KEYS[h], ARGV[k], ARGV[k + 1])
  end
  at = at + 2 * count
  if expire_at and count > 0 then
    redis.call('EXPIREAT', KEYS[h], expire_at)
  end
end
return 1
""",
)

# Refunds a finished job's unused tokens once. KEYS: the settled marker, then the token counters.
# ARGV: ttl, amount.
QUOTA_REFUND_ONCE = Script(
    "quota_refund_once",
    _REFUND
    + """
if not redis.call('SET', KEYS[1], 1, 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 2, #KEYS do
  refund(KEYS[i], ARGV[2])
end
return 1
""",
)

# --- Usage (embeddings.services.quotas.usage) -----------------------------------------------------------

# Counts one unit's increments (a job's chunk) once. KEYS: the owner's marker bitmap, the live hash.
# ARGV: the unit's bit, ttl seconds, then field/amount pairs. A bitmap: one bit per chunk (a
# million-input job's marker is 600 bytes) for as long as the increments may be offered again.
USAGE_COUNT_ONCE = Script(
    "usage_count_once",
    """
if redis.call('SETBIT', KEYS[1], ARGV[1], 1) == 1 then
    return 0
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
for k = 3, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[2], ARGV[k], ARGV[k + 1])
end
return 1
""",
)

# Forgets that units (a failed job's chunks, about to run again) were counted, so that each counts
# once more, once. KEYS: the owner's marker bitmap. ARGV: the units' bits.
USAGE_COUNT_FORGET = Script(
    "usage_count_forget",
    """
for i = 1, #ARGV do
    redis.call('SETBIT', KEYS[1], ARGV[i], 0)
end
return #ARGV
""",
)

# Renames the live hash to a batch and records the batch (atomic: a HINCRBY lands either in the
# batch or in a fresh live hash). KEYS: live hash, batch hash, batches set. ARGV: batch id.
USAGE_CLAIM = Script(
    "usage_claim",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
""",
)

# Everything not yet in the database, read at one instant: the live hash, then each unfinished
# batch's id and fields. KEYS: live hash, batches set. ARGV: the batch key prefix. (Batch keys are
# built in the script: fine on one Redis, not on a cluster.)
USAGE_SNAPSHOT = Script(
    "usage_snapshot",
    """
local out = {redis.call('HGETALL', KEYS[1])}
for _, batch_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    table.insert(out, batch_id)
    table.insert(out, redis.call('HGETALL', ARGV[1] .. batch_id))
end
return out
""",
)

# --- Jobs (embeddings.services.jobs.store, jobs) --------------------------------------------------

# KEYS: done set, result key, progress hash, uncounted usage hash, failed set, errors hash.
# ARGV: chunk number, payload, ttl seconds, rows, tokens, counter ("completed" or "failed"), the
# chunk's usage increments (orjson; empty: none), kept until the critical Redis has counted them,
# of its tokens those the embedding cache answered, and a failed chunk's error (empty: none).
# A failed chunk is recorded in the failed set, and its error beside it, by the same call that
# counts it, so what operators read of it is never out of step with the counts.
JOB_CHUNK_FINISH = Script(
    "job_chunk_finish",
    """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
    return 0
end
if ARGV[6] == 'completed' then
    redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
else
    redis.call('SADD', KEYS[5], ARGV[1])
    redis.call('EXPIRE', KEYS[5], ARGV[3])
    if ARGV[9] and ARGV[9] ~= '' then
        redis.call('HSET', KEYS[6], ARGV[1], ARGV[9])
        redis.call('EXPIRE', KEYS[6], ARGV[3])
    end
end
redis.call('HINCRBY', KEYS[3], ARGV[6], ARGV[4])
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[5])
if ARGV[8] and tonumber(ARGV[8]) > 0 then
    redis.call('HINCRBY', KEYS[3], 'cached_tokens', ARGV[8])
end
redis.call('HINCRBY', KEYS[3], 'chunks_done', 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
if ARGV[7] ~= '' then
    redis.call('HSET', KEYS[4], ARGV[1], ARGV[7])
    redis.call('EXPIRE', KEYS[4], ARGV[3])
end
return 1
""",
)

# --- Chunk leases (embeddings.services.jobs.leases): times in ms of the job store's clock ---------

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

# Takes the next chunk number from the job's counter, or once every chunk was handed out, the first
# chunk an operator re-opened (the requeue list: a failed job's failed chunks run again), and
# records it handed out. KEYS: next, sent, requeue. ARGV: ttl, chunks. Returns the number (>=
# chunks: none left).
_TAKE_NEXT_BODY = """
local function take_next(next_key, sent_key, requeue_key, ttl, chunks, now)
    local chunk = redis.call('INCR', next_key) - 1
    redis.call('EXPIRE', next_key, ttl)
    if chunk >= chunks then
        local requeued = redis.call('LPOP', requeue_key)
        if not requeued then return chunk end
        chunk = tonumber(requeued)
    end
    redis.call('HSET', sent_key, chunk, now)
    redis.call('EXPIRE', sent_key, ttl)
    return chunk
end
"""

JOB_CHUNK_TAKE_NEXT = Script(
    "job_chunk_take_next",
    (
        _NOW
        + _TAKE_NEXT_BODY
        + """
return take_next(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), now_ms())
"""
    ),
)

# One successor per finished chunk (a redelivered chunk hands out none).
# KEYS: handoff, next, sent, requeue. ARGV: chunk, ttl, chunks. Returns the successor, or -1.
JOB_CHUNK_HANDOFF = Script(
    "job_chunk_handoff",
    (
        _NOW
        + _TAKE_NEXT_BODY
        + """
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 0 then
    return -1
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return take_next(KEYS[2], KEYS[3], KEYS[4], ARGV[2], tonumber(ARGV[3]), now_ms())
"""
    ),
)

# Re-opens a failed job's failed chunks for a retry (embeddings.services.jobs.operator): each one
# still counted failed leaves the failed and done sets, its rows and its place leave the progress
# counters, its lease and handed-out time go, and it joins the requeue list with its successor
# hand-off undone (so it hands out one when it finishes: the job keeps its fair share); the job's
# cancel flag (a give-up sets it) goes; `next` moves past the last chunk, so only the requeue list
# hands out chunks; then the first `window` chunks are taken. One script: two retries at once
# re-open each chunk once. KEYS: done, failed, progress, handoff, requeue, cancel, next, sent, lease.
# ARGV: ttl, chunks, window, then chunk/rows pairs. Returns {re-opened chunks, chunks to send}.
JOB_CHUNKS_REOPEN = Script(
    "job_chunks_reopen",
    (
        _NOW
        + _TAKE_NEXT_BODY
        + """
local ttl, chunks, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local reopened = {}
for i = 4, #ARGV, 2 do
    local chunk = ARGV[i]
    if redis.call('SREM', KEYS[2], chunk) == 1 then
        redis.call('SREM', KEYS[1], chunk)
        redis.call('HINCRBY', KEYS[3], 'failed', -tonumber(ARGV[i + 1]))
        redis.call('HINCRBY', KEYS[3], 'chunks_done', -1)
        redis.call('HDEL', KEYS[4], chunk)
        redis.call('HDEL', KEYS[8], chunk)
        redis.call('HDEL', KEYS[9], chunk)
        redis.call('RPUSH', KEYS[5], chunk)
        table.insert(reopened, tonumber(chunk))
    end
end
if #reopened == 0 then return {{}, {}} end
redis.call('EXPIRE', KEYS[5], ttl)
redis.call('DEL', KEYS[6])
if tonumber(redis.call('GET', KEYS[7]) or 0) < chunks then
    redis.call('SET', KEYS[7], chunks, 'EX', ttl)
end
local now, sent = now_ms(), {}
for _ = 1, window do
    local chunk = take_next(KEYS[7], KEYS[8], KEYS[5], ttl, chunks, now)
    if chunk >= chunks then break end
    table.insert(sent, chunk)
end
return {reopened, sent}
"""
    ),
)

# Marks a chunk handed out again, due in ARGV[2] ms (a watchdog re-send, or a retry's countdown),
# and records why it is retried (ARGV[4]; empty: nothing to record). KEYS: sent, errors.
# ARGV: chunk, delay ms, ttl, error.
JOB_CHUNK_MARK_SENT = Script(
    "job_chunk_mark_sent",
    (
        _NOW
        + """
redis.call('HSET', KEYS[1], ARGV[1], now_ms() + tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[3])
if ARGV[4] and ARGV[4] ~= '' then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
    redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
"""
    ),
)

# A chunk starts: its lease, and a run counted unless it was finished before (a redelivery).
# KEYS: lease, runs, started, done. ARGV: chunk, lease ms, owner, ttl.
JOB_LEASE_TAKE = Script(
    "job_lease_take",
    (
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
    ),
)

# The heartbeat. KEYS: lease. ARGV: chunk, lease ms, owner.
JOB_LEASE_RENEW = Script(
    "job_lease_renew",
    (
        _NOW
        + """
redis.call('HSET', KEYS[1], ARGV[1], (now_ms() + tonumber(ARGV[2])) .. ' ' .. ARGV[3])
return 1
"""
    ),
)

# The chunk's run ended (finished, failed, or gave up for a retry). KEYS: lease, sent, done,
# handoff. ARGV: chunk. A finished chunk that handed out its successor is no longer in flight.
JOB_LEASE_RELEASE = Script(
    "job_lease_release",
    """
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 and redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
""",
)

# Live leases of a job (a cancelled job ends once none is left). KEYS: lease.
JOB_LIVE_LEASES = Script(
    "job_live_leases",
    (
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
    ),
)

# The watchdog's pass over one job (embeddings.services.jobs.leases explains it). KEYS: sent, lease,
# done, handoff, next, requeue. ARGV: stall ms, ttl, chunks. Returns {lost running, never started,
# successors handed out, chunks still in flight}; the first three are marked handed out now.
JOB_CHUNKS_SCAN = Script(
    "job_chunks_scan",
    (
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
                local successor = take_next(KEYS[5], KEYS[1], KEYS[6], ttl, chunks, now)
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
    ),
)

# Forgets a folded batch: its hash and its id, together. KEYS: batch hash, batches set. ARGV: id.
USAGE_FORGET = Script(
    "usage_forget",
    """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
""",
)
