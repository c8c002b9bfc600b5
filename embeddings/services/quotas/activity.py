"""The last hour's API activity of every web process, counted in the critical Redis.

/metrics is per process; an operator asking "what did the service do in the last minute?" needs
the sum over every process and host. So the script that settles each API request's quota and usage
(limits.py: one round trip a request, as before) also adds the request to two hashes of its minute
(embeddings.redis.keys):

    activity:models:<minute>    "<metric>|<model>": requests (every request that reached the quota
                                check), tokens (of succeeded ones), refused (by a limit, 429 or
                                413), errors (failed after it was admitted: Triton, a timeout, the
                                client gone), and one latency histogram bucket per admitted request
                                (arrival to settle, ms: `latency_le_<bound>`); kept 12 minutes
    activity:refusals:<minute>  "<tenant>|<level>|<limit>": requests a limit refused with a 429;
                                kept 61 minutes

Job chunks are not counted here: they are not requests, and the overview shows jobs by their
backlog. Requests refused before the quota check (a bad body, a bad key) are not counted either.

`recent_activity` reads the last CHART_MINUTES complete minutes, the current one and the refusals of
the last REFUSAL_MINUTES in one round trip; `latency_quantile` estimates p50 and p99 from a minute's
histogram as Prometheus's histogram_quantile does (linear within the bucket that holds the rank).
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from embeddings.errors.service import QuotaExceeded
from embeddings.redis import keys as redis_keys
from embeddings.redis import operations
from embeddings.redis.connections import redis_sync
from embeddings.redis.operations import CounterHash
from embeddings.redis.transport import operation_run_sync
from embeddings.services.quotas.usage import UsageEvent

# Upper bounds (ms) of the latency histogram's buckets; a last one holds everything slower. 1.5 to 2x
# apart: an estimated percentile is within a bucket's width of the truth.
LATENCY_BOUNDS_MS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000)
METRICS = ("requests", "tokens", "refused", "errors")
# The overview's chart: this many complete minutes and the current one.
CHART_MINUTES = 10
# Refusals are summed over this many minutes, the current one included.
REFUSAL_MINUTES = 60
# A minute's hashes outlive the last read that needs them by a minute.
MODELS_KEPT_MINUTES = CHART_MINUTES + 2
REFUSALS_KEPT_MINUTES = REFUSAL_MINUTES + 1
SEPARATOR = "|"


def latency_field_name(index: int) -> str:
    return f"latency_le_{LATENCY_BOUNDS_MS[index]}" if index < len(LATENCY_BOUNDS_MS) else "latency_le_inf"


LATENCY_FIELDS = tuple(latency_field_name(index) for index in range(len(LATENCY_BOUNDS_MS) + 1))


@functools.lru_cache(maxsize=256)
def _model_fields(model: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The hash fields of one model: built once per model, not per request."""
    tail = SEPARATOR + model
    return {metric: metric + tail for metric in METRICS}, tuple(name + tail for name in LATENCY_FIELDS)


