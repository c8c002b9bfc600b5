"""Quotas and rate limits, enforced in Redis: one atomic Lua script checks and reserves every window.

A tenant's limits count all its keys together; a key's own (non-blank) limits count that key alone,
on top of its tenant's. Blank means no limit at that level. Windows are fixed and aligned to UTC:

    requests_per_minute, tokens_per_minute   the UTC minute
    tokens_per_day                           the UTC day
    tokens_per_month                         the UTC calendar month (the budget)
    max_concurrent_requests                  a lease set per level (sorted set scored by expiry)

`quota_reserve` runs RESERVE_SCRIPT once per request, after tokenisation and before inference: it
looks at every applicable counter and lease set, and only if *all* of them have room does the
request stay added (1 to the request counters, the tokens to the token counters, a lease to each
lease set); otherwise the script leaves everything as it was.
So the limits hold exactly under any concurrency, across processes and machines: there is no
read-then-write gap. `quota_release` (SETTLE_SCRIPT) frees the leases and, when inference failed,
gives the tokens back, adding the request's usage counters in the same round trip. A process
that dies mid-request leaks nothing for long: its leases expire after QUOTA_LEASE_SECONDS and
counters expire after their window.

Counters exist only for windows that have a limit (an unlimited tenant costs no Redis work for
quotas), so a limit set in the middle of a window starts counting from zero. The window is chosen
from the caller's clock (`now`, injectable for tests); all keys of one tenant share the hash tag
`{t<id>}`, so one script only touches one Redis Cluster slot.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from django.conf import settings
from redis.exceptions import NoScriptError, RedisError

from embeddings.callers import NO_LIMITS, Caller, QuotaLimitValues
from embeddings.services.errors import LimitExceeded, QuotaExceeded, QuotaUnavailable
from embeddings.services.redis_clients import (
    pack_arguments,
    pack_command,
    redis_async,
    redis_lean_async,
    redis_sync,
)
from embeddings.services.usage import LIVE_USAGE_KEY, Outcome, UsageEvent, usage_increments

logger = logging.getLogger(__name__)

# The wall clock that picks windows, when a caller passes no `now`; tests pin it to stay in one window.
clock = time.time

# Whose quotas apply: the caller, defined once in embeddings/callers.py (old names kept for callers).
QuotaSubject = QuotaHolder = Caller

Level = Literal["tenant", "key"]
Kind = Literal["requests", "tokens"]

# KEYS[1..n] window counters (the first r count requests, the others tokens), KEYS[n+1..] lease sets.
# ARGV: now (ms), tokens, lease member, lease expiry (ms), lease set TTL (ms), n, r; then per
# counter: limit, window end (ms); then per lease set: limit. Times are on the caller's clock.
# Returns "admitted,count,...,live,...": 0/1, each counter before this request, each set's live
# leases (one string: far cheaper for the client to read than an array).
RESERVE_SCRIPT = """
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local n = tonumber(ARGV[6])
local r = tonumber(ARGV[7])
local admitted = 1
local result = {0}
-- Add first and take back if anything is over: atomic all the same (nothing runs in between),
-- and half the calls of reading every counter before writing it.
for i = 1, n do
  local amount = tokens
  if i <= r then amount = 1 end
  local count = redis.call('INCRBY', KEYS[i], amount)
  if count == amount then
    -- A new counter lives for the rest of its window, and a minute more (a late refund finds it).
    redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[7 + 2 * i]) - now + 60000)
  end
  result[i + 1] = count - amount
  if count > tonumber(ARGV[6 + 2 * i]) then admitted = 0 end
end
for j = 1, #KEYS - n do
  local key = KEYS[n + j]
  local limit = tonumber(ARGV[7 + 2 * n + j])
  local live = redis.call('ZCARD', key)
  if live >= limit then
    -- Full: drop the leases of requests whose process died (expired) and count again.
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    live = redis.call('ZCARD', key)
  end
  result[n + j + 1] = live
  if live >= limit then admitted = 0 end
