"""The admin's operations overview, read in one call: what the service is doing now.

Each source is read as it is now, under its own bound; one that fails or does not answer in time
is named in its own section (the rest still shows), never an error page, as /ready does:

    models    the catalog (database) and each Triton replica's repository index: one RPC a replica,
              under READY_CHECK_TIMEOUT_S / 2, the replicas asked concurrently
    activity  the last minutes' requests of every web process, per model, and the last hour's
              refusals per tenant and limit (quotas/activity.py: one round trip to the critical Redis)
    tenants   today's tokens per tenant: one query grouped by tenant over the UsageBucket rows, plus
              the counters not yet folded (quotas/usage.py: one script on the critical Redis)
    jobs      the backlog by state (jobs/backlog.py: two aggregate queries over the status index)
    redis     each server's INFO memory and stats: the critical Redis, the job store (when it is
              another server) and the embedding cache (when it is on)

The remote reads run in threads while this thread reads the database; whatever has not answered
READY_CHECK_TIMEOUT_S after the start is reported as not answering (its thread ends at its own
client's deadline: REDIS_TIMEOUT_S, JOB_STORE_TIMEOUT_S, the replica's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

import redis
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from embeddings.models import EmbeddingModel, Tenant
from embeddings.redis.connections import redis_embedding_cache_sync, redis_job_store, redis_sync
from embeddings.redis.memory import RedisMemory, redis_memory
from embeddings.services.inference.clients import triton_sync_client
from embeddings.services.inference.serving import ModelServingState, serving_states
from embeddings.services.jobs.backlog import JobBacklog, job_backlog
from embeddings.services.quotas.activity import ModelMinute, RecentActivity, recent_activity
from embeddings.services.quotas.reports import utc_day_start
from embeddings.services.quotas.usage import usage_by_tenant
from embeddings.triton import TritonError

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How many tenants each "top" list shows.
TOP_TENANTS = 10
# Remote reads running at once: the replicas' own pool aside, activity and three Redis servers.
REMOTE_READS = 5


@dataclass(frozen=True)
class ReplicaReading:
    """One Triton replica's answer: each catalog model's state there, or why it did not answer."""

    endpoint: str
    states: dict[str, ModelServingState] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class ModelRow:
    name: str
    triton_model: str
    version: str  # pinned; "" for Triton's latest
    enabled: bool
    # In the order of OperationsOverview.replicas; None where that replica did not answer.
    replica_states: list[ModelServingState | None]
    minutes: list[ModelMinute]  # in the order of OperationsOverview.minutes

    @property
    def last_minute(self) -> ModelMinute:
        """The last complete minute (the current one is the last of `minutes`)."""
        return self.minutes[-2]


@dataclass(frozen=True)
class TenantTokens:
    tenant_id: int
    name: str
    slug: str
    tokens: int
    requests: int


@dataclass(frozen=True)
class TenantRefusals:
    tenant_id: int
    name: str
    slug: str
    refused: int
    by_limit: list[tuple[str, str, int]]  # (level, limit, refused), most refused first


@dataclass(frozen=True)
class RedisServer:
    role: str
    memory: RedisMemory | None
    error: str = ""


@dataclass(frozen=True)
class OperationsOverview:
    taken_at: datetime
    minutes: list[datetime]  # the chart's minutes (UTC starts), oldest first, the current one last
    models: list[ModelRow]
    replicas: list[ReplicaReading]
    triton_error: str  # the replicas could not be listed (a `dns:///` name that does not resolve)
    activity_error: str
    tenants_by_tokens: list[TenantTokens]
    tokens_include_unfolded: bool
    tokens_error: str
    tenants_by_refusals: list[TenantRefusals]
    backlog: JobBacklog | None
    backlog_error: str
    redis_servers: list[RedisServer]
    read_ms: dict[str, float]  # how long each source took


def _failure(error: BaseException) -> str:
    # The error's class only, as /ready says it: hosts and addresses stay in the log.
    return f"failed: {type(error).__name__}"


def _ask_replicas(models: list[EmbeddingModel]) -> list[ReplicaReading]:
    client = triton_sync_client()
    endpoints = client.replica_endpoints()  # resolving a `dns:///` name: blocking, hence here
    timeout_s = settings.READY_CHECK_TIMEOUT_S / 2

    def ask(endpoint: str) -> ReplicaReading:
        try:
            index = client.replica(endpoint, timeout_s=timeout_s).repository_index()
        except TritonError as error:
            logger.warning("operations overview: Triton replica %s: %s", endpoint, error)
            return ReplicaReading(endpoint, error=f"unreachable ({type(error).__name__})")
        return ReplicaReading(endpoint, {state.name: state for state in serving_states(models, index)})

    with ThreadPoolExecutor(min(8, max(1, len(endpoints))), thread_name_prefix="overview-replica") as pool:
        return list(pool.map(ask, endpoints))


def _server_of(client: redis.Redis) -> tuple:
    """Which server a client talks to (two databases of one server share its memory)."""
    options = client.connection_pool.connection_kwargs
    if "path" in options:
        return ("unix", options["path"])
    host = options.get("host", "localhost")
    return ("loopback" if host in {"localhost", "127.0.0.1", "::1"} else host, options.get("port", 6379))


def _redis_clients() -> list[tuple[str, Callable[[], redis.Redis]]]:
    critical, job_store = redis_sync(), redis_job_store()
    if _server_of(critical) == _server_of(job_store):
        servers = [("critical and job store (one server)", redis_sync)]
    else:
        servers = [("critical (REDIS_URL)", redis_sync), ("job store (JOB_STORE_URL)", redis_job_store)]
    if settings.EMBEDDING_CACHE:
        servers.append(("embedding cache", redis_embedding_cache_sync))
    return servers


class _Timed:
    """Runs reads, noting how long each took (ms)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def __call__(self, name: str, read: Callable[[], T]) -> Callable[[], T]:
        def timed() -> T:
            started = time.perf_counter()
            try:
                return read()
            finally:
                self.ms[name] = round((time.perf_counter() - started) * 1000, 1)

        return timed


