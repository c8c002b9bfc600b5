"""Usage accounting: every request counted in Redis on the hot path, folded into UsageBucket rows.

Hot path: `usage_increments(event)` gives the HINCRBYs of one request (or job chunk) on the live
usage hash (embeddings.redis.keys); the script that settles a request's quota (services/quotas/limits.py)
applies them in the same round trip. A job chunk's are kept with its result in the job store
(services/jobs/store.py) and counted here by `usage_count_once`, once per chunk however often it is
offered. Each hash field is one counter of one bucket:
"<tenant>|<key or empty>|<hour epoch>|<endpoint>|<version>|<dtype>|<metric>|<model>"
(the model last, so a "|" in a model's name cannot shift the other parts; version and dtype are the
variant that served, its pinned export version and that export's dtype, either empty when not
known). Metrics are the UsageBucket counter fields: requests, succeeded, rejected, failed, inputs,
tokens, cached_inputs, cached_tokens (of inputs and tokens, those the embedding cache answered),
latency_ms_total. Fields written before the variant was recorded,
"<tenant>|<key>|<hour>|<endpoint>|<metric>|<model>" (a process of the previous release during a
deploy, a job chunk's increments kept with its result), are still read: their variant is empty.

Fold (`usage_fold`, run by Celery beat through embeddings.tasks): the counters move into UsageBucket
rows exactly once, whatever crashes when (see "The fold" below).

Read (`usage_for_tenant`, behind GET /v1/usage): one tenant's rows plus its counters still in Redis;
`usage_by_tenant`, every tenant's totals alike (the admin's operations overview).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import Literal, TypeVar

import redis
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Max, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from embeddings.models import ApiKey, Tenant, UsageBucket, UsageFold
from embeddings.redis import keys as redis_keys
from embeddings.redis import operations
from embeddings.redis.connections import redis_sync
from embeddings.redis.transport import operation_run_sync

logger = logging.getLogger(__name__)

LIVE_USAGE_KEY = redis_keys.LIVE_USAGE
FIELD_SEPARATOR = "|"
# UsageBucket's model_version and model_dtype columns: a longer value could never be folded.
MODEL_VERSION_MAX_LENGTH = UsageBucket._meta.get_field("model_version").max_length
MODEL_DTYPE_MAX_LENGTH = UsageBucket._meta.get_field("model_dtype").max_length

Outcome = Literal["succeeded", "rejected", "failed"]
T = TypeVar("T")


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
    # Of inputs and tokens, those answered from the embedding cache (counted in both).
    cached_inputs: int = 0
    cached_tokens: int = 0
    # The variant that served (the catalog's ModelVariant): pinned export version, its dtype; "" unknown.
    model_version: str = ""
    model_dtype: str = ""

    def hour_epoch(self) -> int:
        at = time.time() if self.at is None else self.at
        return int(at // 3600 * 3600)


def _field_head(event: UsageEvent) -> str:
    """What every field of the event's bucket starts with, up to its metric."""
    key = "" if event.api_key_id is None else str(event.api_key_id)
    version = event.model_version if _is_recordable_version(event.model_version) else ""
    dtype = event.model_dtype if _is_recordable_dtype(event.model_dtype) else ""
    parts = (str(event.tenant_id), key, str(event.hour_epoch()), event.endpoint, version, dtype, "")
    return FIELD_SEPARATOR.join(parts)


def _is_recordable_version(version: str) -> bool:
    if version == "":
        return True
    return len(version) <= MODEL_VERSION_MAX_LENGTH and version.isascii() and version.isdigit()


def _is_recordable_dtype(dtype: str) -> bool:
    # A separator would shift the parts after it; a longer one than its column could never be folded.
    return len(dtype) <= MODEL_DTYPE_MAX_LENGTH and FIELD_SEPARATOR not in dtype


def usage_increments(event: UsageEvent) -> dict[str, int]:
    """The hash fields this event adds to, and by how much (zero counters are left out)."""
    counters = {
        "requests": 1,
        event.outcome: 1,
        "inputs": event.inputs,
        "tokens": event.tokens,
        "cached_inputs": event.cached_inputs,
        "cached_tokens": event.cached_tokens,
        "latency_ms_total": max(0, event.latency_ms),
    }
    head, tail = _field_head(event), FIELD_SEPARATOR + event.model
    return {head + metric + tail: amount for metric, amount in counters.items() if amount}


