"""Usage accounting: every request counted in Redis on the hot path, folded into UsageBucket rows.

Hot path: one pipelined HINCRBY batch on the hash LIVE_USAGE_KEY per request. Each hash field is
one counter of one bucket: "<tenant>|<key or empty>|<hour epoch>|<endpoint>|<metric>|<model>"
(the model last, so a "|" in a model's name cannot shift the other parts). Metrics are the
UsageBucket counter fields: requests, succeeded, rejected, failed, inputs, tokens, latency_ms_total.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal

import redis
from django.db import IntegrityError, transaction
from django.db.models import F

from embeddings.models import ApiKey, Tenant, UsageBucket, UsageFold
from embeddings.services.redis_clients import redis_async, redis_sync

logger = logging.getLogger(__name__)

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


# --- The fold: Redis counters -> UsageBucket rows -------------------------------------------------
#
# 1. Claim: one Lua script renames LIVE_USAGE_KEY to FOLDING_PREFIX + <batch id> and adds the id to
#    FOLDING_BATCHES_KEY (atomic: a HINCRBY lands either in the batch or in a fresh live hash).
# 2. Add: in one database transaction, insert UsageFold(batch_id) and add every counter of the
#    batch to its UsageBucket row (F() update, or create).
# 3. Forget: after the commit, delete the batch in Redis.
# A fold first finishes every batch a crashed fold left in FOLDING_BATCHES_KEY: one with a UsageFold
# row was counted already and is only forgotten; one without is added. So a crash anywhere loses
# nothing and counts nothing twice (UsageFold.batch_id is unique: two folds racing on one leftover
# batch cannot both commit it).

FOLDING_PREFIX = "usage:folding:"
FOLDING_BATCHES_KEY = "usage:folding-batches"
COUNTER_METRICS = ("requests", "succeeded", "rejected", "failed", "inputs", "tokens", "latency_ms_total")

_CLAIM_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# Everything not yet in the database, read at one instant: the live hash, then each unfinished
# batch's id and fields. (Batch keys are built in the script: fine on one Redis, not on a cluster.)
_SNAPSHOT_SCRIPT = """
local out = {redis.call('HGETALL', KEYS[1])}
for _, batch_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    table.insert(out, batch_id)
    table.insert(out, redis.call('HGETALL', ARGV[1] .. batch_id))
end
return out
"""


@dataclass(frozen=True)
class BucketKey:
    tenant_id: int
    api_key_id: int | None
    model: str
    endpoint: str
    hour_epoch: int


Counters = dict[BucketKey, dict[str, int]]


@dataclass(frozen=True)
class UsageFoldResult:
    batches: int  # Redis batches finished (leftovers included)
    buckets: int  # UsageBucket rows created or updated
    dropped: int  # counters of tenants that no longer exist, or unreadable fields


def parse_usage_field(field: str) -> tuple[BucketKey, str] | None:
    """The bucket and metric of one hash field, or None when it is not one of ours."""
    parts = field.split(FIELD_SEPARATOR, maxsplit=5)
    if len(parts) != 6:
        return None
    tenant, key, hour, endpoint, metric, model = parts
    if metric not in COUNTER_METRICS:
        return None
    try:
        bucket = BucketKey(int(tenant), int(key) if key else None, model, endpoint, int(hour))
    except ValueError:
        return None
    return bucket, metric


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def counters_from_hash(flat: dict | list, *, tenant_id: int | None = None) -> tuple[Counters, int]:
    """Counters by bucket from a usage hash (a dict, or HGETALL's flat list from a script); the
    second value counts unreadable fields. With tenant_id, only that tenant's buckets."""
    items = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2], strict=True)
    counters: Counters = {}
    unreadable = 0
    for raw_field, raw_amount in items:
        parsed = parse_usage_field(_decode(raw_field))
        if parsed is None:
            unreadable += 1
            continue
        bucket, metric = parsed
        if tenant_id is not None and bucket.tenant_id != tenant_id:
            continue
        metrics = counters.setdefault(bucket, dict.fromkeys(COUNTER_METRICS, 0))
        metrics[metric] += int(raw_amount)
    return counters, unreadable


def _batch_key(batch_id: str) -> str:
    return FOLDING_PREFIX + batch_id