end
if admitted == 1 then
  for j = 1, #KEYS - n do
    redis.call('ZADD', KEYS[n + j], tonumber(ARGV[4]), ARGV[3])
    redis.call('PEXPIRE', KEYS[n + j], ARGV[5])
  end
else
  for i = 1, n do
    local amount = tokens
    if i <= r then amount = 1 end
    redis.call('DECRBY', KEYS[i], amount)
  end
end
result[1] = admitted
return table.concat(result, ',')
"""

# Settles one request in one round trip. KEYS[1..r] token counters to refund, KEYS[r+1..#KEYS-1]
# lease sets, KEYS[#KEYS] the live usage hash (embeddings.services.usage). ARGV: r, lease member,
# r refund amounts, then usage field/amount pairs. A counter whose key has expired meanwhile is not
# recreated (it would only hold a negative count).
SETTLE_SCRIPT = """
local r = tonumber(ARGV[1])
for i = 1, r do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('DECRBY', KEYS[i], ARGV[2 + i]) end
end
for j = r + 1, #KEYS - 1 do
  redis.call('ZREM', KEYS[j], ARGV[2])
end
local usage = KEYS[#KEYS]
for k = 3 + r, #ARGV, 2 do
  redis.call('HINCRBY', usage, ARGV[k], ARGV[k + 1])
end
return 1
"""


# --- Windows ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    limit_name: str  # the QuotaLimits field
    short: str  # in the Redis key
    kind: Kind
    label: str  # in messages, as OpenAI words them


WINDOWS = (
    Window("requests_per_minute", "rpm", "requests", "requests per minute (RPM)"),
    Window("tokens_per_minute", "tpm", "tokens", "tokens per minute (TPM)"),
    Window("tokens_per_day", "tpd", "tokens", "tokens per day"),
    Window("tokens_per_month", "tpmo", "tokens", "tokens per month"),
)
BUDGET_WINDOWS = frozenset({"tokens_per_day", "tokens_per_month"})


def window_bounds(limit_name: str, now: float) -> tuple[int, int]:
    """(start, reset) of the UTC window that holds `now`, in epoch seconds."""
    if limit_name in ("requests_per_minute", "tokens_per_minute"):
        start = int(now // 60 * 60)
        return start, start + 60
    if limit_name == "tokens_per_day":
        start = int(now // 86400 * 86400)
        return start, start + 86400
    moment = time.gmtime(now)
    return _month_bounds(moment.tm_year, moment.tm_mon)


@functools.lru_cache(maxsize=16)
def _month_bounds(year: int, month: int) -> tuple[int, int]:
    start = datetime(year, month, 1, tzinfo=UTC)
    following = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
    return int(start.timestamp()), int(following.timestamp())


def _scope(subject: QuotaSubject, level: Level) -> str:
    tag = f"quota:{{t{subject.tenant_id}}}"
    return f"{tag}:t" if level == "tenant" else f"{tag}:k{subject.key_id}"


def _levels(subject: QuotaSubject) -> list[tuple[Level, QuotaLimitValues]]:
    levels: list[tuple[Level, QuotaLimitValues]] = [("tenant", subject.tenant_limits)]
    if subject.key_id is not None:
        levels.append(("key", subject.key_limits))
    return levels


@dataclass(frozen=True)
class Counter:
    """One window counter of one level that this request is held to."""

    key: str
    level: Level
    window: Window
    limit: int
    amount: int
    reset_at: int  # epoch seconds


@dataclass(frozen=True)
class LeaseSet:
    key: str
    level: Level
    limit: int


@dataclass(frozen=True)
class QuotaPlan:
    """The counters (request counters first) and lease sets that hold one subject in one minute,
    and the constant part of the reserve script's arguments, packed once."""

    counters: tuple[Counter, ...]
    leases: tuple[LeaseSet, ...]
    requests_counters: int
    keys: tuple[str, ...]
    tail: tuple[int, ...]  # per counter: limit, window end (ms); per lease set: limit
    packed_keys: bytes
    packed_tail: bytes

    def counters_for(self, tokens: int) -> list[Counter]:
        return [
            c
            if c.window.kind == "requests"
            else Counter(c.key, c.level, c.window, c.limit, tokens, c.reset_at)
            for c in self.counters
        ]


_plans: dict[tuple, QuotaPlan] = {}
PLAN_CACHE_MAX_ENTRIES = 10_000


def quota_plan(subject: QuotaSubject, *, now: float) -> QuotaPlan:
    """What applies to `subject`'s requests at `now` (cached for the minute)."""
    cache_key = (subject.tenant_id, subject.key_id, subject.tenant_limits, subject.key_limits, int(now // 60))
    plan = _plans.get(cache_key)
    if plan is None:
        if len(_plans) >= PLAN_CACHE_MAX_ENTRIES:
            _plans.clear()
        plan = _plans[cache_key] = _make_plan(subject, now)
    return plan


def _make_plan(subject: QuotaSubject, now: float) -> QuotaPlan:
    counters: list[Counter] = []
    leases: list[LeaseSet] = []
    for level, limits in _levels(subject):
        scope = _scope(subject, level)
        for window in WINDOWS:
            limit = getattr(limits, window.limit_name)
            if limit is None:
                continue
            start, reset_at = window_bounds(window.limit_name, now)
            amount = 1 if window.kind == "requests" else 0
            counters.append(
                Counter(f"{scope}:{window.short}:{start}", level, window, limit, amount, reset_at)
            )
        if limits.max_concurrent_requests is not None:
            leases.append(LeaseSet(f"{scope}:concurrent", level, limits.max_concurrent_requests))
    counters.sort(key=lambda counter: counter.window.kind != "requests")  # stable: requests first
    keys = tuple([c.key for c in counters] + [lease.key for lease in leases])
    tail: list[int] = []
    for counter in counters:
        tail += [counter.limit, counter.reset_at * 1000]
    tail += [lease.limit for lease in leases]
    return QuotaPlan(
        counters=tuple(counters),
        leases=tuple(leases),
        requests_counters=sum(c.window.kind == "requests" for c in counters),
        keys=keys,
        tail=tuple(tail),
        packed_keys=pack_arguments(keys),
        packed_tail=pack_arguments(tail),
    )


# --- Headers and refusals --------------------------------------------------------------------------


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it (Go's format): "20ms", "1s", "6m0s"."""
    milliseconds = max(0, math.ceil(seconds * 1000))
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(counters: Sequence[Counter], counts: Sequence[int], now: float) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the binding window of each kind.

    `counts` are the counters' values (after this request when it was admitted). The binding window
    is the one with the least remaining (then the latest reset). A kind without any limit has no
    headers.
    """
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        candidates = [
            (counter, count)
            for counter, count in zip(counters, counts, strict=True)
            if counter.window.kind == kind
        ]
        if not candidates:
            continue
        counter, count = min(candidates, key=lambda pair: (pair[0].limit - pair[1], -pair[0].reset_at))
        headers[f"x-ratelimit-limit-{kind}"] = str(counter.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, counter.limit - count))
        headers[f"x-ratelimit-reset-{kind}"] = duration_text(counter.reset_at - now)
    return headers


def _refusal(
    subject: QuotaSubject,
    counters: Sequence[Counter],
    leases: Sequence[LeaseSet],
    counts: Sequence[int],
    live: Sequence[int],
    now: float,
) -> QuotaExceeded:
    """The error for a refused request: the most lasting reason (a budget over a minute window)."""
    headers = ratelimit_headers(counters, counts, now)
    over = [
        (counter, count)
        for counter, count in zip(counters, counts, strict=True)
        if count + counter.amount > counter.limit
    ]
    if over:
        counter, count = max(over, key=lambda pair: pair[0].reset_at)
        wait = duration_text(counter.reset_at - now)
        retry_after_s = max(math.ceil(c.reset_at - now) for c, _ in over)
        who = "this API key" if counter.level == "key" else "this tenant"
        if counter.window.limit_name in BUDGET_WINDOWS:
            message = (
                f"You exceeded {who}'s quota of {counter.window.label}: limit {counter.limit}, "
                f"used {count}, requested {counter.amount}. It resets in {wait}."
            )
            return QuotaExceeded(
                message,
                reason="insufficient_quota",
                kind="tokens",
                retry_after_s=retry_after_s,
                headers=headers,
            )
        if counter.amount > counter.limit:
            message = (
                f"Request too large for {who}'s {counter.window.label}: limit {counter.limit}, "
                f"requested {counter.amount}. Send fewer tokens in one request."
            )
        else:
            message = (
                f"Rate limit reached for {who}'s {counter.window.label}: limit {counter.limit}, used "
                f"{count}, requested {counter.amount}. Please try again in {wait}."
            )
        return QuotaExceeded(
            message,
            reason="rate_limit_exceeded",
            kind=counter.window.kind,
            retry_after_s=retry_after_s,
            headers=headers,
        )
    full = next(lease for lease, count in zip(leases, live, strict=True) if count >= lease.limit)
    who = "this API key" if full.level == "key" else "this tenant"
    message = (
        f"Too many concurrent requests for {who}: limit {full.limit}. Retry when one of them has finished."
    )
    return QuotaExceeded(
        message, reason="rate_limit_exceeded", kind="requests", retry_after_s=1, headers=headers
    )


# --- Reserve and release ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds: its tokens in the token counters, and its leases."""

    counters: tuple[Counter, ...]
    leases: tuple[LeaseSet, ...]
    lease_member: str
    headers: dict[str, str]

    def settle_arguments(self, *, refund: bool) -> tuple[list[str], list]:
        refunds = [c for c in self.counters if refund and c.window.kind == "tokens" and c.amount]
        keys = [c.key for c in refunds] + [lease.key for lease in self.leases]
        return keys, [len(refunds), self.lease_member, *(c.amount for c in refunds)]

    @property
    def holds_anything(self) -> bool:
        return bool(self.counters or self.leases)


def _reserve_head(plan: QuotaPlan, tokens: int, member: str, now: float) -> list:
    lease_ms = int(settings.QUOTA_LEASE_SECONDS * 1000)
    now_ms = int(now * 1000)
    return [
        now_ms,
        tokens,
        member,
        now_ms + lease_ms,
        lease_ms + 1000,
        len(plan.counters),
        plan.requests_counters,
    ]


def _scripts(client) -> tuple:
    """The client's registered scripts (EVALSHA, reloaded by redis-py after a Redis restart)."""
    scripts = getattr(client, "_embedsite_quota_scripts", None)
    if scripts is None:
        scripts = (client.register_script(RESERVE_SCRIPT), client.register_script(SETTLE_SCRIPT))
        client._embedsite_quota_scripts = scripts
    return scripts


def _check_inputs(subject: QuotaSubject, inputs: int) -> None:
    for level, limits in _levels(subject):
        if limits.max_inputs_per_request is not None and inputs > limits.max_inputs_per_request:
            who = "this API key" if level == "key" else "this tenant"
            raise LimitExceeded(
                f"{inputs} inputs in one request; {who} may send at most {limits.max_inputs_per_request}",
                param="input",
            )


def _admitted(
    subject: QuotaSubject, plan: QuotaPlan, tokens: int, member: str, result: bytes | str, now: float
) -> Reservation:
    values = [int(value) for value in (result.decode() if isinstance(result, bytes) else result).split(",")]
    counters = plan.counters_for(tokens)
    counts = values[1 : 1 + len(counters)]
    live = values[1 + len(counters) :]
    if not values[0]:
        raise _refusal(subject, counters, plan.leases, counts, live, now)
    after = [count + counter.amount for count, counter in zip(counts, counters, strict=True)]
    return Reservation(tuple(counters), plan.leases, member, ratelimit_headers(counters, after, now))


async def _evalsha_packed(script, packed_arguments: bytes, count: int):
    """EVALSHA `script` with `count` arguments (numkeys included) packed beforehand, on the lean
    client (or a redis-py connection where REDIS_URL is not plain TCP); loads the script when Redis
    does not know it (first use, or after a restart)."""
    command = b"*%d\r\n" % (count + 2) + pack_arguments([b"EVALSHA", script.sha]) + packed_arguments
    lean = redis_lean_async()
    for attempt in range(2):
        try:
            if lean is not None:
                return await lean.call(command)
            return await _call_with_redis_py(command)
        except NoScriptError:
            if attempt:
                raise
        if lean is not None:
            await lean.call(pack_command(b"SCRIPT", b"LOAD", script.script))
        else:
            await redis_async().script_load(script.script)
    raise AssertionError("unreachable")


async def _call_with_redis_py(command: bytes):
    pool = redis_async().connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_packed_command(command)
        return await connection.read_response()
    except NoScriptError:
        raise
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


async def quota_reserve(
    *, subject: QuotaSubject, inputs: int, tokens: int, now: float | None = None
) -> Reservation:
    """Admit one request of `inputs` inputs and `tokens` tokens, or refuse it with nothing reserved.

    Raises LimitExceeded (too many inputs for the tenant or key), QuotaExceeded, or
    redis.exceptions.RedisError (the caller applies QUOTA_REDIS_FAILURE).
    """
    _check_inputs(subject, inputs)
    now = clock() if now is None else now
    plan = quota_plan(subject, now=now)
    member = os.urandom(8).hex()
    if not plan.keys:
        return Reservation((), (), member, {})
    head = _reserve_head(plan, tokens, member, now)
    packed = pack_arguments([len(plan.keys)]) + plan.packed_keys + pack_arguments(head) + plan.packed_tail
    reserve, _ = _scripts(redis_async())
    result = await _evalsha_packed(reserve, packed, 1 + len(plan.keys) + len(head) + len(plan.tail))
    return _admitted(subject, plan, tokens, member, result, now)


def quota_reserve_sync(
    *, subject: QuotaSubject, inputs: int, tokens: int, now: float | None = None
) -> Reservation:
    """The blocking twin of `quota_reserve` (Celery workers)."""
    _check_inputs(subject, inputs)
    now = clock() if now is None else now
    plan = quota_plan(subject, now=now)
    member = os.urandom(8).hex()
    if not plan.keys:
        return Reservation((), (), member, {})
    reserve, _ = _scripts(redis_sync())
    result = reserve(keys=list(plan.keys), args=[*_reserve_head(plan, tokens, member, now), *plan.tail])
    return _admitted(subject, plan, tokens, member, result, now)


def _settle_arguments(
    reservation: Reservation | None, refund: bool, usage: UsageEvent | None
) -> tuple[list[str], list]:
    if reservation is not None:
        keys, args = reservation.settle_arguments(refund=refund)
    else:
        keys, args = [], [0, ""]
    if usage is not None:
        for field, amount in usage_increments(usage).items():
            args += [field, amount]
    return [*keys, LIVE_USAGE_KEY], args


async def quota_release(
    *, reservation: Reservation | None, refund: bool, usage: UsageEvent | None = None
) -> None:
    """Free the reservation's leases; with `refund`, give its tokens back (inference failed); count
    `usage` (its usage_increments) in the same round trip."""
    keys, args = _settle_arguments(reservation, refund, usage)
    if len(keys) > 1 or usage is not None:
        _, settle = _scripts(redis_async())
        await _evalsha_packed(settle, pack_arguments([len(keys), *keys, *args]), 1 + len(keys) + len(args))


def quota_release_sync(
    *, reservation: Reservation | None, refund: bool, usage: UsageEvent | None = None
) -> None:
    keys, args = _settle_arguments(reservation, refund, usage)
    if len(keys) > 1 or usage is not None:
        _, settle = _scripts(redis_sync())
        settle(keys=keys, args=args)


# --- One API request's bookkeeping ----------------------------------------------------------------


class RequestQuota:
    """One API request's quota and usage: `reserve` after tokenisation, `settle` after inference.

    Handed to `embeddings_create`, which calls both; the view renders `headers` on its response.
    Usage is recorded for admitted (succeeded or failed) and refused requests; tokens and inputs
    are counted only for succeeded ones (what the tenant is billed for).
    """

    def __init__(self, *, subject: QuotaSubject, model: str, endpoint: str, started: float) -> None:
        self.subject = subject
        self.model = model
        self.endpoint = endpoint
        self.started = started  # time.perf_counter() when the request arrived
        self.reservation: Reservation | None = None
        # None until reserve() ran: the view then asks quota_headers() instead.
        self.headers: dict[str, str] | None = None
        self.inputs = 0
        self.tokens = 0

    async def reserve(self, *, inputs: int, tokens: int) -> None:
        self.inputs, self.tokens = inputs, tokens
        if not settings.QUOTAS_ENABLED:
            return
        try:
            self.reservation = await quota_reserve(subject=self.subject, inputs=inputs, tokens=tokens)
        except (LimitExceeded, QuotaExceeded) as refusal:
            self.headers = getattr(refusal, "headers", None)
            await self._record("rejected")
            raise
        except RedisError as error:
            if settings.QUOTA_REDIS_FAILURE == "open":
                _log_redis_failure("serving without quotas", error)
                self.headers = {}  # no second wait on Redis for the headers
                return
            raise QuotaUnavailable(
                "Rate limiting is unavailable (its Redis does not answer), so the request was not served; "
                "retry shortly."
            ) from error
        self.headers = self.reservation.headers

    async def settle(self, *, succeeded: bool) -> None:
        """Release (and on failure refund) the reservation and record usage, in one round trip;
        never raises."""
        try:
            await quota_release(
                reservation=self.reservation,
                refund=not succeeded,
                usage=self._usage("succeeded" if succeeded else "failed"),
            )
        except RedisError as error:
            # Leases expire after QUOTA_LEASE_SECONDS; a lost refund stays counted.
            _log_redis_failure("could not settle a request's quota and usage", error)
            return
        if not succeeded and self.reservation is not None and self.reservation.counters:
            self.headers = None  # the refund changed them: the view reads them afresh

    async def _record(self, outcome: Outcome) -> None:
        try:
            await quota_release(reservation=None, refund=False, usage=self._usage(outcome))
        except RedisError as error:
            _log_redis_failure("could not record usage", error)

    def _usage(self, outcome: Outcome) -> UsageEvent:
        succeeded = outcome == "succeeded"
        return UsageEvent(
            tenant_id=self.subject.tenant_id,
            api_key_id=self.subject.key_id,
            model=self.model,
            endpoint=self.endpoint,
            outcome=outcome,
            inputs=self.inputs if succeeded else 0,
            tokens=self.tokens if succeeded else 0,
            latency_ms=round((time.perf_counter() - self.started) * 1000),
        )


_last_failure_log = 0.0


def _log_redis_failure(what: str, error: Exception) -> None:
    """At most one line every 10 s per process: a Redis outage must not flood the log."""
    global _last_failure_log
    now = time.monotonic()
    if now - _last_failure_log >= 10:
        _last_failure_log = now
        logger.warning("quotas: %s (Redis: %s)", what, error)


# --- Current state -------------------------------------------------------------------------------


def _status_reads(subject: QuotaSubject, now: float) -> list[tuple[Level, str, str, int, int]]:
    """(level, limit name, key, limit, reset_at) of each window counter that has a limit."""
    return [
        (c.level, c.window.limit_name, c.key, c.limit, c.reset_at)
        for c in quota_plan(subject, now=now).counters
    ]


def _status_queue(pipeline, subject: QuotaSubject, now: float) -> None:
    for _, _, key, _, _ in _status_reads(subject, now):
        pipeline.get(key)
    for level, limits in _levels(subject):
        if limits.max_concurrent_requests is not None:
            pipeline.zcount(f"{_scope(subject, level)}:concurrent", f"({int(now * 1000)}", "+inf")


def _status_from(subject: QuotaSubject, values: Sequence, now: float) -> dict:
    """{"enabled", "tenant": {...}, "key": {...} or None}; each window {limit, used, remaining,
    resets_at, reset_in_s} (all None but the limit's absence when it has no limit)."""
    values = list(values)
    reads = _status_reads(subject, now)
    counts = {(level, name): int(value or 0) for (level, name, *_), value in zip(reads, values, strict=False)}
    resets = {(level, name): reset_at for level, name, _, _, reset_at in reads}
    in_use = iter(values[len(reads) :])
    status: dict = {"enabled": settings.QUOTAS_ENABLED, "tenant": None, "key": None}
    for level, limits in _levels(subject):
        entry: dict = {}
        for window in WINDOWS:
            limit = getattr(limits, window.limit_name)
            if limit is None:
                entry[window.limit_name] = {
                    "limit": None, "used": None, "remaining": None, "resets_at": None, "reset_in_s": None
                }  # fmt: skip
                continue
            used = counts[(level, window.limit_name)]
            reset_at = resets[(level, window.limit_name)]
            entry[window.limit_name] = {
                "limit": limit,
                "used": used,
                "remaining": max(0, limit - used),
                "resets_at": datetime.fromtimestamp(reset_at, UTC).isoformat().replace("+00:00", "Z"),
                "reset_in_s": round(reset_at - now, 3),
            }
        concurrent = limits.max_concurrent_requests
        entry["concurrent_requests"] = {
            "limit": concurrent,
            "in_use": int(next(in_use)) if concurrent is not None else None,
        }
        for name in ("max_inputs_per_request", "max_concurrent_jobs", "max_inputs_per_job"):
            entry[name] = getattr(limits, name)
        status[level] = entry
    return status


async def quota_status(principal: QuotaSubject, *, now: float | None = None) -> dict:
    """The principal's limits and where it stands in each window (tenant and key levels).

    Raises redis.exceptions.RedisError when Redis does not answer.
    """
    now = clock() if now is None else now
    pipeline = redis_async().pipeline(transaction=False)
    _status_queue(pipeline, principal, now)
    values = await pipeline.execute() if len(pipeline) else []
    return _status_from(principal, values, now)


def quota_status_sync(tenant_id: int, key_id: int | None = None, *, now: float | None = None) -> dict:
    """`quota_status` for a tenant (and one of its keys) read from the database: admin, commands."""
    from embeddings.models import ApiKey, Tenant

    tenant = Tenant.objects.get(pk=tenant_id)
    key_limits = NO_LIMITS
    if key_id is not None:
        key_limits = QuotaLimitValues.of(ApiKey.objects.get(pk=key_id, tenant_id=tenant_id))
    subject = QuotaHolder(tenant.pk, key_id, QuotaLimitValues.of(tenant), key_limits)
    now = clock() if now is None else now
    pipeline = redis_sync().pipeline(transaction=False)
    _status_queue(pipeline, subject, now)
    values = pipeline.execute() if len(pipeline) else []
    return _status_from(subject, values, now)


async def quota_headers(subject: QuotaSubject, *, now: float | None = None) -> dict[str, str]:
    """The x-ratelimit-* headers of a response that reserved nothing (e.g. GET /v1/models, a 422):
    the current state, read without reserving. Empty when no limit applies or Redis fails."""
    if not settings.QUOTAS_ENABLED:
        return {}
    now = clock() if now is None else now
    counters = quota_plan(subject, now=now).counters
    if not counters:
        return {}
    try:
        counts = await redis_async().mget([c.key for c in counters])
    except RedisError as error:
        _log_redis_failure("could not read the rate-limit state for headers", error)
        return {}
    return ratelimit_headers(counters, [int(value or 0) for value in counts], now)
