"""Usage accounting: every request counted in Redis on the hot path, folded into UsageBucket rows.

Hot path: one pipelined HINCRBY batch on the hash LIVE_USAGE_KEY per request. Each hash field is
one counter of one bucket: "<tenant>|<key or empty>|<hour epoch>|<endpoint>|<metric>|<model>"
(the model last, so a "|" in a model's name cannot shift the other parts). Metrics are the
UsageBucket counter fields: requests, succeeded, rejected, failed, inputs, tokens, latency_ms_total.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from embeddings.services.redis_clients import redis_async, redis_sync

LIVE_USAGE_KEY = "usage:live"
FIELD_SEPARATOR = "|"

Outcome = Literal["succeeded", "rejected", "failed"]


@dataclass(frozen=True)
class UsageEvent:
    """One request's (or one job chunk's) usage."""

    tenant_id: int
    api_key_id: int | None
    model: str
    endpoint: str
    outcome: Outcome
    inputs: int = 0
    tokens: int = 0
    latency_ms: int = 0
    at: float | None = None  # epoch seconds; now when None

    def hour_epoch(self) -> int:
        at = time.time() if self.at is None else self.at
        return int(at // 3600 * 3600)


def usage_field(
    *, tenant_id: int, api_key_id: int | None, hour_epoch: int, endpoint: str, metric: str, model: str
) -> str:
    key = "" if api_key_id is None else str(api_key_id)
    return FIELD_SEPARATOR.join((str(tenant_id), key, str(hour_epoch), endpoint, metric, model))


def usage_increments(event: UsageEvent) -> dict[str, int]:
    """The hash fields this event adds to, and by how much (zero counters are left out)."""
    counters = {
        "requests": 1,
        event.outcome: 1,
        "inputs": event.inputs,
        "tokens": event.tokens,
        "latency_ms_total": max(0, event.latency_ms),
    }
    hour = event.hour_epoch()
    return {
        usage_field(
            tenant_id=event.tenant_id,
            api_key_id=event.api_key_id,
            hour_epoch=hour,
            endpoint=event.endpoint,
            metric=metric,
            model=event.model,
        ): amount
        for metric, amount in counters.items()
        if amount
    }


def _queue_increments(pipeline, event: UsageEvent) -> None:
    for field, amount in usage_increments(event).items():
        pipeline.hincrby(LIVE_USAGE_KEY, field, amount)


async def usage_record_async(event: UsageEvent) -> None:
    """Count one event (one round trip). Raises redis.exceptions.RedisError when Redis fails."""
    pipeline = redis_async().pipeline(transaction=False)
    _queue_increments(pipeline, event)
    await pipeline.execute()


def usage_record_sync(event: UsageEvent) -> None:
    pipeline = redis_sync().pipeline(transaction=False)
    _queue_increments(pipeline, event)
    pipeline.execute()
