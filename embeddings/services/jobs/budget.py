"""Admission by bytes: what a job will hold in the job store, refused before anything is stored
when it would not fit its tenant's or the global budget, and given back as its data goes.

A job's need, computed at submission (job_storage_need):

    inputs   its texts exactly as stored (orjson per chunk), one key per chunk   freed when it ends
                                                                                 (a failed chunk's
                                                                                 at expiry)
    kept     its ids as stored (results name them) and its bookkeeping keys      kept until expiry
    results  inputs x bytes per stored vector (result_row_bytes),                kept until expiry
             one key per chunk

plus KEY_OVERHEAD_BYTES for each key. Redis's own count (MEMORY USAGE) of a finished job's keys
is within STORAGE_MARGIN of what is held for it (tests/services/test_job_storage.py measures it):
Redis rounds each value up to its allocator's size class, at most a quarter more.

Each admitted job has a JobStorageHold row. Admission sums the holds and inserts the new one in
one transaction that first takes a lock only admissions contend for (a table lock on PostgreSQL,
the database's write lock on SQLite), so two submissions racing for the last bytes cannot both
fit. Giving bytes back is one conditional UPDATE or DELETE of the job's row (exact, idempotent):

    job_storage_admit      at submission, before the inputs are stored
    job_storage_settle     the job ended (services/jobs/engine.py job_finalize): its inputs were deleted,
                           it holds its ids and the results it wrote (and a failed job the inputs
                           of its failed chunks, kept for a retry)
    job_storage_grow       an operator runs a failed job's failed chunks again: the results they
                           will write, admitted as a submission's are (operator.py)
    job_storage_release    its data deleted (the job deleted or expired, a submission undone):
                           nothing held
    job_storage_sweep      (beat, with the expiry) holds of submissions that died before their
                           job row was saved
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from embeddings.errors.service import StorageBudgetExceeded
from embeddings.models import EmbeddingJob, JobStorageHold, Tenant
from embeddings.result_dtypes import result_row_bytes
from embeddings.services.jobs.store import EncodedInputs

# Redis's own cost of a key beyond its value's bytes (the key name, its dict entry, the object
# header and expiry): MEMORY USAGE of a job's keys measured 88-104 bytes above their payloads.
KEY_OVERHEAD_BYTES = 100
# The job's bookkeeping keys (done set, progress hash, handoff, leases, ...): a few per job and a
# few bytes per chunk in sets and hashes.
BOOKKEEPING_BYTES_PER_JOB = 2048
BOOKKEEPING_BYTES_PER_CHUNK = 64
# MEMORY USAGE of a finished job's keys lies within accounted x (1 +/- this): jemalloc rounds a
# large value up to a size class at most 25% larger (README: "Sizing the job store").
STORAGE_MARGIN = 0.25
# A hold whose job row never appeared this long after admission belongs to a submission that died
# between the two; the sweep gives it back (a live submission saves its row within seconds).
ORPHANED_HOLD_AGE = timedelta(hours=1)


@dataclass(frozen=True)
class StorageNeed:
    """The bytes a job will hold in the job store, by what frees them."""

    input_bytes: int
    kept_bytes: int
    result_bytes: int

    @property
    def total(self) -> int:
        return self.input_bytes + self.kept_bytes + self.result_bytes


def job_storage_need(*, inputs: EncodedInputs, rows: int, dims: int, result_dtype: str) -> StorageNeed:
    """What a job of these encoded inputs, `rows` inputs of `dims`-wide vectors, will hold;
    `result_dtype` is how they are stored (result_dtypes.result_storage_name: float32, float16 or a
    quantised output type)."""
    chunks = len(inputs.texts)
    id_keys = 0 if inputs.ids is None else chunks
    return StorageNeed(
        input_bytes=inputs.text_bytes + chunks * KEY_OVERHEAD_BYTES,
        kept_bytes=inputs.id_bytes
        + id_keys * KEY_OVERHEAD_BYTES
        + BOOKKEEPING_BYTES_PER_JOB
        + chunks * BOOKKEEPING_BYTES_PER_CHUNK,
        result_bytes=rows * result_row_bytes(result_dtype, dims) + chunks * KEY_OVERHEAD_BYTES,
    )


def tenant_job_storage_budget(tenant: Tenant) -> int:
    """The tenant's budget: its own, or JOB_STORAGE_TENANT_BUDGET_BYTES."""
    if tenant.job_storage_budget_bytes is not None:
        return tenant.job_storage_budget_bytes
    return settings.JOB_STORAGE_TENANT_BUDGET_BYTES


def job_storage_used(*, tenant_id: int | None = None) -> int:
    """Bytes held in the job store: the tenant's, or everyone's (tenant_id None)."""
    holds = (
        JobStorageHold.objects.all()
        if tenant_id is None
        else JobStorageHold.objects.filter(tenant_id=tenant_id)
    )
    return holds.aggregate(total=Sum("stored_bytes"))["total"] or 0


@dataclass(frozen=True)
class TenantJobStorage:
    """What /v1/usage and the admin show of a tenant's job storage."""

    used_bytes: int
    budget_bytes: int

    @property
    def available_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)

    def as_dict(self) -> dict[str, int]:
        return {
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "available_bytes": self.available_bytes,
        }


def tenant_job_storage(*, tenant: Tenant) -> TenantJobStorage:
    return TenantJobStorage(
        used_bytes=job_storage_used(tenant_id=tenant.pk), budget_bytes=tenant_job_storage_budget(tenant)
    )


