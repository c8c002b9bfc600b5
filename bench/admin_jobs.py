"""The admin's jobs list with 100,000 jobs in PostgreSQL: how long each page takes, and its queries.

Run: `.venv/bin/python bench/admin_jobs.py [--jobs N] [--rounds R]`. Starts a throwaway PostgreSQL
cluster (tests/postgres_server.py: Debian's postgresql, as the tests do), migrates it, inserts N
jobs (default 100,000) of 50 tenants and 2 models, spread over the last 90 days, each with its
storage hold, ANALYZEs the tables, then renders the jobs changelist in this process as a superuser
(Django's test client: the whole admin view and its template, no network, no Redis) R times per
page (default 7, after one unmeasured warm-up) and prints the median and slowest time, the number of
queries, the time PostgreSQL took for them and the slowest one. Writes bench/results/admin_jobs.json.
`--without-newest-first-index` drops the index migration 0018 adds first, to measure what it buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embeddings.tooling.triton_server import free_port  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402

TENANTS = 50
BATCH = 5_000
# Of every 100 jobs: mostly finished, a few running, as on a service that has run a while.
STATUSES = ["completed"] * 80 + ["failed"] * 8 + ["cancelled"] * 4 + ["expired"] * 4 + ["running"] * 3
STATUSES += ["queued"]


def fill(jobs: int) -> dict:
    """The tenants, two models and `jobs` jobs with their holds; what the pages filter on."""
    from django.utils import timezone

    from embeddings.models import EmbeddingJob, EmbeddingModel, JobStorageHold, Tenant

    tenants = Tenant.objects.bulk_create(
        Tenant(name=f"Tenant {number}", slug=f"tenant-{number}") for number in range(TENANTS)
    )
    models = [
        EmbeddingModel.objects.create(name=name, triton_model=name, dimensions=384, max_tokens=256)
        for name in ("all-MiniLM-L6-v2", "bge-small")
    ]
    now = timezone.now()
    for start in range(0, jobs, BATCH):
        rows, holds = [], []
        for index in range(start, min(start + BATCH, jobs)):
            status = STATUSES[index % len(STATUSES)]
            total = 1 + index % 5_000
            done = total if status in ("completed", "expired") else total // 2
            tenant = tenants[index % TENANTS]
            public_id = f"job_{index:024d}"
            rows.append(
                EmbeddingJob(
                    public_id=public_id,
                    tenant=tenant,
                    model=models[index % 2],
                    status=status,
                    total=total,
                    chunk_size=256,
                    chunks=-(-total // 256),
                    dims=384,
                    completed=done - (done // 10 if status == "failed" else 0),
                    failed=done // 10 if status == "failed" else 0,
                    prompt_tokens=done * 12,
                    created_at=now - timedelta(seconds=90 * 86400 * index / jobs),
                    expires_at=now + timedelta(days=7),
                    callback_url="https://hooks.example.com/x" if index % 7 == 0 else "",
                    callback_error="the receiver answered 503" if index % 49 == 0 else "",
                )
            )
            holds.append(
                JobStorageHold(
                    public_id=public_id,
                    tenant=tenant,
                    stored_bytes=total * 1536 + 4096,
                    input_bytes=total * 40,
                    kept_bytes=4096,
                    result_bytes=total * 1536,
                )
            )
        EmbeddingJob.objects.bulk_create(rows)
        JobStorageHold.objects.bulk_create(holds)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    newest = EmbeddingJob.objects.order_by("-created_at").first()
    return {"tenant": tenants[7].pk, "model": models[1].pk, "newest": newest}


def measure(client, url: str, rounds: int) -> dict:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    times, sql = [], []
    for _ in range(rounds):
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
        sql.append(sum(float(query["time"]) for query in queries) * 1000)
    slowest = max(queries, key=lambda query: float(query["time"]))
    return {
        "slowest_query": f"{float(slowest['time']) * 1000:.0f} ms: {slowest['sql'][:300]}",
        "url": url,
        "median_ms": round(statistics.median(times), 1),
        "slowest_ms": round(max(times), 1),
        "queries": len(queries),
        "sql_median_ms": round(statistics.median(sql), 1),
        "rows_shown": response.content.decode().count('class="field-public_id"'),
    }


def migrated_admin_client(*, drop_indexes: tuple[str, ...] = ()):
    """Django set up on the environment's DATABASE_URL, migrated less `drop_indexes` (to measure
    what an index buys), and a test client logged in as a new superuser."""
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        for index in drop_indexes:
            cursor.execute(f"DROP INDEX {index}")
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "x"))
    return client


def measure_pages(client, pages: dict[str, str], rounds: int) -> dict[str, dict]:
    """`measure` each page (name -> URL), printing a line for each."""
    results = {}
    for name, url in pages.items():
        results[name] = row = measure(client, url, rounds)
        print(
            f"{name:40} median {row['median_ms']:7.1f} ms  slowest {row['slowest_ms']:7.1f} ms  "
            f"{row['queries']} queries, SQL {row['sql_median_ms']:6.1f} ms  {row['rows_shown']} rows"
        )
        print(f"    slowest query {row['slowest_query'][:160]}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--without-newest-first-index",
        action="store_true",
        help="drop the index migration 0018 adds, to measure what it buys",
    )
    args = parser.parse_args()
    with PostgresServer(port=free_port()) as server:
        os.environ["DATABASE_URL"] = server.create_database("bench_admin")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
        client = migrated_admin_client(
            drop_indexes=("job_newest_first",) if args.without_newest_first_index else ()
        )
        from django.urls import reverse

        started = time.perf_counter()
        facts = fill(args.jobs)
        print(f"{args.jobs:,} jobs inserted in {time.perf_counter() - started:.0f} s")
        base = reverse("admin:embeddings_embeddingjob_changelist")
        day = facts["newest"].created_at
        pages = {
            "the list (newest 50)": base,
            "a tenant's": f"{base}?tenant__id__exact={facts['tenant']}",
            "active (queued, running, cancelling)": f"{base}?status=active",
            "failed, of one model": f"{base}?status=failed&model__id__exact={facts['model']}",
            "one day (date hierarchy)": f"{base}?created_at__year={day.year}&created_at__month={day.month}"
            f"&created_at__day={day.day}",
            "by storage held, largest first": f"{base}?o=-7",
            "a job by its id": f"{base}?q={facts['newest'].public_id}",
            "page 1,000": f"{base}?p=1000",
            'with counts ("Show counts")': f"{base}?_facets=True",
        }
        results = measure_pages(client, pages, args.rounds)
        out = ROOT / "bench" / "results" / "admin_jobs.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"jobs": args.jobs, "rounds": args.rounds, "index": not args.without_newest_first_index}
        out.write_text(json.dumps({**report, "pages": results}, indent=2))


if __name__ == "__main__":
    main()
