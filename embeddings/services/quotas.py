"""Quotas and rate limits, enforced in Redis: one atomic Lua script checks and reserves every window.

A tenant's limits count all its keys together; a key's own (non-blank) limits count that key alone,
on top of its tenant's. Blank means no limit at that level. Windows are fixed and aligned to UTC:

    requests_per_minute, tokens_per_minute   the UTC minute
    tokens_per_day                           the UTC day
    tokens_per_month                         the UTC calendar month (the budget)
    max_concurrent_requests                  a lease set per level (sorted set scored by expiry)

`quota_reserve` runs the reserve script once per request, after tokenisation and before inference: it
looks at every applicable counter and lease set, and only if *all* of them have room does the
request stay added (1 to the request counters, the tokens to the token counters, a lease to each
lease set); otherwise the script leaves everything as it was.
So the limits hold exactly under any concurrency, across processes and machines: there is no
read-then-write gap. `quota_release` (the settle script) frees the leases and, when inference failed,
gives the tokens back, adding the request's usage counters in the same round trip. A process
that dies mid-request leaks nothing for long: its leases expire after QUOTA_LEASE_SECONDS and
counters expire after their window.

Counters exist only for windows that have a limit (an unlimited tenant costs no Redis work for
quotas), so a limit set in the middle of a window starts counting from zero. The window is chosen
from the caller's clock (`now`, injectable for tests); all keys of one tenant share the hash tag
`{t<id>}`, so one script only touches one Redis Cluster slot.

This module is the policy: windows, plans, refusal messages and headers. The scripts, keys and
transports are embeddings.redis's; each operation here is one generator (`reserve_operation`,
`settle_operation`, `status_operation`) run by the asyncio transport for requests and by the
blocking one for Celery workers and the admin.
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
from redis.exceptions import RedisError

from embeddings.callers import NO_LIMITS, Caller, QuotaLimitValues
from embeddings.redis import keys as redis_keys
from embeddings.redis import operations
from embeddings.redis.connections import redis_sync
from embeddings.redis.transport import Operation, PackedRun, run_async, run_sync
from embeddings.services.errors import LimitExceeded, QuotaExceeded, QuotaUnavailable
from embeddings.services.usage import Outcome, UsageEvent, usage_increments

logger = logging.getLogger(__name__)

# The wall clock that picks windows, when a caller passes no `now`; tests pin it to stay in one window.
clock = time.time

# Whose quotas apply: the caller, defined once in embeddings/callers.py (old names kept for callers).
QuotaSubject = QuotaHolder = Caller

Level = redis_keys.Level
Kind = Literal["requests", "tokens"]


# --- Windows ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    limit_name: str  # the QuotaLimits field
    short: str  # in the Redis key (embeddings.redis.keys.quota_counter)
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
    return redis_keys.quota_scope(tenant_id=subject.tenant_id, key_id=subject.key_id, level=level)


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
    keys: PackedRun  # the counters' keys, then the lease sets'
    tail: PackedRun  # per counter: limit, window end (ms); per lease set: limit

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
            key = redis_keys.quota_counter(scope, window=window.short, start=start)
            counters.append(Counter(key, level, window, limit, amount, reset_at))
        if limits.max_concurrent_requests is not None:
            leases.append(LeaseSet(redis_keys.quota_leases(scope), level, limits.max_concurrent_requests))
    counters.sort(key=lambda counter: counter.window.kind != "requests")  # stable: requests first
    keys = [c.key for c in counters] + [lease.key for lease in leases]
    tail: list[int] = []
    for counter in counters:
        tail += [counter.limit, counter.reset_at * 1000]
    tail += [lease.limit for lease in leases]
    return QuotaPlan(
        counters=tuple(counters),
        leases=tuple(leases),
        requests_counters=sum(c.window.kind == "requests" for c in counters),
        keys=PackedRun.of(keys),
        tail=PackedRun.of(tail),
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

    def refunds(self) -> list[tuple[str, int]]:
        """(counter, tokens) to give back when the request failed: its tokens, not its request."""
        return [(c.key, c.amount) for c in self.counters if c.window.kind == "tokens" and c.amount]

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


def _check_inputs(subject: QuotaSubject, inputs: int) -> None:
    for level, limits in _levels(subject):
        if limits.max_inputs_per_request is not None and inputs > limits.max_inputs_per_request:
            who = "this API key" if level == "key" else "this tenant"
            raise LimitExceeded(
                f"{inputs} inputs in one request; {who} may send at most {limits.max_inputs_per_request}",
                param="input",
            )


def reserve_operation(
    subject: QuotaSubject, inputs: int, tokens: int, now: float | None
) -> Operation[Reservation]:
    """`quota_reserve` as an operation, for either transport (embeddings.redis.transport)."""
    _check_inputs(subject, inputs)
    now = clock() if now is None else now
    plan = quota_plan(subject, now=now)
    member = os.urandom(8).hex()
    if not plan.keys:
        return Reservation((), (), member, {})
    head = _reserve_head(plan, tokens, member, now)
    values = yield from operations.quota_reserve(plan_keys=plan.keys, head=head, tail=plan.tail)
    counters = plan.counters_for(tokens)
    counts = values[1 : 1 + len(counters)]
    live = values[1 + len(counters) :]
    if not values[0]:
        raise _refusal(subject, counters, plan.leases, counts, live, now)
    after = [count + counter.amount for count, counter in zip(counts, counters, strict=True)]
    return Reservation(tuple(counters), plan.leases, member, ratelimit_headers(counters, after, now))


async def quota_reserve(
    *, subject: QuotaSubject, inputs: int, tokens: int, now: float | None = None
) -> Reservation:
    """Admit one request of `inputs` inputs and `tokens` tokens, or refuse it with nothing reserved.

    Raises LimitExceeded (too many inputs for the tenant or key), QuotaExceeded, or
    redis.exceptions.RedisError (the caller applies QUOTA_REDIS_FAILURE).
    """
    return await run_async(reserve_operation(subject, inputs, tokens, now))


def quota_reserve_sync(
    *, subject: QuotaSubject, inputs: int, tokens: int, now: float | None = None
) -> Reservation:
    """`quota_reserve` on the blocking transport (Celery workers, job submissions)."""
    return run_sync(reserve_operation(subject, inputs, tokens, now), redis_sync())


def settle_operation(
    reservation: Reservation | None, refund: bool, usage: UsageEvent | None
) -> Operation[None]:
    """`quota_release` as an operation, for either transport."""
    refunds = reservation.refunds() if reservation is not None and refund else []
    lease_sets = [lease.key for lease in reservation.leases] if reservation is not None else []
    if refunds or lease_sets or usage is not None:
        yield from operations.quota_settle(
            refunds=refunds,
            lease_sets=lease_sets,
            lease_member=reservation.lease_member if reservation is not None else "",
            usage=usage_increments(usage) if usage is not None else None,
        )


async def quota_release(
    *, reservation: Reservation | None, refund: bool, usage: UsageEvent | None = None
) -> None:
    """Free the reservation's leases; with `refund`, give its tokens back (inference failed); count
    `usage` (its usage_increments) in the same round trip."""
    await run_async(settle_operation(reservation, refund, usage))


def quota_release_sync(
    *, reservation: Reservation | None, refund: bool, usage: UsageEvent | None = None
) -> None:
    """`quota_release` on the blocking transport."""
    run_sync(settle_operation(reservation, refund, usage), redis_sync())


def quota_refund_once(*, job_id: str, counters: list[str], tokens: int, ttl_s: int) -> bool:
    """Give `tokens` back to each of a job's reserved counters, once however often this runs (a
    marker beside the counters); True if refunded now."""
    return run_sync(
        operations.quota_refund_once(job_id=job_id, counters=counters, amount=tokens, ttl_s=ttl_s),
        redis_sync(),
    )


def quota_refund_forget(*, job_id: str) -> None:
    """Drop the job's refund marker (the job's data is deleted)."""
    run_sync(operations.quota_forget_settled(job_id), redis_sync())


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


def status_operation(subject: QuotaSubject, now: float) -> Operation[dict]:
    """`quota_status` as an operation, for either transport."""
    plan = quota_plan(subject, now=now)
    counters = [c.key for c in plan.counters]
    lease_sets = [lease.key for lease in plan.leases]
    values = yield from operations.quota_state(counters, lease_sets, now_ms=int(now * 1000))
    return _status_from(subject, plan, values, now)


def _status_from(subject: QuotaSubject, plan: QuotaPlan, values: Sequence[int], now: float) -> dict:
    """{"enabled", "tenant": {...}, "key": {...} or None}; each window {limit, used, remaining,
    resets_at, reset_in_s} (all None but the limit's absence when it has no limit)."""
    counts = {(c.level, c.window.limit_name): value for c, value in zip(plan.counters, values, strict=False)}
    resets = {(c.level, c.window.limit_name): c.reset_at for c in plan.counters}
    in_use = iter(values[len(plan.counters) :])
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
    return await run_async(status_operation(principal, clock() if now is None else now))


def quota_status_sync(tenant_id: int, key_id: int | None = None, *, now: float | None = None) -> dict:
    """`quota_status` for a tenant (and one of its keys) read from the database: admin, commands."""
    from embeddings.models import ApiKey, Tenant

    tenant = Tenant.objects.get(pk=tenant_id)
    key_limits = NO_LIMITS
    if key_id is not None:
        key_limits = QuotaLimitValues.of(ApiKey.objects.get(pk=key_id, tenant_id=tenant_id))
    subject = QuotaHolder(tenant.pk, key_id, QuotaLimitValues.of(tenant), key_limits)
    return run_sync(status_operation(subject, clock() if now is None else now), redis_sync())


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
        counts = await run_async(operations.quota_counts([c.key for c in counters]))
    except RedisError as error:
        _log_redis_failure("could not read the rate-limit state for headers", error)
        return {}
    return ratelimit_headers(counters, counts, now)