def size_text(count: int) -> str:
    """Bytes for people: 1.5 GiB, 12.0 MiB, 300 bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def _lock_admissions() -> None:
    """Serialise admissions until the transaction ends. PostgreSQL: a table lock that conflicts with
    itself and with writes to the holds (a release waits the few milliseconds an admission takes),
    not with reads. SQLite: its one write lock, taken now by a write that changes nothing (a read
    first would start a snapshot that a racing admission's commit makes stale)."""
    table = connection.ops.quote_name(JobStorageHold._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")
        else:
            cursor.execute(f"UPDATE {table} SET stored_bytes = stored_bytes WHERE 1 = 0")


def _refuse_unless_it_fits(tenant: Tenant, needed: int, *, what_needs: str) -> None:
    """Raise StorageBudgetExceeded unless `needed` more bytes fit the tenant's budget and the
    global one (the tenant's named first). Called under _lock_admissions."""
    budget = tenant_job_storage_budget(tenant)
    global_budget = settings.JOB_STORAGE_GLOBAL_BUDGET_BYTES
    used = job_storage_used(tenant_id=tenant.pk)
    if used + needed > budget:
        raise StorageBudgetExceeded(
            f"{what_needs} {size_text(needed)} of job storage; this tenant's job storage budget "
            f"is {size_text(budget)}, of which {size_text(used)} is in use. "
            + (
                "Delete finished jobs you no longer need (or wait for them to expire) and submit again."
                if needed <= budget
                else "Split the inputs into smaller jobs."
            ),
            budget="tenant",
            fits_when_empty=needed <= budget,
        )
    if job_storage_used() + needed > global_budget:
        # Other tenants' usage is theirs: only this job's size is named.
        raise StorageBudgetExceeded(
            f"{what_needs} {size_text(needed)} of job storage, more than the service's global "
            "job storage budget has free now; submit again later, or a smaller job.",
            budget="global",
            fits_when_empty=needed <= global_budget,
        )


def job_storage_admit(*, tenant: Tenant, public_id: str, need: StorageNeed) -> JobStorageHold:
    """Hold `need` for the job `public_id` of `tenant`, or raise StorageBudgetExceeded naming the
    budget it does not fit (the tenant's first). Exact under concurrent submissions."""
    needed = need.total
    with transaction.atomic():
        _lock_admissions()
        _refuse_unless_it_fits(tenant, needed, what_needs="This job needs")
        return JobStorageHold.objects.create(
            public_id=public_id,
            tenant=tenant,
            stored_bytes=needed,
            input_bytes=need.input_bytes,
            kept_bytes=need.kept_bytes,
            result_bytes=need.result_bytes,
        )


def job_storage_grow(*, tenant: Tenant, public_id: str, extra_bytes: int) -> bool:
    """Hold `extra_bytes` more for the job (a retry of its failed chunks: the results they will
    write), admitted as a submission is: StorageBudgetExceeded when they do not fit. False when the
    job holds nothing (its data is gone)."""
    with transaction.atomic():
        _lock_admissions()
        if not JobStorageHold.objects.filter(public_id=public_id).exists():
            return False
        _refuse_unless_it_fits(tenant, extra_bytes, what_needs="Running this job's failed chunks again needs")
        JobStorageHold.objects.filter(public_id=public_id).update(
            stored_bytes=F("stored_bytes") + extra_bytes
        )
    return True


def job_storage_shrink(*, public_id: str, bytes_given_back: int) -> None:
    """Give back what job_storage_grow held (a retry undone before it started)."""
    JobStorageHold.objects.filter(public_id=public_id, stored_bytes__gte=bytes_given_back).update(
        stored_bytes=F("stored_bytes") - bytes_given_back
    )


def job_storage_settle(
    *, public_id: str, completed: int, total: int, kept_input_bytes: int = 0, kept_input_keys: int = 0
) -> int:
    """The job ended and its inputs are deleted but for `kept_input_keys` chunks' (a failed job's
    failed chunks, kept for a retry: `kept_input_bytes` of texts): it holds its kept bytes, those
    inputs and the results it wrote (`completed` of `total` inputs). Only ever lowers the hold, so
    running twice is harmless. Returns the bytes given back."""
    hold = JobStorageHold.objects.filter(public_id=public_id).first()
    if hold is None:
        return 0
    inputs_kept = min(hold.input_bytes, kept_input_bytes + kept_input_keys * KEY_OVERHEAD_BYTES)
    held = hold.kept_bytes + inputs_kept + (hold.result_bytes * completed // total if total else 0)
    lowered = JobStorageHold.objects.filter(pk=hold.pk, stored_bytes__gt=held).update(stored_bytes=held)
    return hold.stored_bytes - held if lowered else 0


def job_storage_release(*, public_id: str) -> None:
    """The job's data is gone (deleted, expired, or a submission undone): nothing is held for it."""
    JobStorageHold.objects.filter(public_id=public_id).delete()


def job_storage_sweep(*, now: datetime | None = None) -> int:
    """Give back holds whose job row never appeared (a submission that died between admission and
    saving its job) or is gone. Returns how many."""
    cutoff = (now or timezone.now()) - ORPHANED_HOLD_AGE
    live_jobs = EmbeddingJob.objects.exclude(status=EmbeddingJob.Status.EXPIRED).values("public_id")
    orphans = JobStorageHold.objects.filter(created_at__lt=cutoff).exclude(public_id__in=live_jobs)
    deleted, _ = orphans.delete()
    return deleted
