"""Quota policy without Redis: plans, headers and refusals, the reserve operation fed its replies."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from embeddings.callers import Caller
from embeddings.errors.service import LimitExceeded, QuotaExceeded
from embeddings.redis import scripts
from embeddings.redis.transport import ScriptCall
from embeddings.services.quotas.limits import QuotaLimitValues, quota_plan, reserve_operation

pytestmark = pytest.mark.unit

# 2026-03-10 12:00:30 UTC: 30 s into a minute.
NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC).timestamp()
DAY = int(NOW // 86400 * 86400)
MONTH = int(datetime(2026, 3, 1, tzinfo=UTC).timestamp())
MONTH_END = int(datetime(2026, 4, 1, tzinfo=UTC).timestamp())


def caller_with(tenant: dict | None = None, key: dict | None = None) -> Caller:
    return Caller(1, 10, QuotaLimitValues(**(tenant or {})), QuotaLimitValues(**(key or {})))


def reserve(caller: Caller, tokens: int, reply: str, *, inputs: int = 1):
    """Run the reserve operation with `reply` as Redis's answer; what it asked and what it returned."""
    operation = reserve_operation(caller, inputs, tokens, NOW)
    call = next(operation)
    try:
        operation.send(reply.encode())
    except StopIteration as done:
        return call, done.value
    raise AssertionError("the reserve operation asked Redis twice")


def test_a_plan_lists_rate_cells_then_budget_counters_then_lease_sets():
    plan = quota_plan(
        caller_with(
            {"tokens_per_minute": 120_000, "tokens_per_day": 10**6, "max_concurrent_requests": 2},
            {"requests_per_minute": 7},
        ),
        now=NOW,
    )
    keys = plan.keys.values
    assert keys == (
        "quota:{t1}:t:rate:tpm",
        "quota:{t1}:k10:rate:rpm",
        f"quota:{{t1}}:t:tpd:{DAY}",
        "quota:{t1}:t:concurrent",
    )
    # Per cell: tokens or requests, µs between units, tolerance (the burst); the token burst is a
    # minute of its rate, the request burst a second of it (at least one); requests whole µs.
    assert plan.tail.values == (
        1, "500.0", 60_000_000,
        0, "8571429.0", 8571429,
        10**6, (DAY + 86400) * 1000,
        2,
    )  # fmt: skip


def test_no_limits_ask_nothing_of_redis():
    operation = reserve_operation(caller_with(), 1, 5, NOW)
    with pytest.raises(StopIteration) as done:
        next(operation)
    assert done.value.value.headers == {}


def test_rates_run_on_redis_clock_unless_a_test_pins_it():
    caller = caller_with({"requests_per_second": 5})
    pinned = next(reserve_operation(caller, 1, 1, NOW))
    live = next(reserve_operation(caller, 1, 1, None))
    assert pinned.args[7] == round(NOW * 1_000_000)
    assert live.args[7] == 0  # the script reads Redis's TIME


def test_an_admitted_request_gets_the_binding_limits_headers():
    caller = caller_with(
        {"requests_per_second": 10, "request_burst": 5, "tokens_per_minute": 6000, "token_burst": 100}
    )
    # Before this request: the request cell 200 ms ahead (3 left), the token cell 500 ms (50 left).
    call, reservation = reserve(caller, 30, "1,200000,500000")
    assert isinstance(call, ScriptCall) and call.script is scripts.QUOTA_RESERVE
    assert reservation.headers == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "300ms",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "800ms",
    }
    # A failed request gives back its tokens' time, not its request.
    assert reservation.refunds() == [("quota:{t1}:t:rate:tpm", 300_000)]


def test_a_budget_is_the_binding_token_limit_when_it_has_less_left():
    caller = caller_with({"tokens_per_minute": 6000, "tokens_per_month": 1000})
    _, reservation = reserve(caller, 30, "1,0,960")
    assert reservation.headers["x-ratelimit-limit-tokens"] == "1000"
    assert reservation.headers["x-ratelimit-remaining-tokens"] == "10"
    assert reservation.refunds() == [("quota:{t1}:t:rate:tpm", 300_000), (f"quota:{{t1}}:t:tpmo:{MONTH}", 30)]


def test_refusals_name_the_most_lasting_reason_and_the_time_until_all_admit():
    caller = caller_with({"tokens_per_minute": 6000, "token_burst": 100, "tokens_per_month": 1000})
    with pytest.raises(QuotaExceeded) as budget:
        reserve(caller, 50, "0,800000,990")
    assert budget.value.reason == "insufficient_quota"
    assert "quota of tokens per month: limit 1000, used 990, requested 50" in budget.value.message
    assert budget.value.retry_after_s == MONTH_END - NOW
    with pytest.raises(QuotaExceeded) as rate:
        reserve(caller, 50, "0,800000,10")
    # 800 ms ahead + 500 ms for 50 tokens - 1 s of burst: admitted in 300 ms.
    assert rate.value.reason == "rate_limit_exceeded" and rate.value.kind == "tokens"
    assert rate.value.retry_after_s == 1 and rate.value.headers["retry-after-ms"] == "300"
    assert (
        "Rate limit reached for this tenant's tokens per minute (TPM): 6000 with a burst of 100 tokens"
        in (rate.value.message)
    )
    assert rate.value.message.endswith("Please try again in 300ms.")
    with pytest.raises(QuotaExceeded) as too_large:
        reserve(caller, 150, "0,0,0")
    assert "Request too large for this tenant's tokens per minute (TPM)" in too_large.value.message


def test_a_full_lease_set_refuses_with_the_concurrency_message():
    with pytest.raises(QuotaExceeded) as full:
        reserve(caller_with(key={"max_concurrent_requests": 2}), 1, "0,2")
    assert full.value.message.startswith("Too many concurrent requests for this API key: limit 2.")
    assert full.value.retry_after_s == 1


def test_too_many_inputs_are_refused_before_redis():
    operation = reserve_operation(caller_with(key={"max_inputs_per_request": 3}), 4, 1, NOW)
    with pytest.raises(LimitExceeded, match="this API key may send at most 3"):
        next(operation)
