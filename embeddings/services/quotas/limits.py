"""Quotas and rate limits, enforced in Redis: one atomic Lua script checks and reserves them all.

A tenant's limits count all its keys together; a key's own (non-blank) limits count that key alone,
on top of its tenant's. Blank means no limit at that level.

    requests_per_second, requests_per_minute  request rates  (GCRA cells; burst: request_burst)
    tokens_per_minute                         a token rate   (a GCRA cell; burst: token_burst)
    tokens_per_day                            the UTC day            (a budget window counter)
    tokens_per_month                          the UTC calendar month (the budget)
    max_concurrent_requests                   a lease set per level (sorted set scored by expiry)

A rate is a generic cell rate (GCRA: a token bucket that stores only its "theoretical arrival
time", TAT): a sustained rate of one unit every `interval`, and a burst of B units at once. A
request costing c units (1 request, or its tokens) is admitted when max(TAT, now) + c·interval
lies within B·interval of now, and that becomes the new TAT. So B requests pass at once, then one
every interval, smoothly: no window boundary lets twice the rate through, and a request larger
than the burst can never pass (it is refused as too large). A blank burst is a second of a request
rate (RATE_LIMIT_REQUEST_BURST_SECONDS) and a minute of a token rate
(RATE_LIMIT_TOKEN_BURST_SECONDS); rates run on Redis's clock, the same for every host.

`quota_reserve` runs the reserve script once per request, after tokenisation and before inference: it
looks at every applicable cell, budget counter and lease set, and only if *all* of them have room does
the request stay added (the cells' new TATs, the tokens to the budget counters, a lease to each
lease set); otherwise the script leaves everything as it was.
So the limits hold exactly under any concurrency, across processes and machines: there is no
read-then-write gap. `quota_release` (the settle script) frees the leases and, when inference failed,
gives the tokens back (to the token cell and the budgets), adding the request's usage counters and
its minute's activity counters (activity.py) in the same round trip. A process that dies
mid-request leaks nothing for long: its leases expire after QUOTA_LEASE_SECONDS, cells once their
bucket is full again and counters after their window.

Keys exist only for limits that are set (an unlimited tenant costs no Redis work for quotas), so a
budget set in the middle of a window starts counting from zero. Budget windows are chosen from the
caller's clock (`now`, injectable for tests; a test that passes `now` runs the rates on it too); all
keys of one tenant share the hash tag `{t<id>}`, so one script only touches one Redis Cluster slot.

This module is the policy: rates, windows, plans, refusal messages and headers. The scripts, keys and
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
from embeddings.errors.service import LimitExceeded, QuotaExceeded, QuotaUnavailable
from embeddings.redis import keys as redis_keys
from embeddings.redis import operations
from embeddings.redis.connections import redis_sync
from embeddings.redis.operations import CounterHash
from embeddings.redis.transport import Operation, PackedRun, operation_run, operation_run_sync
from embeddings.services.quotas.activity import activity_counters
from embeddings.services.quotas.usage import Outcome, UsageEvent, usage_increments

logger = logging.getLogger(__name__)

# The wall clock that picks windows, when a caller passes no `now`; tests pin it to stay in one window.
clock = time.time
# Rates run on Redis's clock, the same for every host; a test that pins `clock` may turn this off to
# run them on its pinned clock too.
rates_on_redis_clock = True

# Whose quotas apply: the caller, defined once in embeddings/callers.py (old names kept for callers).

Level = redis_keys.Level
Kind = Literal["requests", "tokens"]


# --- Rates and budget windows ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    limit_name: str  # the QuotaLimits field of the sustained rate
    short: str  # in the Redis key (embeddings.redis.keys.quota_rate)
    kind: Kind
    period_s: int  # the rate is limit_name's value per period_s seconds
    burst_name: str  # the QuotaLimits field of its burst
    label: str  # in messages, as OpenAI words them


RATES = (
    Rate("requests_per_second", "rps", "requests", 1, "request_burst", "requests per second (RPS)"),
    Rate("requests_per_minute", "rpm", "requests", 60, "request_burst", "requests per minute (RPM)"),
    Rate("tokens_per_minute", "tpm", "tokens", 60, "token_burst", "tokens per minute (TPM)"),
)


@dataclass(frozen=True)
class Window:
    limit_name: str  # the QuotaLimits field
    short: str  # in the Redis key (embeddings.redis.keys.quota_counter)
    kind: Kind
    label: str  # in messages


# Budgets stay calendar windows: a tenant buys tokens per day or month, not a rate.
WINDOWS = (
    Window("tokens_per_day", "tpd", "tokens", "tokens per day"),
    Window("tokens_per_month", "tpmo", "tokens", "tokens per month"),
)


def window_bounds(limit_name: str, now: float) -> tuple[int, int]:
    """(start, reset) of the UTC window that holds `now`, in epoch seconds."""
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


def _scope(caller: Caller, level: Level) -> str:
    return redis_keys.quota_scope(tenant_id=caller.tenant_id, key_id=caller.key_id, level=level)


def _levels(caller: Caller) -> list[tuple[Level, QuotaLimitValues]]:
    levels: list[tuple[Level, QuotaLimitValues]] = [("tenant", caller.tenant_limits)]
    if caller.key_id is not None:
        levels.append(("key", caller.key_limits))
    return levels


def _who(level: Level) -> str:
    return "this API key" if level == "key" else "this tenant"


@dataclass(frozen=True)
class Cell:
    """One rate of one level that this request is held to (GCRA), its times in microseconds."""

    key: str
    level: Level
    rate: Rate
    limit: int  # the configured rate: units per rate.period_s
    burst: int  # units admitted at once
    interval_us: float  # between two units at the sustained rate
    tolerance_us: int  # how far ahead of now the TAT may run: the burst

    @classmethod
    def of(cls, key: str, level: Level, rate: Rate, limit: int, burst: int | None) -> Cell:
        if burst is None:
            seconds = (
                settings.RATE_LIMIT_REQUEST_BURST_SECONDS
                if rate.kind == "requests"
                else settings.RATE_LIMIT_TOKEN_BURST_SECONDS
            )
            burst = max(1, math.ceil(round(limit * seconds / rate.period_s, 6)))
        if limit <= 0:  # a zero rate (only from old data or the shell) admits nothing
            return cls(key, level, rate, 0, burst, float(UNREACHABLE_US), 0)
        interval = rate.period_s * 1_000_000 / limit
        if rate.kind == "requests":
            # A whole number of microseconds, so that exactly `burst` requests fit.
            interval = float(math.ceil(interval))
        return cls(key, level, rate, limit, burst, interval, math.ceil(burst * interval))

    def cost_us(self, amount: int) -> int:
        """What `amount` units move the TAT; the script computes the same (IEEE doubles both)."""
        return math.ceil(amount * self.interval_us)

    def available(self, ahead_us: float) -> int:
        """Units admissible at once while the TAT is `ahead_us` ahead of now."""
        if self.limit <= 0:
            return 0
        return max(0, min(self.burst, math.floor((self.tolerance_us - ahead_us) / self.interval_us)))


UNREACHABLE_US = 10**15  # ~31 years: a cost no tolerance admits


@dataclass(frozen=True)
class Counter:
    """One budget window counter of one level that this request is held to."""

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
    """The rate cells, budget counters and lease sets that hold one caller in one minute, and the
    constant part of the reserve script's arguments, packed once."""

    cells: tuple[Cell, ...]
    counters: tuple[Counter, ...]
    leases: tuple[LeaseSet, ...]
    keys: PackedRun  # the cells' keys, the counters', then the lease sets'
    tail: (
        PackedRun  # per cell: kind, interval, tolerance; per counter: limit, window end (ms); per set: limit
    )

    def counters_for(self, tokens: int) -> list[Counter]:
        return [Counter(c.key, c.level, c.window, c.limit, tokens, c.reset_at) for c in self.counters]