def usage_count_once(*, owner: str, unit: int, increments: dict[str, int], ttl_s: int) -> bool:
    """Add `increments` to the live counters unless unit `unit` of `owner` (a job's chunk) was
    counted before; True if counted now. The marker and the counters change in one script, so
    a crash leaves both or neither. The marker lives ttl_s: offer no unit again after that."""
    operation = operations.usage_count_once(owner=owner, unit=unit, increments=increments, ttl_s=ttl_s)
    return operation_run_sync(operation, redis_sync())


def usage_count_forget(*, owner: str, units: list[int]) -> None:
    """Forget that these units of `owner` were counted, so that each counts once more: a failed
    job's failed chunks run again (their first run's usage was counted and stays counted; the
    caller makes sure none of it is still waiting to be)."""
    operation_run_sync(operations.usage_count_forget(owner=owner, units=units), redis_sync())


# --- The fold: Redis counters -> UsageBucket rows -------------------------------------------------
#
# 1. Claim: one Lua script renames the live hash to the batch's hash and adds the id to the
#    batches set (atomic: a HINCRBY lands either in the batch or in a fresh live hash).
# 2. Add: in one database transaction, insert UsageFold(batch_id) and add every counter of the
#    batch to its UsageBucket row (F() update, or create).
# 3. Forget: after the commit, delete the batch in Redis.
# A fold first finishes every batch a crashed fold left in the batches set: one with a UsageFold
# row was counted already and is only forgotten; one without is added. So a crash anywhere loses
# nothing and counts nothing twice (UsageFold.batch_id is unique: two folds racing on one leftover
# batch cannot both commit it).

FOLDING_BATCHES_KEY = redis_keys.FOLDING_BATCHES
COUNTER_METRICS = (
    "requests",
    "succeeded",
    "rejected",
    "failed",
    "inputs",
    "tokens",
    "cached_inputs",
    "cached_tokens",
    "latency_ms_total",
)
# A UsageFold row guards its batch only while the batch is still in Redis (gone milliseconds after
# the commit); older rows whose batch is gone are deleted, so the table stays small.
USAGE_FOLD_RECORDS_KEPT = timedelta(days=7)


@dataclass(frozen=True)
class BucketKey:
    tenant_id: int
    api_key_id: int | None
    model: str
    endpoint: str
    hour_epoch: int
    model_version: str = ""
    model_dtype: str = ""


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
    if parts[4] in COUNTER_METRICS:
        # Written before the variant was recorded: a metric where a version (digits or empty) now is.
        tenant, key, hour, endpoint, metric, model = parts
        version = dtype = ""
    else:
        parts = field.split(FIELD_SEPARATOR, maxsplit=7)
        if len(parts) != 8:
            return None
        tenant, key, hour, endpoint, version, dtype, metric, model = parts
        if metric not in COUNTER_METRICS:
            return None
        if not (_is_recordable_version(version) and _is_recordable_dtype(dtype)):
            return None
    try:
        bucket = BucketKey(int(tenant), int(key) if key else None, model, endpoint, int(hour), version, dtype)
    except ValueError:
        return None
    return bucket, metric


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def counters_from_hash(flat: dict | list, *, tenant_id: int | None = None) -> tuple[Counters, int]:
    """Counters by bucket from a usage hash (a dict, a list of (field, amount) pairs, or HGETALL's
    flat list); the second value counts unreadable fields. With tenant_id, only that tenant's
    buckets."""
    if isinstance(flat, dict):
        items = flat.items()
    elif flat and isinstance(flat[0], tuple):
        items = flat
    else:
        items = zip(flat[::2], flat[1::2], strict=True)
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


