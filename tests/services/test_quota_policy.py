"""Quota policy without Redis: plans, headers and refusals, the reserve operation fed its replies."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from embeddings.redis import scripts
from embeddings.redis.transport import ScriptCall
from embeddings.services.errors import LimitExceeded, QuotaExceeded
from embeddings.services.quotas import QuotaHolder, QuotaLimitValues, quota_plan, reserve_operation

pytestmark = pytest.mark.unit

# 2026-03-10 12:00:30 UTC: 30 s into a minute.
NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC).timestamp()
MINUTE = int(NOW // 60 * 60)


def holder(tenant: dict | None = None, key: dict | None = None) -> QuotaHolder:
    return QuotaHolder(1, 10, QuotaLimitValues(**(tenant or {})), QuotaLimitValues(**(key or {})))


def reserve(subject: QuotaHolder, tokens: int, reply: str, *, inputs: int = 1):
    """Run the reserve operation with `reply` as Redis's answer; what it asked and what it returned."""
    operation = reserve_operation(subject, inputs, tokens, NOW)
    call = next(operation)
    try:
        operation.send(reply.encode())
    except StopIteration as done:
        return call, done.value
    raise AssertionError("the reserve operation asked Redis twice")


def test_a_plan_lists_request_counters_first_then_tokens_then_lease_sets():
    plan = quota_plan(
        holder({"tokens_per_minute": 100, "max_concurrent_requests": 2}, {"requests_per_minute": 5}), now=NOW
    )
    assert plan.keys.values == (
        f"quota:{{t1}}:k10:rpm:{MINUTE}",
        f"quota:{{t1}}:t:tpm:{MINUTE}",
        "quota:{t1}:t:concurrent",
    )
    assert plan.requests_counters == 1
    assert plan.tail.values == (5, (MINUTE + 60) * 1000, 100, (MINUTE + 60) * 1000, 2)


def test_no_limits_ask_nothing_of_redis():
    operation = reserve_operation(holder(), 1, 5, NOW)
    with pytest.raises(StopIteration) as done:
        next(operation)
    assert done.value.value.headers == {}


def test_an_admitted_request_gets_the_binding_windows_headers():
    call, reservation = reserve(holder({"requests_per_minute": 5, "tokens_per_minute": 100}), 30, "1,2,50")
    assert isinstance(call, ScriptCall) and call.script is scripts.QUOTA_RESERVE
    assert reservation.headers == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "30s",
    }
    assert reservation.refunds() == [(f"quota:{{t1}}:t:tpm:{MINUTE}", 30)]


def test_refusals_name_the_most_lasting_reason():
    subject = holder({"tokens_per_minute": 100, "tokens_per_month": 1000})
    with pytest.raises(QuotaExceeded) as budget:
        reserve(subject, 50, "0,80,990")
    assert budget.value.reason == "insufficient_quota"
    assert "quota of tokens per month: limit 1000, used 990, requested 50" in budget.value.message
    with pytest.raises(QuotaExceeded) as rate:
        reserve(subject, 50, "0,80,10")
    assert rate.value.reason == "rate_limit_exceeded" and rate.value.retry_after_s == 30
    assert "Rate limit reached for this tenant's tokens per minute (TPM)" in rate.value.message
    with pytest.raises(QuotaExceeded) as too_large:
        reserve(subject, 150, "0,0,0")
    assert "Request too large for this tenant's tokens per minute (TPM)" in too_large.value.message


def test_a_full_lease_set_refuses_with_the_concurrency_message():
    with pytest.raises(QuotaExceeded) as full:
        reserve(holder(key={"max_concurrent_requests": 2}), 1, "0,2")
    assert full.value.message.startswith("Too many concurrent requests for this API key: limit 2.")
    assert full.value.retry_after_s == 1


def test_too_many_inputs_are_refused_before_redis():
    operation = reserve_operation(holder(key={"max_inputs_per_request": 3}), 4, 1, NOW)
    with pytest.raises(LimitExceeded, match="this API key may send at most 3"):
        next(operation)
