"""The admin's batches and files lists with 100,000 batches in PostgreSQL: each page's time and queries.

Run: `.venv/bin/python bench/admin_batches.py [--batches N] [--rounds R]`. As bench/admin_jobs.py
(whose `measure` it uses): a throwaway PostgreSQL cluster, migrated; N batches (default 100,000) of
50 tenants over the last 90 days, each with its input file, the finished ones with an output file
and most with an error file, the running ones with their job; ANALYZE; then each page rendered in
this process as a superuser R times (default 7, after one warm-up): median and slowest time, the
queries and their time. Writes bench/results/admin_batches.json. `--without-newest-first-indexes`
drops the two indexes migration 0019 adds first, to measure what they buy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.admin_jobs import measure_pages, migrated_admin_client  # noqa: E402
from embeddings.tooling.triton_server import free_port  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402

TENANTS = 50
BATCH = 5_000
# Of every 100 batches: mostly finished, a few running, as on a service that has run a while.
STATUSES = ["completed"] * 85 + ["failed"] * 5 + ["cancelled"] * 4 + ["expired"] * 2 + ["in_progress"] * 3
STATUSES += ["validating"]
FINISHED_WITH_FILES = ("completed", "cancelled", "expired")


def fill(batches: int) -> dict:
    """The tenants, a model, `batches` batches with their files (and jobs, while they run)."""
    from django.utils import timezone

    from embeddings.models import Batch, EmbeddingJob, EmbeddingModel, StoredFile, Tenant

    tenants = Tenant.objects.bulk_create(
        Tenant(name=f"Tenant {number}", slug=f"tenant-{number}") for number in range(TENANTS)
    )
    model = EmbeddingModel.objects.create(
        name="all-MiniLM-L6-v2", triton_model="minilm", dimensions=384, max_tokens=256
    )
    now = timezone.now()

    def stored(index: int, role: str, tenant, created, purpose: str) -> StoredFile:
        return StoredFile(
            public_id=f"file-{role[0]}{index:023d}",
            tenant=tenant,
            purpose=purpose,
            filename=f"{role}-{index}.jsonl",
            bytes=1_000 + index % 100_000,
            storage_name=f"tenant-{tenant.pk}/{role}-{index}",
            created_at=created,
            expires_at=None if role == "input" else created + timedelta(days=30),
        )

    for start in range(0, batches, BATCH):
        inputs, outputs, errors, jobs, rows = {}, {}, {}, {}, []
        for index in range(start, min(start + BATCH, batches)):
            status = STATUSES[index % len(STATUSES)]
            tenant = tenants[index % TENANTS]
            created = now - timedelta(seconds=90 * 86400 * index / batches)
            inputs[index] = stored(index, "input", tenant, created, "batch")
            if status in FINISHED_WITH_FILES:
                outputs[index] = stored(index, "output", tenant, created, "batch_output")
                if index % 3:
                    errors[index] = stored(index, "error", tenant, created, "batch_output")
            if status == "in_progress":
                jobs[index] = EmbeddingJob(
                    public_id=f"job_{index:024d}", tenant=tenant, model=model, kind="batch",
                    status="running", total=500, completed=200, chunk_size=64, chunks=8,
                    created_at=created,
                )  # fmt: skip
        StoredFile.objects.bulk_create([*inputs.values(), *outputs.values(), *errors.values()])
        EmbeddingJob.objects.bulk_create(jobs.values())
        for index, input_file in inputs.items():
            status = STATUSES[index % len(STATUSES)]
            total = 1 + index % 5_000
            final = status not in ("in_progress", "validating")
            rows.append(
                Batch(
                    public_id=f"batch_{index:024d}",
                    tenant=input_file.tenant,
                    job=jobs.get(index),
                    input_file=input_file,
                    input_file_public_id=input_file.public_id,
                    output_file=outputs.get(index),
                    error_file=errors.get(index),
                    endpoint="/v1/embeddings",
                    completion_window="24h",
                    model=model.name,
                    status=status,
                    total=total,
                    completed=total - total // 50 if final else 0,
                    failed=total // 50 if final else 0,
                    invalid_lines=total // 100,
                    prompt_tokens=total * 12,
                    created_at=input_file.created_at,
                    expires_at=input_file.created_at + timedelta(hours=24),
                )
            )
        Batch.objects.bulk_create(rows)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    newest = (
        Batch.objects.order_by("-created_at").select_related("output_file").exclude(output_file=None).first()
    )
    return {"tenant": tenants[7].pk, "newest": newest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--without-newest-first-indexes",
        action="store_true",
        help="drop the indexes migration 0019 adds, to measure what they buy",
    )
    args = parser.parse_args()
    with PostgresServer(port=free_port()) as server:
        os.environ["DATABASE_URL"] = server.create_database("bench_admin")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
        indexes = ("batch_newest_first", "file_newest_first")
        client = migrated_admin_client(drop_indexes=indexes if args.without_newest_first_indexes else ())
        from django.urls import reverse

        started = time.perf_counter()
        facts = fill(args.batches)
        print(f"{args.batches:,} batches and their files inserted in {time.perf_counter() - started:.0f} s")
        batches = reverse("admin:embeddings_batch_changelist")
        files = reverse("admin:embeddings_storedfile_changelist")
        newest, day = facts["newest"], facts["newest"].created_at
        one_day = f"created_at__year={day.year}&created_at__month={day.month}&created_at__day={day.day}"
        pages = {
            "batches: the list (newest 50)": batches,
            "batches: a tenant's": f"{batches}?tenant__id__exact={facts['tenant']}",
            "batches: active": f"{batches}?status=active",
            "batches: one day (date hierarchy)": f"{batches}?{one_day}",
            "batches: a batch by its id": f"{batches}?q={newest.public_id}",
            "batches: by one of its files' id": f"{batches}?q={newest.output_file.public_id}",
            "batches: by its job's id": f"{batches}?q=job_{STATUSES.index('in_progress'):024d}",
            "batches: page 1,000": f"{batches}?p=1000",
            "files: the list (newest 50)": files,
            "files: a tenant's": f"{files}?tenant__id__exact={facts['tenant']}",
            "files: batch outputs, expired": f"{files}?purpose__exact=batch_output&expired=yes",
            "files: part of a name": f"{files}?q=output-4242",
            "files: page 1,000": f"{files}?p=1000",
        }
        results = measure_pages(client, pages, args.rounds)
        out = ROOT / "bench" / "results" / "admin_batches.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "batches": args.batches,
            "rounds": args.rounds,
            "indexes": not args.without_newest_first_indexes,
        }
        out.write_text(json.dumps({**report, "pages": results}, indent=2))


if __name__ == "__main__":
    main()