def _claim_live_counters(client: redis.Redis) -> str | None:
    """Rename the live hash to a new batch; its id, or None when nothing was counted since."""
    batch_id = uuid.uuid4().hex
    claimed = client.eval(
        _CLAIM_SCRIPT, 3, LIVE_USAGE_KEY, _batch_key(batch_id), FOLDING_BATCHES_KEY, batch_id
    )
    return batch_id if claimed else None


def _add_counters_to_buckets(counters: Counters) -> tuple[int, int]:
    """Add counters to UsageBucket rows (inside the caller's transaction): (rows, dropped counters)."""
    tenant_ids = {bucket.tenant_id for bucket in counters}
    existing_tenants = set(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", flat=True))
    key_ids = {bucket.api_key_id for bucket in counters if bucket.api_key_id is not None}
    key_tenants = dict(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", "tenant_id"))
    merged: Counters = {}
    dropped = 0
    for bucket, metrics in counters.items():
        if bucket.tenant_id not in existing_tenants:
            logger.warning("usage fold: tenant %s no longer exists; dropping %s", bucket.tenant_id, metrics)
            dropped += sum(1 for amount in metrics.values() if amount)
            continue
        if bucket.api_key_id is not None and key_tenants.get(bucket.api_key_id) != bucket.tenant_id:
            bucket = replace(bucket, api_key_id=None)  # the key was deleted since: kept, keyless
        target = merged.setdefault(bucket, dict.fromkeys(COUNTER_METRICS, 0))
        for metric, amount in metrics.items():
            target[metric] += amount
    for bucket, metrics in merged.items():
        lookup = {
            "tenant_id": bucket.tenant_id,
            "api_key_id": bucket.api_key_id,
            "model": bucket.model,
            "endpoint": bucket.endpoint,
            "hour": datetime.fromtimestamp(bucket.hour_epoch, tz=UTC),
        }
        additions = {metric: amount for metric, amount in metrics.items() if amount}
        updated = UsageBucket.objects.filter(**lookup).update(
            **{metric: F(metric) + amount for metric, amount in additions.items()}
        )
        if not updated:
            UsageBucket.objects.create(**lookup, **additions)
    return len(merged), dropped


def _forget_batch(client: redis.Redis, batch_id: str) -> None:
    pipeline = client.pipeline(transaction=True)
    pipeline.delete(_batch_key(batch_id))
    pipeline.srem(FOLDING_BATCHES_KEY, batch_id)
    pipeline.execute()


def _fold_batch(client: redis.Redis, batch_id: str) -> tuple[int, int]:
    """Add one claimed batch to the database once, then forget it: (rows, dropped counters)."""
    if UsageFold.objects.filter(batch_id=batch_id).exists():
        _forget_batch(client, batch_id)  # a fold crashed after its commit: counted already
        return 0, 0
    counters, unreadable = counters_from_hash(client.hgetall(_batch_key(batch_id)))
    if unreadable:
        logger.warning("usage fold: %d unreadable fields in batch %s dropped", unreadable, batch_id)
    try:
        with transaction.atomic():
            # First: a second fold of the same batch fails here (unique), before adding anything.
            fold = UsageFold.objects.create(batch_id=batch_id)
            rows, dropped = _add_counters_to_buckets(counters)
            fold.rows = rows
            fold.save(update_fields=["rows"])
    except IntegrityError:
        logger.info("usage fold: batch %s was folded by another fold meanwhile", batch_id)
        rows, dropped = 0, 0
    _forget_batch(client, batch_id)
    return rows, dropped + unreadable


def usage_fold() -> UsageFoldResult:
    """Move every counter from Redis into UsageBucket rows, exactly once (see above)."""
    client = redis_sync()
    batch_ids = sorted(_decode(member) for member in client.smembers(FOLDING_BATCHES_KEY))
    if batch_ids:
        logger.warning("usage fold: finishing %d batch(es) left by an interrupted fold", len(batch_ids))
    new_batch = _claim_live_counters(client)
    if new_batch is not None:
        batch_ids.append(new_batch)
    rows = dropped = 0
    for batch_id in batch_ids:
        batch_rows, batch_dropped = _fold_batch(client, batch_id)
        rows += batch_rows
        dropped += batch_dropped
    return UsageFoldResult(batches=len(batch_ids), buckets=rows, dropped=dropped)
