"""Quotas against the real test Redis: exact under concurrency, windows, refunds, budgets, leases."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest
import redis

from embeddings.callers import Caller
from embeddings.errors.service import LimitExceeded, QuotaExceeded, QuotaUnavailable
from embeddings.redis.connections import redis_sync, reset_redis_clients
from embeddings.services.quotas.limits import (
    QuotaLimitValues,
    RequestQuota,
    duration_text,
    quota_release,
    quota_release_sync,
    quota_reserve,
    quota_reserve_sync,
    quota_status,
    quota_status_sync,
)
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, parse_usage_field
from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port

# 2026-03-10 12:00:30 UTC: 30 s into a minute.
NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC).timestamp()


@pytest.fixture(autouse=True)
def patient_redis_client(settings):
    """These tests count what hundreds of concurrent scripts admit, not how fast Redis answers: a
    machine starved by a neighbour must not fail them on REDIS_TIMEOUT_S (1 s; the tests of the
    timeout itself set their own)."""
    settings.REDIS_TIMEOUT_S = 30


def caller_with(tenant: dict | None = None, key: dict | None = None, *, tenant_id=1, key_id=10) -> Caller:
    return Caller(tenant_id, key_id, QuotaLimitValues(**(tenant or {})), QuotaLimitValues(**(key or {})))


async def outcome(caller, tokens: int, now: float = NOW):
    try:
        return await quota_reserve(caller=caller, inputs=1, tokens=tokens, now=now)
    except QuotaExceeded as refusal:
        return refusal


def tat_ahead_us(key: str, now: float = NOW) -> int:
    """How far a rate cell's theoretical arrival time runs ahead of `now` (µs)."""
    return int(redis_sync().get(key)) - round(now * 1_000_000)


async def test_a_request_rate_admits_exactly_its_burst_at_once_then_its_rate(service_redis):
    caller = caller_with({"requests_per_second": 10, "request_burst": 50})
    results = await asyncio.gather(*(outcome(caller, 1) for _ in range(200)))
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(results) - len(refused) == 50
    # The next request fits one interval (100 ms) after the burst's; the bucket is full in 5 s.
    assert {(r.reason, r.kind, r.retry_after_s) for r in refused} == {("rate_limit_exceeded", "requests", 1)}
    assert refused[0].headers["retry-after-ms"] == "100"
    assert refused[0].headers["x-ratelimit-limit-requests"] == "50"
    assert refused[0].headers["x-ratelimit-remaining-requests"] == "0"
    assert refused[0].headers["x-ratelimit-reset-requests"] == "5s"
    assert "10 with a burst of 50 requests. Please try again in 100ms" in refused[0].message
    # Then exactly the rate: one more at +100 ms, none at +150 ms, ten more a second later.
    assert isinstance(await outcome(caller, 1, NOW + 0.099), QuotaExceeded)
    assert not isinstance(await outcome(caller, 1, NOW + 0.1), QuotaExceeded)
    assert isinstance(await outcome(caller, 1, NOW + 0.15), QuotaExceeded)
    later = await asyncio.gather(*(outcome(caller, 1, NOW + 1.1) for _ in range(30)))
    assert sum(not isinstance(r, QuotaExceeded) for r in later) == 10


async def test_a_minute_boundary_lets_no_second_burst_through(service_redis):
    # Fixed windows admitted 60 in the last second of a minute and 60 more in the first of the
    # next; a rate of 60 a minute with a burst of 60 admits one a second after its burst.
    before_boundary = NOW + 29.5  # 12:00:59.5
    caller = caller_with({"requests_per_minute": 60, "request_burst": 60})
    first = await asyncio.gather(*(outcome(caller, 1, before_boundary) for _ in range(80)))
    second = await asyncio.gather(*(outcome(caller, 1, before_boundary + 1) for _ in range(80)))
    assert sum(not isinstance(r, QuotaExceeded) for r in first) == 60
    assert sum(not isinstance(r, QuotaExceeded) for r in second) == 1


