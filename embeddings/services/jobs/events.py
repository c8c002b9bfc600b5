"""Job progress events: published to the channel layer group of a job, which WebSocket watchers join.

Group `job_<public id>`; message `{"type": "job.progress", "job": <the job's API object>}`. Without a
channel layer configured, publishing does nothing (the job's state is still in the database).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)


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
