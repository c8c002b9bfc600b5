"""Celery tasks: thin wrappers that call services."""

from __future__ import annotations

from celery import shared_task

from embeddings.services.usage import usage_fold


@shared_task(acks_late=True, reject_on_worker_lost=True)
def usage_fold_task() -> dict[str, int]:
    """Fold Redis's usage counters into UsageBucket rows (beat runs it every USAGE_FOLD_INTERVAL_S).

    Idempotent by design (UsageFold rows), so a redelivery after a lost worker is harmless.
    """
    result = usage_fold()
    return {"batches": result.batches, "buckets": result.buckets, "dropped": result.dropped}