async def test_a_blank_burst_is_a_second_of_the_request_rate_and_a_minute_of_the_token_rate(service_redis):
    admitted = await outcome(caller_with({"requests_per_minute": 6000, "tokens_per_minute": 150_000}), 100)
    assert admitted.headers["x-ratelimit-limit-requests"] == "100"
    assert admitted.headers["x-ratelimit-remaining-requests"] == "99"
    assert admitted.headers["x-ratelimit-reset-requests"] == "10ms"
    assert admitted.headers["x-ratelimit-limit-tokens"] == "150000"
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "149900"
    assert admitted.headers["x-ratelimit-reset-tokens"] == "40ms"  # 100 tokens at 2,500 a second
    # A small rate still admits one request at once.
    assert not isinstance(
        await outcome(caller_with({"requests_per_minute": 3}, tenant_id=2), 1), QuotaExceeded
    )


async def test_a_token_rate_never_overshoots_its_burst_and_refuses_only_what_would(service_redis):
    caller = caller_with({"tokens_per_minute": 60_000, "token_burst": 1000})  # 1 ms a token
    sizes = [(i * 37) % 120 + 1 for i in range(100)]
    results = await asyncio.gather(*(outcome(caller, size) for size in sizes))
    accepted = sum(size for size, r in zip(sizes, results, strict=True) if not isinstance(r, QuotaExceeded))
    assert accepted <= 1000
    refused = [size for size, r in zip(sizes, results, strict=True) if isinstance(r, QuotaExceeded)]
    assert refused, "the sizes add up to far more than the burst"
    # The bucket only drains meanwhile (the clock is pinned): a refused request would still overshoot.
    assert all(accepted + size > 1000 for size in refused)
    assert tat_ahead_us("quota:{t1}:t:rate:tpm") == accepted * 1000


async def test_a_large_token_request_waits_for_enough_bucket(service_redis):
    caller = caller_with({"tokens_per_minute": 6000, "token_burst": 1000})  # 100 tokens a second
    assert not isinstance(await outcome(caller, 1000), QuotaExceeded)
    refusal = await outcome(caller, 500)
    assert refusal.kind == "tokens" and refusal.headers["retry-after-ms"] == "5000"
    assert refusal.retry_after_s == 5
    assert "requested 500 tokens. Please try again in 5s" in refusal.message
    # Many small requests meanwhile cannot starve it of more than they take, nor push it past the burst.
    assert isinstance(await outcome(caller, 500, NOW + 4.99), QuotaExceeded)
    admitted = await outcome(caller, 500, NOW + 5)
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "0"
    assert admitted.headers["x-ratelimit-reset-tokens"] == "10s"


async def test_budget_exhaustion_is_insufficient_quota_and_never_partial(service_redis):
    caller = caller_with({"tokens_per_month": 500, "tokens_per_day": 10_000})
    await outcome(caller, 450)
    refusal = await outcome(caller, 51)
    assert isinstance(refusal, QuotaExceeded)
    assert (refusal.reason, refusal.kind) == ("insufficient_quota", "tokens")
    month_end = datetime(2026, 4, 1, tzinfo=UTC).timestamp()
    assert refusal.retry_after_s == month_end - NOW
    assert "tokens per month" in refusal.message
    # Nothing of the refused request was counted: exactly what is left still fits.
    await outcome(caller, 50)
    assert isinstance(await outcome(caller, 1), QuotaExceeded)
    assert not isinstance(await outcome(caller, 1, month_end), QuotaExceeded)


async def test_the_readme_worked_example(service_redis):
    """README "Quotas and rate limits": the numbers of its worked example."""
    caller = caller_with(
        {
            "requests_per_second": 80,
            "request_burst": 50,
            "tokens_per_minute": 150_000,
            "tokens_per_month": 10**8,
        }
    )
    at_once = await asyncio.gather(*(outcome(caller, 1) for _ in range(70)))
    refused = [r for r in at_once if isinstance(r, QuotaExceeded)]
    assert len(refused) == 20
    assert (refused[0].retry_after_s, refused[0].headers["retry-after-ms"]) == (1, "13")
    assert refused[0].headers["x-ratelimit-remaining-requests"] == "0"
    assert refused[0].headers["x-ratelimit-reset-requests"] == "625ms"
    # A client that keeps sending (every 6.25 ms here) gets 80 in the next second, one every 12.5 ms.
    keeps_sending = [await outcome(caller, 1, NOW + k / 160 + 2e-6) for k in range(1, 161)]
    admitted = [k for k, r in enumerate(keeps_sending, start=1) if not isinstance(r, QuotaExceeded)]
    assert admitted == list(range(2, 161, 2))
    later = NOW + 10  # both buckets full again
    assert not isinstance(await outcome(caller, 140_000, later), QuotaExceeded)
    waits = await outcome(caller, 20_000, later)
    assert waits.kind == "tokens" and waits.headers["retry-after-ms"] == "4000"
    assert "Request too large" in (await outcome(caller, 160_000, later + 3600)).message


