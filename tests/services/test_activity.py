"""The per-minute activity counters (embeddings/services/quotas/activity.py): what one request adds,
p50/p99 from the histogram, and, against the real test Redis, what the settle script writes, how
long it keeps it and what a refusal by each limit records."""

from __future__ import annotations

import time

import pytest

from embeddings.callers import Caller
from embeddings.errors.service import QuotaExceeded
from embeddings.redis import keys as redis_keys
from embeddings.redis.connections import redis_sync
from embeddings.services.quotas import activity
from embeddings.services.quotas.activity import (
    LATENCY_BOUNDS_MS,
    LATENCY_FIELDS,
    ModelMinute,
    activity_counters,
    latency_quantile,
    recent_activity,
)
from embeddings.services.quotas.limits import QuotaLimitValues, RequestQuota, quota_release_sync
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, UsageEvent

# 2026-03-10 12:00:30 UTC: 30 s into its minute (the unit tests write nothing to Redis).
AT = 1_773_144_030.0
MINUTE = int(AT // 60)


def event(outcome="succeeded", *, model="minilm", tokens=7, latency_ms=42, tenant_id=3, at=AT) -> UsageEvent:
    return UsageEvent(tenant_id, 9, model, "openai", outcome, 1, tokens, latency_ms, at=at)


def histogram(**counts_by_bound) -> list[int]:
    """Bucket counts: le_<bound>=count (le_inf for the slowest)."""
    buckets = [0] * len(LATENCY_FIELDS)
    for name, count in counts_by_bound.items():
        buckets[LATENCY_FIELDS.index(name.replace("le_", "latency_le_"))] = count
    return buckets


# --- What one request adds (unit) -------------------------------------------------------------------


@pytest.mark.unit
def test_a_succeeded_request_counts_its_tokens_and_its_latency_bucket_in_its_minute():
    (models,) = activity_counters(event(latency_ms=42))
    assert models.key == f"activity:models:{MINUTE}"
    assert models.increments == {"requests|minilm": 1, "tokens|minilm": 7, "latency_le_50|minilm": 1}
    # Kept until the overview's chart no longer shows the minute (10 minutes on), and a minute more.
    assert models.expire_at == (MINUTE + 1 + 12) * 60


@pytest.mark.unit
def test_each_outcome_and_latency_lands_in_its_own_counter():
    failed, *_ = activity_counters(event("failed", latency_ms=2_500))
    assert failed.increments == {"requests|minilm": 1, "errors|minilm": 1, "latency_le_3000|minilm": 1}
    refused, *more = activity_counters(event("rejected", tokens=0, latency_ms=1))
    # A refusal is fast by nature: kept out of the latency an admitted request sees.
    assert refused.increments == {"requests|minilm": 1, "refused|minilm": 1}
    assert more == []  # a refusal without a named limit (a 413) counts for no tenant
    assert activity_counters(event(latency_ms=5))[0].increments["latency_le_5|minilm"] == 1
    assert activity_counters(event(latency_ms=6))[0].increments["latency_le_10|minilm"] == 1
    assert activity_counters(event(latency_ms=60_000))[0].increments["latency_le_inf|minilm"] == 1
    # A model whose name holds the separator keeps it whole: the metric comes first.
    assert "requests|team|model" in activity_counters(event(model="team|model"))[0].increments


@pytest.mark.unit
def test_a_429_counts_for_its_tenant_and_limit_for_an_hour():
    refusal = QuotaExceeded(
        "no", reason="insufficient_quota", kind="tokens", retry_after_s=1, limit="tokens_per_day", level="key"
    )
    _, refusals = activity_counters(event("rejected", tokens=0), refusal)
    assert refusals.key == f"activity:refusals:{MINUTE}"
    assert refusals.increments == {"3|key|tokens_per_day": 1}
    assert refusals.expire_at == (MINUTE + 1 + 61) * 60


@pytest.mark.unit
def test_percentiles_from_the_histogram_interpolate_within_the_bucket_that_holds_the_rank():
    assert latency_quantile([0] * len(LATENCY_FIELDS), 0.5) is None
    # 100 requests between 20 and 30 ms: the median halfway through that bucket, p99 near its top.
    assert latency_quantile(histogram(le_30=100), 0.5) == pytest.approx(25.0)
    assert latency_quantile(histogram(le_30=100), 0.99) == pytest.approx(29.9)
    # 98 fast ones (<= 5 ms) and 2 slow ones between 1 and 1.5 s: p50 in the first bucket (from 0),
    # p99 halfway through the slow bucket.
    buckets = histogram(le_5=98, le_1500=2)
    assert latency_quantile(buckets, 0.5) == pytest.approx(5 * 50 / 98)
    assert latency_quantile(buckets, 0.99) == pytest.approx(1250.0)
    # Past the last bound all a histogram can say is "at least that".
    assert latency_quantile(histogram(le_inf=3), 0.5) == LATENCY_BOUNDS_MS[-1]
    minute = ModelMinute(requests=100, latency=histogram(le_30=100))
    assert (minute.p50_ms, round(minute.p99_ms, 1)) == (25.0, 29.9)


# --- Written by the settle script, read back (the real test Redis) ----------------------------------


def settle(usage: UsageEvent, refusal: QuotaExceeded | None = None) -> None:
    """Count `usage` as a request's settle does: usage and activity in one script."""
    quota_release_sync(
        reservation=None, refund=False, usage=usage, activity=activity_counters(usage, refusal)
    )


def test_the_settle_script_adds_to_the_minute_and_the_overview_reads_it(service_redis):
    at = time.time()  # keys expire at times after their minute: a minute of the past is gone at once
    minute = int(at // 60)
    for latency in (12, 18, 25, 40, 900):
        settle(event(latency_ms=latency, tokens=10, at=at))
    settle(event("failed", latency_ms=3_000, at=at))
    settle(event("rejected", tokens=0, at=at))
    settle(event(model="bge", latency_ms=7, at=at - 120))  # two minutes earlier
    read = recent_activity(now=at + 60)  # from the next minute: this one is the last complete one
    assert read.minutes == list(range(minute + 1 - 10, minute + 2))
    last = read.last_complete_minute("minilm")
    assert (last.requests, last.tokens, last.errors, last.refused) == (7, 50, 1, 1)
    assert sum(last.latency) == 6  # the five that succeeded and the one that failed
    # Rank 3 of 6 ends the 20-30 ms bucket (12, 18 | 25); rank 5.94 lies 94% into 2-3 s.
    assert last.p50_ms == 30.0 and last.p99_ms == pytest.approx(2_940.0)
    # The chart's bars: requests a minute, oldest first, the current minute last.
    assert [m.requests for m in read.models["minilm"]] == [0] * 9 + [7, 0]
    assert [m.requests for m in read.models["bge"]] == [0] * 7 + [1, 0, 0, 0]
    assert read.last_complete_minute("never-asked").requests == 0


def test_the_minute_hashes_expire_after_the_chart_and_the_hour(service_redis):
    now = time.time()
    settle(event(at=now))
    refusal = QuotaExceeded(
        "no", reason="rate_limit_exceeded", kind="requests", retry_after_s=1,
        limit="requests_per_second", level="tenant",
    )  # fmt: skip
    settle(event("rejected", at=now), refusal)
    minute = int(now // 60)
    models_ttl = redis_sync().ttl(redis_keys.activity_models(minute))
    refusals_ttl = redis_sync().ttl(redis_keys.activity_refusals(minute))
    # The end of the minute, then 12 minutes (the chart's 10, the current one, one more) or 61.
    assert (minute + 13) * 60 - now - 2 <= models_ttl <= (minute + 13) * 60 - now + 1
    assert (minute + 62) * 60 - now - 2 <= refusals_ttl <= (minute + 62) * 60 - now + 1
    # Usage is counted as before, in the same script.
    assert redis_sync().hlen(LIVE_USAGE_KEY) > 0


def limited_caller(**limits) -> Caller:
    return Caller(4, 40, QuotaLimitValues(**limits), QuotaLimitValues())


async def test_requests_a_limit_refuses_are_counted_by_tenant_and_limit(service_redis):
    """Through RequestQuota and the real reserve script, as every API view meters a request."""
    caller = limited_caller(requests_per_minute=1, request_burst=2, tokens_per_day=1_000)
    outcomes = []
    for tokens in (10, 10, 10, 10, 5_000):
        quota = RequestQuota(caller=caller, model="minilm", endpoint="openai", started=time.perf_counter())
        try:
            await quota.reserve(inputs=1, tokens=tokens)
        except QuotaExceeded as refusal:
            outcomes.append(refusal.limit)
            continue
        await quota.settle(succeeded=True)
        outcomes.append("admitted")
    # The burst of two passes; then the rate refuses; a request over the day's budget is refused
    # for the budget, the more lasting reason, whatever else refuses it.
    assert outcomes == [
        "admitted",
        "admitted",
        "requests_per_minute",
        "requests_per_minute",
        "tokens_per_day",
    ]
    read = recent_activity()
    assert read.refusals == {4: {("tenant", "requests_per_minute"): 2, ("tenant", "tokens_per_day"): 1}}
    this_minute = read.models["minilm"][-1]
    assert (this_minute.requests, this_minute.refused, this_minute.tokens) == (5, 3, 20)


def test_a_redis_without_the_minutes_reads_as_no_activity(service_redis):
    read = recent_activity()
    assert read.models == {} and read.refusals == {}
    assert len(read.minutes) == activity.CHART_MINUTES + 1