_plans: dict[tuple, QuotaPlan] = {}
PLAN_CACHE_MAX_ENTRIES = 10_000


def quota_plan(caller: Caller, *, now: float) -> QuotaPlan:
    """What applies to `caller`'s requests at `now` (cached for the minute)."""
    cache_key = (caller.tenant_id, caller.key_id, caller.tenant_limits, caller.key_limits, int(now // 60))
    plan = _plans.get(cache_key)
    if plan is None:
        if len(_plans) >= PLAN_CACHE_MAX_ENTRIES:
            _plans.clear()
        plan = _plans[cache_key] = _make_plan(caller, now)
    return plan


def _make_plan(caller: Caller, now: float) -> QuotaPlan:
    cells: list[Cell] = []
    counters: list[Counter] = []
    leases: list[LeaseSet] = []
    for level, limits in _levels(caller):
        scope = _scope(caller, level)
        for rate in RATES:
            limit = getattr(limits, rate.limit_name)
            if limit is not None:
                key = redis_keys.quota_rate(scope, rate=rate.short)
                cells.append(Cell.of(key, level, rate, limit, getattr(limits, rate.burst_name)))
        for window in WINDOWS:
            limit = getattr(limits, window.limit_name)
            if limit is not None:
                start, reset_at = window_bounds(window.limit_name, now)
                key = redis_keys.quota_counter(scope, window=window.short, start=start)
                counters.append(Counter(key, level, window, limit, 0, reset_at))
        if limits.max_concurrent_requests is not None:
            leases.append(LeaseSet(redis_keys.quota_leases(scope), level, limits.max_concurrent_requests))
    keys = [c.key for c in cells] + [c.key for c in counters] + [lease.key for lease in leases]
    tail: list = []
    for cell in cells:
        tail += [0 if cell.rate.kind == "requests" else 1, repr(cell.interval_us), cell.tolerance_us]
    for counter in counters:
        tail += [counter.limit, counter.reset_at * 1000]
    tail += [lease.limit for lease in leases]
    return QuotaPlan(
        cells=tuple(cells),
        counters=tuple(counters),
        leases=tuple(leases),
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


@dataclass(frozen=True)
class Standing:
    """Where one limit stands for the headers: what may pass at once, what may pass now, and in
    how many seconds it is back to `limit`."""

    kind: Kind
    limit: int
    remaining: int
    reset_s: float


def standings(
    cells: Sequence[Cell],
    aheads_us: Sequence[float],
    counters: Sequence[Counter],
    counts: Sequence[int],
    now: float,
) -> list[Standing]:
    """Each cell's (its burst, what it admits now, when it is full) and each budget counter's."""
    result = [
        Standing(cell.rate.kind, cell.burst, cell.available(ahead), max(0.0, ahead) / 1e6)
        for cell, ahead in zip(cells, aheads_us, strict=True)
    ]
    result += [
        Standing(counter.window.kind, counter.limit, max(0, counter.limit - count), counter.reset_at - now)
        for counter, count in zip(counters, counts, strict=True)
    ]
    return result


def ratelimit_headers(items: Sequence[Standing]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the binding limit of each kind.

    For a rate, `limit` is its burst (what may pass at once), `remaining` what may pass now and
    `reset` the time until its bucket is full again; for a budget, the window's limit, what is left
    and the time to the window's end. The binding limit is the one with the least remaining (then
    the latest reset). A kind without any limit has no headers.
    """
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        candidates = [item for item in items if item.kind == kind]
        if not candidates:
            continue
        binding = min(candidates, key=lambda item: (item.remaining, -item.reset_s))
        headers[f"x-ratelimit-limit-{kind}"] = str(binding.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(binding.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = duration_text(binding.reset_s)
    return headers


def _refusal(
    plan: QuotaPlan,
    tokens: int,
    aheads_us: Sequence[float],
    counts: Sequence[int],
    live: Sequence[int],
    now: float,
) -> QuotaExceeded:
    """The error for a refused request: the most lasting reason (a budget, then a rate, then
    concurrency), and the time until every limit that refused it would admit it."""
    counters = plan.counters_for(tokens)
    headers = ratelimit_headers(standings(plan.cells, aheads_us, counters, counts, now))
    over_budget = [
        (counter, count)
        for counter, count in zip(counters, counts, strict=True)
        if count + tokens > counter.limit
    ]
    over_rate = []  # (cell, seconds until it admits this request)
    for cell, ahead in zip(plan.cells, aheads_us, strict=True):
        amount = 1 if cell.rate.kind == "requests" else tokens
        excess_us = ahead + cell.cost_us(amount) - cell.tolerance_us
        if excess_us > 0:
            over_rate.append((cell, excess_us / 1e6))
    full = [lease for lease, count in zip(plan.leases, live, strict=True) if count >= lease.limit]
    waits = [counter.reset_at - now for counter, _ in over_budget] + [wait for _, wait in over_rate]
    wait_s = max(waits, default=1.0)
    headers |= {"retry-after-ms": str(max(1, math.ceil(wait_s * 1000)))}
    retry_after_s = max(1, math.ceil(wait_s))
    if over_budget:
        counter, count = max(over_budget, key=lambda pair: pair[0].reset_at)
        message = (
            f"You exceeded {_who(counter.level)}'s quota of {counter.window.label}: limit {counter.limit}, "
            f"used {count}, requested {tokens}. It resets in {duration_text(counter.reset_at - now)}."
        )
        return QuotaExceeded(
            message,
            reason="insufficient_quota",
            kind="tokens",
            retry_after_s=retry_after_s,
            headers=headers,
            limit=counter.window.limit_name,
            level=counter.level,
        )
    if over_rate:
        too_large = [
            c for c, _ in over_rate if c.rate.kind == "tokens" and c.cost_us(tokens) > c.tolerance_us
        ]
        if too_large:
            cell = too_large[0]
            message = (
                f"Request too large for {_who(cell.level)}'s {cell.rate.label}: {cell.limit} with a burst of "
                f"{cell.burst} tokens, requested {tokens}. Send fewer tokens in one request."
            )
        else:
            cell = max(over_rate, key=lambda pair: pair[1])[0]
            unit = cell.rate.kind
            requested = "" if unit == "requests" else f", requested {tokens} tokens"
            message = (
                f"Rate limit reached for {_who(cell.level)}'s {cell.rate.label}: {cell.limit} with a burst "
                f"of {cell.burst} {unit}{requested}. Please try again in {duration_text(wait_s)}."
            )
        return QuotaExceeded(
            message,
            reason="rate_limit_exceeded",
            kind=cell.rate.kind,
            retry_after_s=retry_after_s,
            headers=headers,
            limit=cell.rate.limit_name,
            level=cell.level,
        )
    lease = full[0]
    message = (
        f"Too many concurrent requests for {_who(lease.level)}: limit {lease.limit}. "
        "Retry when one of them has finished."
    )
    return QuotaExceeded(
        message,
        reason="rate_limit_exceeded",
        kind="requests",
        retry_after_s=retry_after_s,
        headers=headers,
        limit="max_concurrent_requests",
        level=lease.level,
    )


# --- Reserve and release ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds: its costs in the rate cells, its tokens in the budget
    counters, and its leases."""

    cells: tuple[Cell, ...]
    counters: tuple[Counter, ...]
    leases: tuple[LeaseSet, ...]
    lease_member: str
    headers: dict[str, str]
    tokens: int = 0

    def refunds(self, tokens: int | None = None) -> list[tuple[str, int]]:
        """(key, amount) to give back when the request failed: its tokens (to the token cells, as
        time, and to the budgets), not its request; with `tokens`, only that many of them (those
        the embedding cache answered, where EMBEDDING_CACHE_COUNT_HITS is off)."""
        tokens = self.tokens if tokens is None else min(tokens, self.tokens)
        if not tokens:
            return []
        refunds = [(c.key, c.cost_us(tokens)) for c in self.cells if c.rate.kind == "tokens"]
        return refunds + [(c.key, tokens) for c in self.counters]

    @property
    def holds_anything(self) -> bool:
        return bool(self.cells or self.counters or self.leases)


def _reserve_head(plan: QuotaPlan, tokens: int, member: str, now: float, rate_clock_us: int) -> list:
    lease_ms = int(settings.QUOTA_LEASE_SECONDS * 1000)
    now_ms = int(now * 1000)
    return [
        now_ms,
        tokens,
        member,
        now_ms + lease_ms,
        lease_ms + 1000,
        len(plan.cells),
        len(plan.counters),
        rate_clock_us,
    ]


def _rate_clock_us(now: float | None) -> int:
    """The rates' clock for the scripts: 0 for Redis's own, else `now` (or the pinned clock) in µs."""
    if now is None and rates_on_redis_clock:
        return 0
    return round((clock() if now is None else now) * 1_000_000)


def _check_inputs(caller: Caller, inputs: int) -> None:
    for level, limits in _levels(caller):
        if limits.max_inputs_per_request is not None and inputs > limits.max_inputs_per_request:
            raise LimitExceeded(
                f"{inputs} inputs in one request; "
                f"{_who(level)} may send at most {limits.max_inputs_per_request}",
                param="input",
            )


def reserve_operation(caller: Caller, inputs: int, tokens: int, now: float | None) -> Operation[Reservation]:
    """`quota_reserve` as an operation, for either transport (embeddings.redis.transport)."""
    _check_inputs(caller, inputs)
    rate_clock_us = _rate_clock_us(now)
    now = clock() if now is None else now
    plan = quota_plan(caller, now=now)
    member = os.urandom(8).hex()
    if not plan.keys:
        return Reservation((), (), (), member, {}, tokens)
    head = _reserve_head(plan, tokens, member, now, rate_clock_us)
    values = yield from operations.quota_reserve(plan_keys=plan.keys, head=head, tail=plan.tail)
    cells_end = 1 + len(plan.cells)
    aheads = values[1:cells_end]
    counts = values[cells_end : cells_end + len(plan.counters)]
    live = values[cells_end + len(plan.counters) :]
    if not values[0]:
        raise _refusal(plan, tokens, aheads, counts, live, now)
    counters = plan.counters_for(tokens)
    after_aheads = [
        ahead + cell.cost_us(1 if cell.rate.kind == "requests" else tokens)
        for cell, ahead in zip(plan.cells, aheads, strict=True)
    ]
    after_counts = [count + tokens for count in counts]
    headers = ratelimit_headers(standings(plan.cells, after_aheads, counters, after_counts, now))
    return Reservation(plan.cells, tuple(counters), plan.leases, member, headers, tokens)


async def quota_reserve(*, caller: Caller, inputs: int, tokens: int, now: float | None = None) -> Reservation:
    """Admit one request of `inputs` inputs and `tokens` tokens, or refuse it with nothing reserved.

    Raises LimitExceeded (too many inputs for the tenant or key), QuotaExceeded, or
    redis.exceptions.RedisError (the caller applies QUOTA_REDIS_FAILURE).
    """
    return await operation_run(reserve_operation(caller, inputs, tokens, now))


def quota_reserve_sync(*, caller: Caller, inputs: int, tokens: int, now: float | None = None) -> Reservation:
    """`quota_reserve` on the blocking transport (Celery workers, job submissions)."""
    return operation_run_sync(reserve_operation(caller, inputs, tokens, now), redis_sync())


def settle_operation(
    reservation: Reservation | None,
    refund: bool,
    usage: UsageEvent | None,
    refund_tokens: int | None = None,
    activity: Sequence[CounterHash] = (),
) -> Operation[None]:
    """`quota_release` as an operation, for either transport."""
    refunds = reservation.refunds(refund_tokens) if reservation is not None and refund else []
    lease_sets = [lease.key for lease in reservation.leases] if reservation is not None else []
    if refunds or lease_sets or usage is not None or activity:
        yield from operations.quota_settle(
            refunds=refunds,
            lease_sets=lease_sets,
            lease_member=reservation.lease_member if reservation is not None else "",
            usage=usage_increments(usage) if usage is not None else None,
            counters=activity,
        )


async def quota_release(
    *,
    reservation: Reservation | None,
    refund: bool,
    usage: UsageEvent | None = None,
    refund_tokens: int | None = None,
    activity: Sequence[CounterHash] = (),
) -> None:
    """Free the reservation's leases; with `refund`, give its tokens back (inference failed), or
    only `refund_tokens` of them; count `usage` (its usage_increments) and add the request to its
    minute's `activity` (activity.activity_counters) in the same round trip."""
    await operation_run(settle_operation(reservation, refund, usage, refund_tokens, activity))


def quota_release_sync(
    *,
    reservation: Reservation | None,
    refund: bool,
    usage: UsageEvent | None = None,
    activity: Sequence[CounterHash] = (),
) -> None:
    """`quota_release` on the blocking transport."""
    operation_run_sync(settle_operation(reservation, refund, usage, None, activity), redis_sync())


def quota_refund_once(*, job_id: str, counters: list[str], tokens: int, ttl_s: int) -> bool:
    """Give `tokens` back to each of a job's reserved counters, once however often this runs (a
    marker beside the counters); True if refunded now."""
    return operation_run_sync(
        operations.quota_refund_once(job_id=job_id, counters=counters, amount=tokens, ttl_s=ttl_s),
        redis_sync(),
    )


def quota_refund_forget(*, job_id: str) -> None:
    """Drop the job's refund marker (the job's data is deleted)."""
    operation_run_sync(operations.quota_forget_settled(job_id), redis_sync())


def quota_job_markers_extend(*, job_id: str, ttl_s: int, retry_rounds: int = 0) -> None:
    """Keep the job's once-markers (its usage counted, its reservation and its `retry_rounds`
    rounds' settled) at least `ttl_s` more: as long as the job's data they guard, whose expiry an
    operator moved later."""
    operation_run_sync(operations.job_markers_extend(job_id, ttl_s, retry_rounds=retry_rounds), redis_sync())


# --- One API request's bookkeeping ----------------------------------------------------------------


class RequestQuota:
    """One API request's quota and usage: `reserve` after tokenisation, `settle` after inference.

    Handed to `embeddings_create`, which calls both; the view renders `headers` on its response.
    Usage is recorded for admitted (succeeded or failed) and refused requests; tokens and inputs
    are counted only for succeeded ones (what the tenant is billed for).
    """

    def __init__(
        self,
        *,
        caller: Caller,
        model: str,
        endpoint: str,
        started: float,
        model_version: str = "",
        model_dtype: str = "",
    ) -> None:
        self.caller = caller
        self.model = model
        # The variant serving the model (the catalog's ModelVariant), which its usage records.
        self.model_version = model_version
        self.model_dtype = model_dtype
        self.endpoint = endpoint
        self.started = started  # time.perf_counter() when the request arrived
        self.reservation: Reservation | None = None
        # None until reserve() ran: the view then asks quota_headers() instead.
        self.headers: dict[str, str] | None = None
        self.inputs = 0
        self.tokens = 0
        self.cached_inputs = 0
        self.cached_tokens = 0

    async def reserve(self, *, inputs: int, tokens: int) -> None:
        self.inputs, self.tokens = inputs, tokens
        if not settings.QUOTAS_ENABLED:
            return
        try:
            self.reservation = await quota_reserve(caller=self.caller, inputs=inputs, tokens=tokens)
        except (LimitExceeded, QuotaExceeded) as refusal:
            self.headers = getattr(refusal, "headers", None)
            await self._record("rejected", refusal if isinstance(refusal, QuotaExceeded) else None)
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

    async def settle(self, *, succeeded: bool, cached_inputs: int = 0, cached_tokens: int = 0) -> None:
        """Release (and on failure refund) the reservation and record usage, in one round trip;
        never raises. `cached_inputs` and `cached_tokens` (of a success) were answered from the
        embedding cache: usage records them apart, and with EMBEDDING_CACHE_COUNT_HITS off their
        tokens are given back to the limits."""
        self.cached_inputs, self.cached_tokens = cached_inputs, cached_tokens
        # A failure gives every token back; a success the cache's, where hits are not counted.
        hits_refunded = succeeded and cached_tokens > 0 and not settings.EMBEDDING_CACHE_COUNT_HITS
        refund = not succeeded or hits_refunded
        usage = self._usage("succeeded" if succeeded else "failed")
        try:
            await quota_release(
                reservation=self.reservation,
                refund=refund,
                usage=usage,
                refund_tokens=cached_tokens if hits_refunded else None,
                activity=activity_counters(usage),
            )
        except RedisError as error:
            # Leases expire after QUOTA_LEASE_SECONDS; a lost refund stays counted.
            _log_redis_failure("could not settle a request's quota and usage", error)
            return
        if refund and self.reservation is not None and self.reservation.refunds():
            self.headers = None  # the refund changed them: the view reads them afresh

    async def _record(self, outcome: Outcome, refusal: QuotaExceeded | None = None) -> None:
        usage = self._usage(outcome)
        try:
            await quota_release(
                reservation=None, refund=False, usage=usage, activity=activity_counters(usage, refusal)
            )
        except RedisError as error:
            _log_redis_failure("could not record usage", error)

    def _usage(self, outcome: Outcome) -> UsageEvent:
        succeeded = outcome == "succeeded"
        return UsageEvent(
            tenant_id=self.caller.tenant_id,
            api_key_id=self.caller.key_id,
            model=self.model,
            model_version=self.model_version,
            model_dtype=self.model_dtype,
            endpoint=self.endpoint,
            outcome=outcome,
            inputs=self.inputs if succeeded else 0,
            tokens=self.tokens if succeeded else 0,
            cached_inputs=self.cached_inputs if succeeded else 0,
            cached_tokens=self.cached_tokens if succeeded else 0,
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


def status_operation(caller: Caller, now: float | None) -> Operation[dict]:
    """`quota_status` as an operation, for either transport (rates on Redis's clock unless `now`
    is pinned, as for reserving)."""
    rate_clock_us, now = _rate_clock_us(now), clock() if now is None else now
    plan = quota_plan(caller, now=now)
    state = yield from _state_operation(plan, now)
    return _status_from(caller, plan, _aheads(state, rate_clock_us), state, now)


def _state_operation(plan: QuotaPlan, now: float) -> Operation[operations.QuotaState]:
    return (
        yield from operations.quota_state(
            [c.key for c in plan.cells],
            [c.key for c in plan.counters],
            [lease.key for lease in plan.leases],
            now_ms=int(now * 1000),
        )
    )


def _aheads(state: operations.QuotaState, rate_clock_us: int) -> list[float]:
    """How far each cell's TAT runs ahead of the rate clock (µs; 0 when its bucket is full):
    Redis's (`rate_clock_us` 0) or a pinned one."""
    rate_clock_us = rate_clock_us or state.clock_us
    return [max(0, arrival - rate_clock_us) for arrival in state.arrivals_us]


def _status_from(
    caller: Caller, plan: QuotaPlan, aheads: list[float], state: operations.QuotaState, now: float
) -> dict:
    """{"enabled", "tenant": {...}, "key": {...} or None}. Each rate {limit, burst, used, remaining,
    resets_at, reset_in_s}: `remaining` may pass at once now, `used` is burst - remaining and it
    is full again at `resets_at`. Each budget window {limit, used, remaining, resets_at,
    reset_in_s}. A limit that is not set is all None."""
    entries: dict[tuple[Level, str], dict] = {}
    for cell, ahead in zip(plan.cells, aheads, strict=True):
        remaining = cell.available(ahead)
        entries[(cell.level, cell.rate.limit_name)] = {
            "limit": cell.limit,
            "burst": cell.burst,
            "used": cell.burst - remaining,
            "remaining": remaining,
            **_reset(now + ahead / 1e6, now),
        }
    for counter, used in zip(plan.counters, state.counts, strict=True):
        entries[(counter.level, counter.window.limit_name)] = {
            "limit": counter.limit,
            "used": used,
            "remaining": max(0, counter.limit - used),
            **_reset(counter.reset_at, now),
        }
    live = iter(state.live)
    status: dict = {"enabled": settings.QUOTAS_ENABLED, "tenant": None, "key": None}
    for level, limits in _levels(caller):
        entry: dict = {}
        for rate in RATES:
            entry[rate.limit_name] = entries.get(
                (level, rate.limit_name),
                {
                    "limit": None,
                    "burst": None,
                    "used": None,
                    "remaining": None,
                    "resets_at": None,
                    "reset_in_s": None,
                },
            )
        for window in WINDOWS:
            entry[window.limit_name] = entries.get(
                (level, window.limit_name),
                {"limit": None, "used": None, "remaining": None, "resets_at": None, "reset_in_s": None},
            )
        concurrent = limits.max_concurrent_requests
        entry["concurrent_requests"] = {
            "limit": concurrent,
            "in_use": int(next(live)) if concurrent is not None else None,
        }
        for name in ("max_inputs_per_request", "max_concurrent_jobs", "max_inputs_per_job"):
            entry[name] = getattr(limits, name)
        status[level] = entry
    return status


def _reset(at: float, now: float) -> dict:
    return {
        "resets_at": datetime.fromtimestamp(at, UTC)
        .isoformat(timespec="seconds" if at == int(at) else "milliseconds")
        .replace("+00:00", "Z"),
        "reset_in_s": round(at - now, 3),
    }


async def quota_status(caller: Caller, *, now: float | None = None) -> dict:
    """The caller's limits and where it stands in each window (tenant and key levels).

    Raises redis.exceptions.RedisError when Redis does not answer.
    """
    return await operation_run(status_operation(caller, now))


def quota_status_sync(tenant_id: int, key_id: int | None = None, *, now: float | None = None) -> dict:
    """`quota_status` for a tenant (and one of its keys) read from the database: admin, commands."""
    from embeddings.models import ApiKey, Tenant

    tenant = Tenant.objects.get(pk=tenant_id)
    key_limits = NO_LIMITS
    if key_id is not None:
        key_limits = QuotaLimitValues.of(ApiKey.objects.get(pk=key_id, tenant_id=tenant_id))
    caller = Caller(tenant.pk, key_id, QuotaLimitValues.of(tenant), key_limits)
    return operation_run_sync(status_operation(caller, now), redis_sync())


async def answer_ratelimit_headers(caller: Caller, quota: RequestQuota | None) -> dict[str, str]:
    """The x-ratelimit-* headers of an authenticated request's answer: the state its quota script
    returned, or (nothing reserved: /v1/models, a 422) a read of it."""
    if quota is not None and quota.headers is not None:
        return quota.headers
    return await quota_headers(caller)


async def quota_headers(caller: Caller, *, now: float | None = None) -> dict[str, str]:
    """The x-ratelimit-* headers of a response that reserved nothing (e.g. GET /v1/models, a 422):
    the current state, read without reserving. Empty when no limit applies or Redis fails."""
    if not settings.QUOTAS_ENABLED:
        return {}
    rate_clock_us, now = _rate_clock_us(now), clock() if now is None else now
    plan = quota_plan(caller, now=now)
    if not plan.cells and not plan.counters:
        return {}
    try:
        state = await operation_run(_state_operation(plan, now))
    except RedisError as error:
        _log_redis_failure("could not read the rate-limit state for headers", error)
        return {}
    aheads = _aheads(state, rate_clock_us)
    return ratelimit_headers(standings(plan.cells, aheads, plan.counters, state.counts, now))
