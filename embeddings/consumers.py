"""WebSocket `/ws/v1/jobs/<id>`: a job's progress pushed to its tenant as it happens.

Authentication is the HTTP API's: the key in `Authorization: Bearer emb_...` or, for browsers (which
cannot set headers on a WebSocket), as a subprotocol: `new WebSocket(url, ["embedsite.v1",
"bearer.emb_..."])`; `embedsite.v1` is echoed back. The server sends `{"type": "job.progress",
"job": <job object>}` at once, then on every change, and closes with 1000 after a finished status.
Refusals are sent as close codes after the handshake (a refused handshake shows the browser only
"failed"): 4401 no or bad key, 4403 key not allowed (inactive tenant), 4404 no such job for this
tenant.
"""

from __future__ import annotations

import logging

import orjson
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer

from embeddings.api.authentication import caller_for_api_key
from embeddings.errors.answers import ApiError, Unauthorized
from embeddings.models import EmbeddingJob
from embeddings.services.jobs.events import job_group
from embeddings.services.jobs.reads import job_for_tenant, job_object

logger = logging.getLogger(__name__)

SUBPROTOCOL = "embedsite.v1"
BEARER_SUBPROTOCOL_PREFIX = "bearer."

CLOSE_NORMAL = 1000
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404

FINISHED_STATUSES = frozenset(str(status) for status in EmbeddingJob.FINISHED)


def api_key_from_scope(scope: dict) -> str | None:
    """The key from the Authorization header, else from a `bearer.<key>` subprotocol."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" and key.strip() else None
    for subprotocol in scope.get("subprotocols", []):
        if subprotocol.startswith(BEARER_SUBPROTOCOL_PREFIX):
            return subprotocol[len(BEARER_SUBPROTOCOL_PREFIX) :] or None
    return None


def _job_for_tenant(*, tenant_id: int, public_id: str) -> dict | None:
    job = job_for_tenant(tenant_id=tenant_id, public_id=public_id)
    return None if job is None else job_object(job)


def _progress(job: dict) -> tuple[bool, int]:
    counts = job.get("counts") or {}
    return job.get("status") in FINISHED_STATUSES, counts.get("completed", 0) + counts.get("failed", 0)


class JobProgressConsumer(AsyncJsonWebsocketConsumer):
    """One watcher of one job: joins the job's group (services/jobs/events.py) once authorised."""

    async def connect(self) -> None:
        subprotocol = SUBPROTOCOL if SUBPROTOCOL in self.scope.get("subprotocols", []) else None
        public_id = self.scope["url_route"]["kwargs"]["job_id"]
        self.group = None
        self.last_progress: tuple[bool, int] = (False, -1)
        key = api_key_from_scope(self.scope)
        try:
            if key is None:
                raise Unauthorized("No API key.")
            caller = await caller_for_api_key(key)
        except ApiError as error:
            await self.accept(subprotocol)
            code = CLOSE_UNAUTHORIZED if isinstance(error, Unauthorized) else CLOSE_FORBIDDEN
            await self.close(code)
            return
        # Join before reading, so no change falls between the read and the subscription (group
        # messages are handled only after connect() returns: none reaches a refused watcher).
        self.group = job_group(public_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        job = await database_sync_to_async(_job_for_tenant)(tenant_id=caller.tenant_id, public_id=public_id)
        await self.accept(subprotocol)
        if job is None:
            await self._leave()
            await self.close(CLOSE_NOT_FOUND)
            return
        await self._send_state(job)

    async def disconnect(self, code: int) -> None:
        await self._leave()

    async def _leave(self) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            self.group = None

    async def job_progress(self, event: dict) -> None:
        """A `job.progress` message from the job's group."""
        await self._send_state(event["job"])

    async def _send_state(self, job: dict) -> None:
        # Events published before the first read may arrive after it: never show counts going back.
        progress = _progress(job)
        if self.group is None or progress < self.last_progress:
            return
        self.last_progress = progress
        await self.send_json({"type": "job.progress", "job": job})
        if progress[0]:
            await self._leave()
            await self.close(CLOSE_NORMAL)

    @classmethod
    async def encode_json(cls, content: dict) -> str:
        return orjson.dumps(content).decode()


class UnknownRouteConsumer(AsyncWebsocketConsumer):
    """Any other WebSocket path: refused at the handshake (uvicorn answers 403), where channels'
    router would raise "No route found" and the client would get a 500."""

    async def connect(self) -> None:
        await self.close()