async def test_a_request_larger_than_the_token_burst_says_so(service_redis):
    refusal = await outcome(caller_with({"tokens_per_minute": 100}), 101)
    assert refusal.reason == "rate_limit_exceeded" and refusal.kind == "tokens"
    assert (
        "Request too large for this tenant's tokens per minute (TPM): 100 with a burst of 100"
        in refusal.message
    )
    # Even an empty bucket never admits it; one as large as the burst passes.
    assert isinstance(await outcome(caller_with({"tokens_per_minute": 100}), 101, NOW + 3600), QuotaExceeded)
    assert not isinstance(
        await outcome(caller_with({"tokens_per_minute": 100}), 100, NOW + 3600), QuotaExceeded
    )


async def test_refund_gives_tokens_back_but_the_request_still_counts(service_redis):
    caller = caller_with(
        {"requests_per_second": 1, "request_burst": 10, "tokens_per_minute": 100, "tokens_per_month": 1000}
    )
    reservation = await outcome(caller, 80)
    await quota_release(reservation=reservation, refund=True)
    status = await quota_status(caller, now=NOW)
    assert status["tenant"]["tokens_per_minute"]["used"] == 0
    assert status["tenant"]["tokens_per_month"]["used"] == 0
    assert status["tenant"]["requests_per_second"]["used"] == 1
    kept = await outcome(caller, 100)
    await quota_release(reservation=kept, refund=False)
    assert (await quota_status(caller, now=NOW))["tenant"]["tokens_per_minute"]["remaining"] == 0


async def test_concurrency_leases_are_held_released_and_expire(service_redis, settings):
    settings.QUOTA_LEASE_SECONDS = 30
    caller = caller_with({"max_concurrent_requests": 2})
    first, second = await outcome(caller, 1), await outcome(caller, 1)
    refusal = await outcome(caller, 1)
    assert (refusal.reason, refusal.kind, refusal.retry_after_s) == ("rate_limit_exceeded", "requests", 1)
    assert "concurrent" in refusal.message
    assert (await quota_status(caller, now=NOW))["tenant"]["concurrent_requests"] == {
        "limit": 2,
        "in_use": 2,
    }
    await quota_release(reservation=first, refund=False)
    assert not isinstance(await outcome(caller, 1), QuotaExceeded)
    # Leases of a process that died (never released) free themselves after QUOTA_LEASE_SECONDS.
    assert isinstance(await outcome(caller, 1, NOW + 29), QuotaExceeded)
    assert not isinstance(await outcome(caller, 1, NOW + 31), QuotaExceeded)
    del second


async def test_concurrency_limit_is_exact_under_concurrency(service_redis):
    caller = caller_with({"max_concurrent_requests": 7})
    results = await asyncio.gather(*(outcome(caller, 1) for _ in range(100)))
    assert sum(not isinstance(r, QuotaExceeded) for r in results) == 7


async def test_a_key_limit_is_on_top_of_its_tenants_and_the_tenant_counts_all_keys(service_redis):
    tenant_rate = {"requests_per_minute": 5, "request_burst": 5}
    strict = caller_with(tenant_rate, {"requests_per_minute": 2, "request_burst": 2}, key_id=10)
    other = caller_with(tenant_rate, key_id=11)
    results = [await outcome(strict, 1) for _ in range(3)]
    assert [isinstance(r, QuotaExceeded) for r in results] == [False, False, True]
    assert "this API key" in results[2].message
    # The key's own refusal reserved nothing at the tenant level: 3 of the tenant's 5 are left.
    results = [await outcome(other, 1) for _ in range(4)]
    assert [isinstance(r, QuotaExceeded) for r in results] == [False, False, False, True]
    assert "this tenant" in results[3].message
    # Headers name the binding limit: the key's, with less left.
    fresh = caller_with(tenant_rate, {"requests_per_minute": 2, "request_burst": 2}, key_id=12)
    admitted = await outcome(fresh, 1, NOW + 60)
    assert admitted.headers["x-ratelimit-limit-requests"] == "2"
    assert admitted.headers["x-ratelimit-remaining-requests"] == "1"