def _claim_live_counters(client: redis.Redis) -> str | None:
    """Rename the live hash to a new batch; its id, or None when nothing was counted since."""
    batch_id = uuid.uuid4().hex
    return batch_id if operation_run_sync(operations.usage_fold_claim(batch_id), client) else None


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
    # One order for every fold: two folds updating the same rows lock them alike, never crosswise
    # (a deadlock PostgreSQL would break by failing one of them).
    for bucket, metrics in sorted(merged.items(), key=lambda item: _bucket_order(item[0])):
        lookup = {
            "tenant_id": bucket.tenant_id,
            "api_key_id": bucket.api_key_id,
            "model": bucket.model,
            "model_version": bucket.model_version,
            "model_dtype": bucket.model_dtype,
            "endpoint": bucket.endpoint,
            "hour": datetime.fromtimestamp(bucket.hour_epoch, tz=UTC),
        }
        additions = {metric: amount for metric, amount in metrics.items() if amount}
        updated = UsageBucket.objects.filter(**lookup).update(
            **{metric: F(metric) + amount for metric, amount in additions.items()}
        )
        if not updated:
            _bucket_create_or_add(lookup, additions)
    return len(merged), dropped


def _bucket_order(bucket: BucketKey) -> tuple:
    return (
        bucket.tenant_id,
        bucket.api_key_id or 0,
        bucket.model,
        bucket.model_version,
        bucket.model_dtype,
        bucket.endpoint,
        bucket.hour_epoch,
    )


def _bucket_create_or_add(lookup: dict, additions: dict[str, int]) -> None:
    """Create the bucket row, or add to it if a concurrent fold created it first.

    Under PostgreSQL's READ COMMITTED the other fold's uncommitted row is invisible to the UPDATE
    before, and this INSERT waits for that fold, then fails on the unique constraint: the savepoint
    keeps this fold's transaction usable, and the UPDATE now sees the committed row.
    """
    try:
        with transaction.atomic():
            UsageBucket.objects.create(**lookup, **additions)
    except IntegrityError:
        updated = UsageBucket.objects.filter(**lookup).update(
            **{metric: F(metric) + amount for metric, amount in additions.items()}
        )
        if not updated:
            raise


def _forget_batch(client: redis.Redis, batch_id: str) -> None:
    operation_run_sync(operations.usage_fold_forget(batch_id), client)


def _fold_batch(client: redis.Redis, batch_id: str) -> tuple[int, int]:
    """Add one claimed batch to the database once, then forget it: (rows, dropped counters)."""
    if UsageFold.objects.filter(batch_id=batch_id).exists():
        _forget_batch(client, batch_id)  # a fold crashed after its commit: counted already
        return 0, 0
    counters, unreadable = counters_from_hash(
        operation_run_sync(operations.usage_fold_read(batch_id), client)
    )
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
        # Only a committed UsageFold of this batch means it was counted: anything else keeps the
        # batch in Redis for the next fold.
        if not UsageFold.objects.filter(batch_id=batch_id).exists():
            raise
        logger.info("usage fold: batch %s was folded by another fold meanwhile", batch_id)
        rows, dropped = 0, 0
    _forget_batch(client, batch_id)
    return rows, dropped + unreadable


def usage_fold() -> UsageFoldResult:
    """Move every counter from Redis into UsageBucket rows, exactly once (see above)."""
    client = redis_sync()
    batch_ids = operation_run_sync(operations.usage_fold_batches(), client)
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
    _prune_fold_records(client)
    return UsageFoldResult(batches=len(batch_ids), buckets=rows, dropped=dropped)


def _prune_fold_records(client: redis.Redis) -> None:
    still_in_redis = operation_run_sync(operations.usage_fold_batches(), client)
    cutoff = timezone.now() - USAGE_FOLD_RECORDS_KEPT
    UsageFold.objects.filter(folded_at__lt=cutoff).exclude(batch_id__in=still_in_redis).delete()


# --- Reading a tenant's usage ---------------------------------------------------------------------

USAGE_GROUPINGS = ("day", "model", "variant", "key")
# A fold committing while usage_for_tenant reads could make it count a batch twice or not at all;
# it then reads again (folds are a minute apart, so once is almost always enough).
_READ_ATTEMPTS = 3

_SUM_FIELDS = {metric: Sum(metric) for metric in COUNTER_METRICS}


@dataclass(frozen=True)
class UsageRow:
    """One group's counters: `group` is a date (day), a model name (model), (model name, version,
    dtype) (variant: "" where not recorded) or a key id or None (key)."""

    group: date | str | tuple[str, str, str] | int | None
    counters: dict[str, int]