def activity_counters(event: UsageEvent, refusal: QuotaExceeded | None = None) -> list[CounterHash]:
    """What one API request adds to its minute's activity hashes; `refusal`: the 429 that refused it."""
    minute = int((time.time() if event.at is None else event.at) // 60)
    names, latency_names = _model_fields(event.model)
    increments = {names["requests"]: 1}
    if event.outcome == "rejected":
        increments[names["refused"]] = 1
    else:
        if event.outcome == "failed":
            increments[names["errors"]] = 1
        elif event.tokens:
            increments[names["tokens"]] = event.tokens
        increments[latency_names[bisect.bisect_left(LATENCY_BOUNDS_MS, max(0, event.latency_ms))]] = 1
    counters = [
        CounterHash(redis_keys.activity_models(minute), (minute + 1 + MODELS_KEPT_MINUTES) * 60, increments)
    ]
    if refusal is not None and refusal.limit:
        field_name = SEPARATOR.join((str(event.tenant_id), refusal.level, refusal.limit))
        counters.append(
            CounterHash(
                redis_keys.activity_refusals(minute),
                (minute + 1 + REFUSALS_KEPT_MINUTES) * 60,
                {field_name: 1},
            )
        )
    return counters


def latency_quantile(buckets: Sequence[int], quantile: float) -> float | None:
    """The latency (ms) below which `quantile` of the requests fell, estimated from the histogram's
    bucket counts (LATENCY_BOUNDS_MS, then the slower ones): linear within the bucket that holds the
    rank, from 0 for the first; a rank in the last, unbounded bucket is its lower bound. None when
    the histogram is empty."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = quantile * total
    seen = 0
    for index, count in enumerate(buckets):
        if count and seen + count >= rank:
            if index >= len(LATENCY_BOUNDS_MS):
                return float(LATENCY_BOUNDS_MS[-1])
            lower = LATENCY_BOUNDS_MS[index - 1] if index else 0
            upper = LATENCY_BOUNDS_MS[index]
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return float(LATENCY_BOUNDS_MS[-1])


@dataclass
class ModelMinute:
    """One model's requests in one minute, every process's."""

    requests: int = 0
    tokens: int = 0
    refused: int = 0
    errors: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_FIELDS))

    @property
    def p50_ms(self) -> float | None:
        return latency_quantile(self.latency, 0.5)

    @property
    def p99_ms(self) -> float | None:
        return latency_quantile(self.latency, 0.99)


@dataclass(frozen=True)
class RecentActivity:
    """`minutes`: epoch minutes, oldest first, the last the current (incomplete) one; `models`: each
    model's counts in those minutes; `refusals`: tenant id -> (level, limit) -> requests refused in
    the last REFUSAL_MINUTES."""

    minutes: list[int]
    models: dict[str, list[ModelMinute]]
    refusals: dict[int, dict[tuple[str, str], int]]

    def last_complete_minute(self, model: str) -> ModelMinute:
        return self.models.get(model, [ModelMinute()] * 2)[-2]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _model_minute(pairs: list[tuple], models: dict[str, list[ModelMinute]], index: int, size: int) -> None:
    latency_index = {name: position for position, name in enumerate(LATENCY_FIELDS)}
    for raw_field, raw_value in pairs:
        metric, separator, model = _text(raw_field).partition(SEPARATOR)
        if not separator:
            continue
        minute = models.setdefault(model, [ModelMinute() for _ in range(size)])[index]
        if metric in latency_index:
            minute.latency[latency_index[metric]] += int(raw_value)
        elif metric in METRICS:
            setattr(minute, metric, getattr(minute, metric) + int(raw_value))


def recent_activity(*, now: float | None = None, client: redis.Redis | None = None) -> RecentActivity:
    """The models' last CHART_MINUTES minutes and the current one, and the last REFUSAL_MINUTES'
    refusals, from the critical Redis in one round trip. Raises redis.exceptions.RedisError."""
    current = int((time.time() if now is None else now) // 60)
    minutes = list(range(current - CHART_MINUTES, current + 1))
    refusal_minutes = range(current - REFUSAL_MINUTES + 1, current + 1)
    names = [redis_keys.activity_models(minute) for minute in minutes]
    names += [redis_keys.activity_refusals(minute) for minute in refusal_minutes]
    hashes = operation_run_sync(operations.counter_hashes_read(names), client or redis_sync())
    models: dict[str, list[ModelMinute]] = {}
    for index, pairs in enumerate(hashes[: len(minutes)]):
        _model_minute(pairs, models, index, len(minutes))
    refusals: dict[int, dict[tuple[str, str], int]] = {}
    for pairs in hashes[len(minutes) :]:
        for raw_field, raw_value in pairs:
            parts = _text(raw_field).split(SEPARATOR)
            if len(parts) != 3 or not parts[0].isdigit():
                continue
            by_limit = refusals.setdefault(int(parts[0]), {})
            by_limit[(parts[1], parts[2])] = by_limit.get((parts[1], parts[2]), 0) + int(raw_value)
    return RecentActivity(minutes=minutes, models=models, refusals=refusals)
