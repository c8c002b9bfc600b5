"""The admin's operations overview with 1,000 tenants and 100,000 jobs in PostgreSQL: how long it takes.

Run: `.venv/bin/python bench/admin_overview.py [--tenants N] [--jobs N] [--days D] [--rounds R]`.
Starts a throwaway PostgreSQL cluster (tests/postgres_server.py, as the tests do), the two Redis
servers `make run` has and a Triton serving the checkout's model repository; migrates, registers
the local model and fills:

- N tenants (default 1,000), each with D days (default 30) of hourly usage rows up to this hour
  (one model, one endpoint: 24 rows a day a tenant, 720,000 for the defaults);
- the live usage counters of every tenant's current hour, as they stand between two folds;
- the last hour's activity of two models (20 requests a minute each, latencies spread 5 ms to
  2 s) and 429s of 100 tenants over four limits, written by the settle script;
- N jobs (default 100,000) of those tenants over 90 days, 4 % of them active.

ANALYZEs, then renders /admin/operations/ in this process as a superuser (Django's test client:
the whole view and template, the Redis servers and Triton on loopback) R times (default 9) after
one unmeasured warm-up, and prints the median and slowest time, the queries and the time PostgreSQL
took for them, and each source's time as the overview measured it. Writes
bench/results/admin_overview.json. `--without-hour-index` drops the index migration 0020 adds first,
to measure what it buys; `--explain` prints PostgreSQL's plan of today's tokens by tenant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from admin_jobs import measure as measure_page  # noqa: E402
from api import bench_triton  # noqa: E402

from embeddings.tooling.triton_server import free_port  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402

BATCH = 10_000
MODEL = "all-MiniLM-L6-v2"
# Of every 100 jobs: mostly finished, a few still to run.
STATUSES = ["completed"] * 84 + ["failed"] * 8 + ["cancelled"] * 2 + ["expired"] * 2 + ["running"] * 2
STATUSES += ["queued"] * 2
REFUSING_LIMITS = [
    ("tenant", "requests_per_second"),
    ("tenant", "tokens_per_minute"),
    ("key", "tokens_per_day"),
    ("tenant", "max_concurrent_requests"),
]


def fill_database(tenants: int, days: int, jobs: int) -> list[int]:
    """The tenants, their hourly usage rows and their jobs; the tenants' ids."""
    from django.db import connection
    from django.utils import timezone

    from embeddings.models import EmbeddingJob, EmbeddingModel, Tenant, UsageBucket

    made = Tenant.objects.bulk_create(
        Tenant(name=f"Tenant {number:04d}", slug=f"tenant-{number:04d}") for number in range(tenants)
    )
    ids = [tenant.pk for tenant in made]
    this_hour = timezone.now().astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [this_hour - timedelta(hours=back) for back in range(days * 24)]
    rows = []
    for tenant_index, tenant in enumerate(ids):
        for hour_index, hour in enumerate(hours):
            requests = 1 + (tenant_index * 7 + hour_index) % 50
            rows.append(
                UsageBucket(
                    tenant_id=tenant, model=MODEL, model_version="1", model_dtype="float32",
                    endpoint="openai", hour=hour, requests=requests, succeeded=requests, inputs=requests * 4,
                    tokens=requests * 40 * (1 + tenant_index % 13), latency_ms_total=requests * 9,
                )
            )  # fmt: skip
        if len(rows) >= BATCH:
            UsageBucket.objects.bulk_create(rows)
            rows = []
    UsageBucket.objects.bulk_create(rows)
    model = EmbeddingModel.objects.get(name=MODEL)
    now = timezone.now()
    for start in range(0, jobs, BATCH):
        EmbeddingJob.objects.bulk_create(
            EmbeddingJob(
                public_id=f"job_{index:024d}", tenant_id=ids[index % len(ids)], model=model,
                status=STATUSES[index % len(STATUSES)], total=1 + index % 5_000, chunk_size=256,
                completed=(1 + index % 5_000) // 2,
                created_at=now - timedelta(seconds=90 * 86400 * index / jobs),
            )
            for index in range(start, min(start + BATCH, jobs))
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return ids


def fill_redis(ids: list[int]) -> None:
    """Every tenant's unfolded usage of this hour, and the last hour's activity of two models."""
    from embeddings.errors.service import QuotaExceeded
    from embeddings.redis.connections import redis_sync
    from embeddings.services.quotas.activity import activity_counters
    from embeddings.services.quotas.limits import quota_release_sync
    from embeddings.services.quotas.usage import LIVE_USAGE_KEY, UsageEvent, usage_increments

    client = redis_sync()
    with client.pipeline(transaction=False) as pipeline:
        for tenant in ids:
            event = UsageEvent(tenant, None, MODEL, "openai", "succeeded", 4, 160, 12, model_version="1")
            for field, amount in usage_increments(event).items():
                pipeline.hincrby(LIVE_USAGE_KEY, field, amount * 3)
        pipeline.execute()
    randomness = random.Random(37)
    now = time.time()
    for minute in range(60):
        at = now - minute * 60
        for model in (MODEL, "bge-small"):
            for _ in range(20):
                latency = int(5 * 400 ** randomness.random())  # 5 ms to 2 s, log-uniform
                event = UsageEvent(ids[0], None, model, "openai", "succeeded", 1, 30, latency, at=at)
                quota_release_sync(reservation=None, refund=False, activity=activity_counters(event))
        for tenant in ids[:100]:
            if randomness.random() < 0.1:
                level, limit = randomness.choice(REFUSING_LIMITS)
                refusal = QuotaExceeded("", reason="", kind="", retry_after_s=1, limit=limit, level=level)
                event = UsageEvent(tenant, None, MODEL, "openai", "rejected", at=at)
                quota_release_sync(reservation=None, refund=False, activity=activity_counters(event, refusal))


def measure(client, url: str, rounds: int) -> dict:
    """The jobs bench's timing of a page (median, slowest, queries, SQL), what the page shows, and
    each source's time as the overview measures it."""
    from embeddings.services.operations.overview import operations_overview

    timed = measure_page(client, url, rounds)
    response = client.get(url)
    page = response.content.decode()
    for shown in ('class="model-row"', 'data-tenant="tenant-', "<meter"):
        assert shown in page, shown
    assert "source-error" not in page.split('id="operations-models"')[1].split("</table>")[0]
    sources: dict[str, list[float]] = {}
    for _ in range(rounds):
        for source, ms in operations_overview().read_ms.items():
            sources.setdefault(source, []).append(ms)
    return {
        **{
            name: timed[name]
            for name in ("median_ms", "slowest_ms", "queries", "sql_median_ms", "slowest_query")
        },
        "sources_median_ms": {
            source: round(statistics.median(values), 1) for source, values in sources.items()
        },
    }


def explain_tokens_today() -> None:
    from django.db.models import Sum
    from django.utils import timezone

    from embeddings.models import UsageBucket
    from embeddings.services.quotas.reports import utc_day_start

    now = timezone.now()
    today = UsageBucket.objects.filter(hour__gte=utc_day_start(now), hour__lt=now)
    grouped = today.values("tenant_id").annotate(**{name: Sum(name) for name in ("requests", "tokens")})
    print(grouped.order_by().explain(analyze=True))


def run(args: argparse.Namespace) -> dict:
    """Fill the database and Redis, then time the page."""
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse

    call_command("migrate", verbosity=0)
    if args.without_hour_index:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX usage_bucket_hour")
    call_command("register_local_model", stdout=open(os.devnull, "w"))  # noqa: SIM115
    started = time.perf_counter()
    ids = fill_database(args.tenants, args.days, args.jobs)
    print(
        f"{args.tenants:,} tenants, {args.tenants * args.days * 24:,} usage rows and "
        f"{args.jobs:,} jobs inserted in {time.perf_counter() - started:.0f} s"
    )
    fill_redis(ids)
    if args.explain:
        explain_tokens_today()
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "x"))
    return measure(client, reverse("admin-operations-overview"), args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--days", type=int, default=30, help="days of hourly usage rows per tenant")
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--without-hour-index", action="store_true", help="drop the index 0020 adds")
    parser.add_argument("--explain", action="store_true", help="print the plan of today's tokens by tenant")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-overview-"))
    (workdir / "redis").mkdir()
    (workdir / "redis-jobs").mkdir()
    with PostgresServer(port=free_port()) as server:
        # Every setting in the environment before anything reads Django's settings (the servers do).
        from embeddings.tooling.local_redis import RedisServer

        triton = bench_triton(workdir)
        # Sized as `make run` sizes them (RUNSTACK_REDIS_MAXMEMORY_MB, RUNSTACK_JOB_STORE_MAXMEMORY_MB).
        critical = RedisServer(
            port=free_port(), data_dir=workdir / "redis", persistent=False, maxmemory_mb=256
        )
        job_store = RedisServer(
            port=free_port(), data_dir=workdir / "redis-jobs", persistent=False, maxmemory_mb=2048
        )
        os.environ |= {
            "DATABASE_URL": server.create_database("bench_overview"),
            "TRITON_SERVER_URL": triton.grpc_target,
            "REDIS_URL": critical.url,
            "JOB_STORE_URL": job_store.url,
        }
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
        triton.start()
        try:
            with critical, job_store:
                triton.wait_until_ready(300)
                result = run(args)
        finally:
            triton.stop()
    print(
        f"/admin/operations/: median {result['median_ms']} ms, slowest {result['slowest_ms']} ms; "
        f"{result['queries']} queries, SQL {result['sql_median_ms']} ms (median)"
    )
    print(f"    slowest query {result['slowest_query'][:200]}")
    print(f"    each source (median ms, as the overview measures it): {result['sources_median_ms']}")
    suffix = "" if not args.without_hour_index else "-without-hour-index"
    out = ROOT / "bench" / "results" / f"admin_overview{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "tenants": args.tenants,
        "days": args.days,
        "jobs": args.jobs,
        "rounds": args.rounds,
        "hour_index": not args.without_hour_index,
    }
    out.write_text(json.dumps({**report, "measured_at": datetime.now(UTC).isoformat(), **result}, indent=2))


if __name__ == "__main__":
    main()