async def test_tenants_are_counted_apart(service_redis):
    await outcome(caller_with({"requests_per_minute": 1}, tenant_id=1), 1)
    assert not isinstance(
        await outcome(caller_with({"requests_per_minute": 1}, tenant_id=2, key_id=20), 1), QuotaExceeded
    )


async def test_max_inputs_per_request_of_tenant_or_key(service_redis):
    with pytest.raises(LimitExceeded, match="this tenant may send at most 3"):
        await quota_reserve(caller=caller_with({"max_inputs_per_request": 3}), inputs=4, tokens=4)
    with pytest.raises(LimitExceeded, match="this API key may send at most 2"):
        await quota_reserve(caller=caller_with({}, {"max_inputs_per_request": 2}), inputs=3, tokens=3)


async def test_no_limits_touch_no_redis(service_redis):
    reservation = await quota_reserve(caller=caller_with(), inputs=5, tokens=5, now=NOW)
    assert reservation.headers == {} and not reservation.holds_anything
    assert redis_sync().dbsize() == 0


def test_sync_twins_share_the_counters(service_redis):
    caller = caller_with({"tokens_per_day": 10})
    reservation = quota_reserve_sync(caller=caller, inputs=1, tokens=10, now=NOW)
    with pytest.raises(QuotaExceeded):
        quota_reserve_sync(caller=caller, inputs=1, tokens=1, now=NOW)
    quota_release_sync(reservation=reservation, refund=True)
    quota_reserve_sync(caller=caller, inputs=1, tokens=10, now=NOW)


@pytest.mark.django_db
def test_quota_status_sync_reads_limits_from_the_database(service_redis):
    from embeddings.services.accounts.api_keys import api_key_create
    from embeddings.services.accounts.tenants import tenant_create

    tenant = tenant_create(name="Acme")
    tenant.tokens_per_month = 1000
    tenant.save(update_fields=["tokens_per_month"])
    api_key, _ = api_key_create(tenant=tenant, name="k")
    api_key.requests_per_minute = 3
    api_key.max_concurrent_requests = 1
    api_key.save(update_fields=["requests_per_minute", "max_concurrent_requests"])
    caller = Caller(tenant.pk, api_key.pk, QuotaLimitValues.of(tenant), QuotaLimitValues.of(api_key))
    quota_reserve_sync(caller=caller, inputs=1, tokens=120, now=NOW)
    status = quota_status_sync(tenant.pk, api_key.pk, now=NOW)
    assert status["enabled"] is True
    assert status["tenant"]["tokens_per_month"] == {
        "limit": 1000,
        "used": 120,
        "remaining": 880,
        "resets_at": "2026-04-01T00:00:00Z",
        "reset_in_s": datetime(2026, 4, 1, tzinfo=UTC).timestamp() - NOW,
    }
    assert status["tenant"]["requests_per_minute"]["limit"] is None
    assert status["key"]["requests_per_minute"]["used"] == 1
    assert status["key"]["concurrent_requests"] == {"limit": 1, "in_use": 1}
    assert quota_status_sync(tenant.pk, now=NOW)["key"] is None


def test_duration_text_is_openais_format():
    assert [duration_text(s) for s in (0.02, 1, 1.5, 59.9991, 360, 3723, 86400)] == [
        "20ms", "1s", "1.5s", "1m0s", "6m0s", "1h2m3s", "24h0m0s",
    ]  # fmt: skip


# --- One request's bookkeeping (RequestQuota) ------------------------------------------------------


def usage_counters() -> dict[str, int]:
    return {
        parse_usage_field(field.decode())[1]: int(value)
        for field, value in redis_sync().hgetall(LIVE_USAGE_KEY).items()
    }