@dataclass(frozen=True)
class TenantUsage:
    totals: dict[str, int]
    rows: list[UsageRow]
    includes_unfolded: bool  # Redis's not yet folded counters are included
    key_names: dict[int, tuple[str, str]]  # key id -> (public id, name) of the tenant's keys in rows


def hour_floor(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _unfolded_snapshot(client: redis.Redis) -> tuple[list, dict[str, list]]:
    """The live hash and every unfinished batch, read at one instant."""
    return operation_run_sync(operations.usage_snapshot(), client)


def _group_of(
    bucket: BucketKey, group_by: str, tenant_key_ids: set[int]
) -> date | str | tuple[str, str, str] | int | None:
    if group_by == "day":
        return datetime.fromtimestamp(bucket.hour_epoch, UTC).date()
    if group_by == "model":
        return bucket.model
    if group_by == "variant":
        return (bucket.model, bucket.model_version, bucket.model_dtype)
    # As the fold will file it: a key that is gone (or not this tenant's) counts as keyless.
    return bucket.api_key_id if bucket.api_key_id in tenant_key_ids else None


def _database_rows(buckets, group_by: str) -> dict:
    if group_by == "variant":
        rows = buckets.values("model", "model_version", "model_dtype").annotate(**_SUM_FIELDS).order_by()
        return {
            (row["model"], row["model_version"], row["model_dtype"]): {
                metric: row[metric] or 0 for metric in COUNTER_METRICS
            }
            for row in rows
        }
    if group_by == "day":
        grouped = buckets.annotate(group=TruncDate("hour", tzinfo=UTC))
    elif group_by == "model":
        grouped = buckets.annotate(group=F("model"))
    else:
        grouped = buckets.annotate(group=F("api_key_id"))
    rows = grouped.values("group").annotate(**_SUM_FIELDS).order_by()
    return {row["group"]: {metric: row[metric] or 0 for metric in COUNTER_METRICS} for row in rows}


def _folds_fingerprint() -> tuple[int, int | None]:
    """Changes whenever a fold commits: a new row raises the count and the highest id (a prune,
    which deletes only old rows, lowers the count alone, so the pair still differs)."""
    folds = UsageFold.objects.aggregate(count=Count("pk"), last=Max("pk"))
    return folds["count"], folds["last"]


def _with_unfolded(read_database: Callable[[], T], include_unfolded: bool) -> tuple[T, list, bool]:
    """`read_database()`'s result, the hashes of counters not yet folded into it (the live hash and
    every unfinished batch a committed fold has not counted), and whether they could be read.

    Read so that a fold committing meanwhile is counted exactly once: the database and Redis are
    read between two looks at the folds, and again if a fold committed in between. With Redis
    unreadable (or include_unfolded False), no hashes and False."""
    includes_unfolded = include_unfolded
    live: list = []
    batches: dict[str, list] = {}
    for _attempt in range(_READ_ATTEMPTS):
        folds_before = _folds_fingerprint()
        if includes_unfolded:
            try:
                live, batches = _unfolded_snapshot(redis_sync())
            except redis.exceptions.RedisError as error:
                logger.warning("usage: Redis unreadable, reporting folded usage only: %s", error)
                includes_unfolded = False
                live, batches = [], {}
        database = read_database()
        folded_ids = set(
            UsageFold.objects.filter(batch_id__in=list(batches)).values_list("batch_id", flat=True)
        )
        if _folds_fingerprint() == folds_before:
            break
    else:
        logger.warning("usage: folds kept committing while reading; numbers may be off by one fold")
    if not includes_unfolded:
        return database, [], False
    return database, [live, *(fields for batch, fields in batches.items() if batch not in folded_ids)], True


def usage_for_tenant(
    *,
    tenant_id: int,
    start: datetime,
    end: datetime,
    group_by: str,
    api_key_id: int | None = None,
    include_unfolded: bool = True,
) -> TenantUsage:
    """One tenant's usage in the hours that start in [start, end) (start rounded down to its hour),
    grouped by UTC day, model, model variant (name, version, dtype) or key; only this tenant's rows,
    whatever api_key_id says.

    With include_unfolded, counters still in Redis (not yet folded) are added, so the numbers are
    up to date; when Redis cannot be read they are left out and includes_unfolded is False.
    """
    if group_by not in USAGE_GROUPINGS:
        raise ValueError(f"group_by must be one of {USAGE_GROUPINGS}")
    first_hour = hour_floor(start)
    buckets = UsageBucket.objects.filter(tenant_id=tenant_id, hour__gte=first_hour, hour__lt=end)
    if api_key_id is not None:
        buckets = buckets.filter(api_key_id=api_key_id)
    tenant_key_ids = set(ApiKey.objects.filter(tenant_id=tenant_id).values_list("pk", flat=True))

    by_group, pending, includes_unfolded = _with_unfolded(
        lambda: _database_rows(buckets, group_by), include_unfolded
    )
    first_epoch, end_epoch = first_hour.timestamp(), end.timestamp()
    for flat in pending:
        counters, _ = counters_from_hash(flat, tenant_id=tenant_id)
        for bucket, metrics in counters.items():
            if not first_epoch <= bucket.hour_epoch < end_epoch:
                continue
            if api_key_id is not None and bucket.api_key_id != api_key_id:
                continue
            target = by_group.setdefault(
                _group_of(bucket, group_by, tenant_key_ids), dict.fromkeys(COUNTER_METRICS, 0)
            )
            for metric, amount in metrics.items():
                target[metric] += amount

    def order(item):
        group, counters = item
        if group_by == "key":
            return (group is None, -counters["tokens"], group or 0)
        if group_by == "variant":
            model, version, dtype = group
            return (model, len(version), version, dtype)  # versions in numeric order, unrecorded first
        return (group,)

    rows = [UsageRow(group, counters) for group, counters in sorted(by_group.items(), key=order)]
    totals = {metric: sum(row.counters[metric] for row in rows) for metric in COUNTER_METRICS}
    row_keys = {row.group for row in rows if group_by == "key" and row.group is not None}
    key_names = {
        pk: (public_id, name)
        for pk, public_id, name in ApiKey.objects.filter(tenant_id=tenant_id, pk__in=row_keys).values_list(
            "pk", "public_id", "name"
        )
    }
    return TenantUsage(totals=totals, rows=rows, includes_unfolded=includes_unfolded, key_names=key_names)


# --- Every tenant's usage (the admin's operations overview) ---------------------------------------

TENANT_TOTALS = ("requests", "rejected", "tokens")


@dataclass(frozen=True)
class TenantsUsage:
    """tenant id -> {requests, rejected, tokens} of each tenant with usage in the hours read."""

    by_tenant: dict[int, dict[str, int]]
    includes_unfolded: bool  # Redis's not yet folded counters are included


def usage_by_tenant(*, start: datetime, end: datetime, include_unfolded: bool = True) -> TenantsUsage:
    """Every tenant's requests, refusals and tokens in the hours that start in [start, end) (start
    rounded down to its hour): one query grouped by tenant over the UsageBucket rows, plus the
    counters still in Redis, read as usage_for_tenant reads them."""
    first_hour = hour_floor(start)
    buckets = UsageBucket.objects.filter(hour__gte=first_hour, hour__lt=end)

    def read_database() -> dict[int, dict[str, int]]:
        rows = buckets.values("tenant_id").annotate(**{name: Sum(name) for name in TENANT_TOTALS}).order_by()
        return {row["tenant_id"]: {name: row[name] or 0 for name in TENANT_TOTALS} for row in rows}

    by_tenant, pending, includes_unfolded = _with_unfolded(read_database, include_unfolded)
    first_epoch, end_epoch = first_hour.timestamp(), end.timestamp()
    for flat in pending:
        counters, _ = counters_from_hash(flat)
        for bucket, metrics in counters.items():
            if first_epoch <= bucket.hour_epoch < end_epoch:
                totals = by_tenant.setdefault(bucket.tenant_id, dict.fromkeys(TENANT_TOTALS, 0))
                for name in TENANT_TOTALS:
                    totals[name] += metrics[name]
    return TenantsUsage(by_tenant=by_tenant, includes_unfolded=includes_unfolded)
