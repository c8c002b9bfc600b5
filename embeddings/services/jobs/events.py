"""Job events: progress published to the channel layer group of a job, which WebSocket watchers
join, and a short history kept in the job store for operators (the admin's job page).

Group `job_<public id>`; message `{"type": "job.progress", "job": <the job's API object>}`. Without a
channel layer configured, publishing does nothing (the job's state is still in the database).
The history (JobStore.event_append) keeps the job's last JOB_EVENTS_KEPT state changes, chunk
failures, re-sends and operators' actions: not the progress events, which a big job sends
every half second and would push the rest out.
"""

from __future__ import annotations

import logging

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from embeddings.services.jobs.store import JobStore

logger = logging.getLogger(__name__)


def job_event_keep(store: JobStore, *, event: str, detail: str = "") -> None:
    """Add an event to the job's history; never raises (the history is for people, the job goes on
    without it)."""
    try:
        store.event_append(event, detail)
    except redis.RedisError as error:
        logger.warning("job %s: event %s not kept: %s", store.job_id, event, error)


def job_group(public_id: str) -> str:
    return f"job_{public_id}"


def job_event_publish(*, public_id: str, job: dict) -> None:
    """Push a job's current state to its watchers (sync: called from Celery tasks); never raises."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(job_group(public_id), {"type": "job.progress", "job": job})
    except Exception as error:  # watchers are a convenience: the job goes on without them
        logger.warning("could not publish progress of job %s: %s", public_id, error)