def _outcome(future: Future, deadline: float, what: str) -> tuple[object, str]:
    """(result, "") or (None, why not): failed, or no answer by `deadline` (monotonic)."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic())), ""
    except Exception as error:
        if isinstance(error, TimeoutError) and not future.done():
            logger.warning("operations overview: %s did not answer in time", what)
            return None, f"no answer within {settings.READY_CHECK_TIMEOUT_S:g} s"
        logger.warning("operations overview: %s failed: %s", what, error)
        return None, _failure(error)


def _database(read: Callable[[], T], what: str) -> tuple[T | None, str]:
    try:
        return read(), ""
    except (DatabaseError, redis.RedisError) as error:
        logger.warning("operations overview: %s failed: %s", what, error)
        return None, _failure(error)


def _top_refused(activity: RecentActivity) -> list[tuple[int, int, list[tuple[str, str, int]]]]:
    ranked = sorted(
        ((tenant, sum(limits.values()), limits) for tenant, limits in activity.refusals.items()),
        key=lambda row: (-row[1], row[0]),
    )[:TOP_TENANTS]
    return [
        (
            tenant,
            total,
            sorted(((level, limit, n) for (level, limit), n in limits.items()), key=lambda r: -r[2]),
        )
        for tenant, total, limits in ranked
    ]


def operations_overview(*, now: datetime | None = None) -> OperationsOverview:
    """Everything the operations overview shows, each source read now (see the module docstring)."""
    now = now or timezone.now()
    started = time.monotonic()
    deadline = started + settings.READY_CHECK_TIMEOUT_S
    timed = _Timed()
    models = list(EmbeddingModel.objects.order_by("name"))
    pool = ThreadPoolExecutor(REMOTE_READS, thread_name_prefix="overview")
    try:
        replicas_future = pool.submit(timed("triton", lambda: _ask_replicas(models)))
        activity_future = pool.submit(timed("activity", lambda: recent_activity(now=now.timestamp())))
        memory_futures = [
            (role, pool.submit(timed(f"redis {role}", lambda connect=connect: redis_memory(connect()))))
            for role, connect in _redis_clients()
        ]

        database_started = time.perf_counter()
        tokens, tokens_error = _database(
            lambda: usage_by_tenant(start=utc_day_start(now), end=now), "today's tokens by tenant"
        )
        backlog, backlog_error = _database(job_backlog, "the job backlog")
        activity, activity_error = _outcome(activity_future, deadline, "the activity counters")
        top_tokens = (
            sorted(
                ((tenant, totals) for tenant, totals in tokens.by_tenant.items() if totals["tokens"]),
                key=lambda row: (-row[1]["tokens"], row[0]),
            )[:TOP_TENANTS]
            if tokens is not None
            else []
        )
        top_refused = _top_refused(activity) if activity is not None else []
        names, names_error = _database(
            lambda: {
                pk: (name, slug)
                for pk, name, slug in Tenant.objects.filter(
                    pk__in=[tenant for tenant, _ in top_tokens] + [tenant for tenant, *_ in top_refused]
                ).values_list("pk", "name", "slug")
            },
            "the tenants' names",
        )
        names = names or {}
        timed.ms["database"] = round((time.perf_counter() - database_started) * 1000, 1)

        replicas, triton_error = _outcome(replicas_future, deadline, "Triton's replicas")
        redis_servers = []
        for role, future in memory_futures:
            memory, error = _outcome(future, deadline, f"Redis ({role})")
            redis_servers.append(RedisServer(role, memory, error))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)

    current = int(now.timestamp() // 60)
    minutes = activity.minutes if activity is not None else list(range(current - 10, current + 1))
    replicas = replicas or []
    shown = [model for model in models if model.enabled or (activity and model.name in activity.models)]
    known = {model.name for model in models}
    model_rows = [
        ModelRow(
            name=model.name,
            triton_model=model.triton_model,
            version=model.triton_version,
            enabled=model.enabled,
            replica_states=[
                None if replica.error else replica.states.get(model.name) for replica in replicas
            ],
            minutes=_minutes_of(activity, model.name, len(minutes)),
        )
        for model in shown
    ]
    # Requests for a model the catalog no longer names (renamed, deleted) still show.
    model_rows += [
        ModelRow(name, "", "", False, [None] * len(replicas), _minutes_of(activity, name, len(minutes)))
        for name in sorted(set(activity.models) - known if activity is not None else ())
    ]

    def name_of(tenant: int) -> tuple[str, str]:
        return names.get(tenant, (f"tenant {tenant} (deleted)", ""))

    return OperationsOverview(
        taken_at=now,
        minutes=[datetime.fromtimestamp(minute * 60, UTC) for minute in minutes],
        models=model_rows,
        replicas=replicas,
        triton_error=triton_error,
        activity_error=activity_error,
        tenants_by_tokens=[
            TenantTokens(tenant, *name_of(tenant), totals["tokens"], totals["requests"])
            for tenant, totals in top_tokens
        ],
        tokens_include_unfolded=tokens is not None and tokens.includes_unfolded,
        tokens_error=tokens_error or names_error,
        tenants_by_refusals=[
            TenantRefusals(tenant, *name_of(tenant), total, by_limit)
            for tenant, total, by_limit in top_refused
        ],
        backlog=backlog,
        backlog_error=backlog_error,
        redis_servers=redis_servers,
        read_ms={**timed.ms, "total": round((time.monotonic() - started) * 1000, 1)},
    )


def _minutes_of(activity: RecentActivity | None, model: str, count: int) -> list[ModelMinute]:
    if activity is None or model not in activity.models:
        return [ModelMinute() for _ in range(count)]
    return activity.models[model]