async def test_request_quota_records_usage_with_its_outcome(service_redis):
    caller = caller_with({"requests_per_minute": 1})
    admitted = RequestQuota(caller=caller, model="m", endpoint="openai", started=time.perf_counter())
    await admitted.reserve(inputs=2, tokens=9)
    assert admitted.headers["x-ratelimit-remaining-requests"] == "0"
    await admitted.settle(succeeded=True)
    refused = RequestQuota(caller=caller, model="m", endpoint="openai", started=time.perf_counter())
    with pytest.raises(QuotaExceeded):
        await refused.reserve(inputs=1, tokens=1)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    counters = usage_counters()
    assert counters["requests"] == 2 and counters["succeeded"] == 1 and counters["rejected"] == 1
    assert counters["inputs"] == 2 and counters["tokens"] == 9


@pytest.fixture
def stopped_redis(tmp_path, settings):
    with RedisServer(port=free_port(), data_dir=tmp_path, persistent=False) as server:
        url = server.url
    settings.REDIS_URL = url
    settings.REDIS_TIMEOUT_S = 0.5
    reset_redis_clients()
    yield
    reset_redis_clients()


@pytest.mark.parametrize("policy", ["closed", "open"])
async def test_redis_down_fails_closed_or_open_quickly(stopped_redis, settings, policy):
    settings.QUOTA_REDIS_FAILURE = policy
    request = RequestQuota(
        caller=caller_with({"requests_per_minute": 5}),
        model="m",
        endpoint="openai",
        started=time.perf_counter(),
    )
    started = time.monotonic()
    if policy == "closed":
        with pytest.raises(QuotaUnavailable):
            await request.reserve(inputs=1, tokens=1)
    else:
        await request.reserve(inputs=1, tokens=1)
        assert request.reservation is None
        await request.settle(succeeded=True)  # usage cannot be recorded: logged, not raised
    assert time.monotonic() - started < 5  # a bound on hanging, not a benchmark
    with pytest.raises(redis.exceptions.ConnectionError):
        await quota_status(caller_with({"requests_per_minute": 5}))


# --- The lean script path ---------------------------------------------------------------------------


async def test_scripts_are_reloaded_after_redis_forgets_them(service_redis):
    caller = caller_with({"requests_per_minute": 5, "request_burst": 5, "max_concurrent_requests": 2})
    first = await outcome(caller, 1)
    redis_sync().script_flush()  # as after a Redis restart
    second = await outcome(caller, 1)
    assert second.headers["x-ratelimit-remaining-requests"] == "3"
    redis_sync().script_flush()
    await quota_release(reservation=first, refund=False)
    await quota_release(reservation=second, refund=False)
    assert (await quota_status(caller, now=NOW))["tenant"]["concurrent_requests"]["in_use"] == 0


async def test_a_redis_that_never_answers_times_out(settings):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # the kernel accepts connections; nothing ever replies
    try:
        settings.REDIS_URL = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        settings.REDIS_TIMEOUT_S = 0.3
        reset_redis_clients()
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await quota_reserve(caller=caller_with({"requests_per_minute": 5}), inputs=1, tokens=1)
        assert time.monotonic() - started < 5  # a bound on hanging, not a benchmark
    finally:
        listener.close()
        reset_redis_clients()


async def test_the_lean_client_selects_the_database_of_the_url(service_redis, settings):
    settings.REDIS_URL = service_redis.url.rsplit("/", 1)[0] + "/3"
    reset_redis_clients()
    await outcome(caller_with({"requests_per_minute": 5}), 1)
    assert redis.Redis.from_url(settings.REDIS_URL).dbsize() == 1
    assert redis.Redis.from_url(service_redis.url).dbsize() == 0
    redis.Redis.from_url(settings.REDIS_URL).flushdb()


async def test_pooled_connections_survive_a_redis_restart(tmp_path, settings):
    port = free_port()
    caller = caller_with({"requests_per_minute": 5, "request_burst": 5})
    with RedisServer(port=port, data_dir=tmp_path, persistent=False) as server:
        settings.REDIS_URL = server.url
        reset_redis_clients()
        await outcome(caller, 1)
    with RedisServer(port=port, data_dir=tmp_path, persistent=False):
        # The pooled connection was closed by the old server; the script is unknown to the new one.
        admitted = await outcome(caller, 1)
        assert admitted.headers["x-ratelimit-remaining-requests"] == "4"
    reset_redis_clients()
