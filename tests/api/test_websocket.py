"""WS /ws/v1/jobs/<id> against the real ASGI application and the real Redis channel layer: who may
watch, what they see first, that published progress arrives, and the close after a finished job."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from embeddings.api import authentication
from embeddings.consumers import CLOSE_NORMAL, CLOSE_NOT_FOUND, CLOSE_UNAUTHORIZED
from embeddings.models import EmbeddingJob, EmbeddingModel
from embeddings.services.jobs.events import job_event_publish
from embeddings.services.jobs.reads import job_object
from tests.conftest import TenantWithKey

TIMEOUT_S = 5


@pytest.fixture
def ws_setup(transactional_db, two_tenants, service_redis, settings):
    """Two tenants with a key each and a running job of Alpha's; the channel layer on the test Redis."""
    settings.API_KEY_CACHE_SECONDS = 0.2
    assert settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"] == [service_redis.url]
    authentication.caller_cache.clear()
    model = EmbeddingModel.objects.create(name="ws-model", triton_model="ws", dimensions=4, max_tokens=16)
    alpha, beta = two_tenants.alpha, two_tenants.beta
    job = EmbeddingJob.objects.create(
        public_id="job_wsalpha00000000000000000",
        tenant=alpha.tenant,
        model=model,
        status=EmbeddingJob.Status.RUNNING,
        total=10,
        completed=2,
    )
    yield {"alpha": alpha, "beta": beta, "job": job}
    authentication.caller_cache.clear()


def _communicator(path: str, *, headers=None, subprotocols=None) -> WebsocketCommunicator:
    from embedsite.asgi import application

    return WebsocketCommunicator(application, path, headers=headers or [], subprotocols=subprotocols)


def _bearer(owner: TenantWithKey | str) -> list[tuple[bytes, bytes]]:
    key = owner if isinstance(owner, str) else owner.secret
    return [(b"authorization", f"Bearer {key}".encode())]


async def _close_code(communicator: WebsocketCommunicator) -> int:
    message = await communicator.receive_output(TIMEOUT_S)
    assert message["type"] == "websocket.close", message
    return message.get("code", CLOSE_NORMAL)


@pytest.fixture
async def watching(ws_setup) -> AsyncIterator[WebsocketCommunicator]:
    """Alpha watching its job, connected by header."""
    communicator = _communicator(
        "/ws/v1/jobs/job_wsalpha00000000000000000", headers=_bearer(ws_setup["alpha"])
    )
    connected, _ = await communicator.connect(TIMEOUT_S)
    assert connected
    yield communicator
    await communicator.disconnect()


async def _publish(job: EmbeddingJob, **changes) -> dict:
    for name, value in changes.items():
        setattr(job, name, value)
    await sync_to_async(job.save)()
    state = await sync_to_async(job_object)(job)
    await sync_to_async(job_event_publish)(public_id=job.public_id, job=state)
    return state


async def test_the_current_state_is_sent_at_once_by_header(ws_setup, watching):
    message = await watching.receive_json_from(TIMEOUT_S)
    assert message["type"] == "job.progress"
    assert message["job"]["id"] == "job_wsalpha00000000000000000"
    assert message["job"]["status"] == "running"
    assert message["job"]["counts"]["completed"] == 2
    assert message["job"]["counts"]["total"] == 10


async def test_the_key_as_a_subprotocol_is_accepted_and_the_protocol_echoed(ws_setup):
    communicator = _communicator(
        "/ws/v1/jobs/job_wsalpha00000000000000000",
        subprotocols=["embedsite.v1", f"bearer.{ws_setup['alpha'].secret}"],
    )
    connected, subprotocol = await communicator.connect(TIMEOUT_S)
    assert connected
    assert subprotocol == "embedsite.v1"
    message = await communicator.receive_json_from(TIMEOUT_S)
    assert message["job"]["id"] == "job_wsalpha00000000000000000"
    await communicator.disconnect()


@pytest.mark.parametrize(
    "auth",
    [
        {},
        {"headers": [(b"authorization", b"Basic dXNlcjpwYXNz")]},
        {"headers": _bearer("emb_garbage")},
        {"subprotocols": ["embedsite.v1", "bearer.emb_abcdefgh_notarealsecretnotarealsecret"]},
    ],
    ids=["no key", "not bearer", "malformed", "unknown key in subprotocol"],
)
async def test_a_missing_or_bad_key_is_closed_with_4401(ws_setup, auth):
    communicator = _communicator("/ws/v1/jobs/job_wsalpha00000000000000000", **auth)
    connected, _ = await communicator.connect(TIMEOUT_S)
    assert connected  # accepted, so that the browser sees the code
    assert await _close_code(communicator) == CLOSE_UNAUTHORIZED


async def test_a_revoked_key_is_closed_with_4401(ws_setup):
    alpha = ws_setup["alpha"]
    alpha.api_key.revoked_at = alpha.api_key.created_at
    await sync_to_async(alpha.api_key.save)()
    communicator = _communicator("/ws/v1/jobs/job_wsalpha00000000000000000", headers=_bearer(alpha))
    await communicator.connect(TIMEOUT_S)
    assert await _close_code(communicator) == CLOSE_UNAUTHORIZED


async def test_another_tenants_job_is_4404_like_a_missing_one(ws_setup):
    for path in ("/ws/v1/jobs/job_wsalpha00000000000000000", "/ws/v1/jobs/job_doesnotexist"):
        communicator = _communicator(path, headers=_bearer(ws_setup["beta"]))
        connected, _ = await communicator.connect(TIMEOUT_S)
        assert connected
        assert await _close_code(communicator) == CLOSE_NOT_FOUND


async def test_the_other_tenant_receives_nothing_of_the_job(ws_setup, watching):
    """Beta's refused watcher left the group: Alpha's progress reaches only Alpha."""
    beta = _communicator("/ws/v1/jobs/job_wsalpha00000000000000000", headers=_bearer(ws_setup["beta"]))
    await beta.connect(TIMEOUT_S)
    assert await _close_code(beta) == CLOSE_NOT_FOUND
    await watching.receive_json_from(TIMEOUT_S)
    await _publish(ws_setup["job"], completed=5)
    assert (await watching.receive_json_from(TIMEOUT_S))["job"]["counts"]["completed"] == 5
    assert await beta.receive_nothing(0.3)


async def test_published_progress_arrives_and_a_finished_status_closes(ws_setup, watching):
    job = ws_setup["job"]
    assert (await watching.receive_json_from(TIMEOUT_S))["job"]["counts"]["completed"] == 2

    await _publish(job, completed=6)
    message = await watching.receive_json_from(TIMEOUT_S)
    assert (message["type"], message["job"]["status"], message["job"]["counts"]["completed"]) == (
        "job.progress",
        "running",
        6,
    )

    await _publish(job, completed=10, status=EmbeddingJob.Status.COMPLETED)
    message = await watching.receive_json_from(TIMEOUT_S)
    assert (message["job"]["status"], message["job"]["counts"]["completed"]) == ("completed", 10)
    assert await _close_code(watching) == CLOSE_NORMAL


async def test_stale_progress_is_not_sent(ws_setup, watching):
    """An event published before the watcher's first read may arrive after it: counts never go back."""
    job = ws_setup["job"]
    await watching.receive_json_from(TIMEOUT_S)
    stale = await sync_to_async(job_object)(job)  # completed=2, already shown
    await _publish(job, completed=7)
    assert (await watching.receive_json_from(TIMEOUT_S))["job"]["counts"]["completed"] == 7
    stale["counts"]["completed"] = 3
    await sync_to_async(job_event_publish)(public_id=job.public_id, job=stale)
    assert await watching.receive_nothing(0.3)


async def test_a_finished_job_sends_its_state_and_closes(ws_setup):
    job = ws_setup["job"]
    job.status, job.completed = EmbeddingJob.Status.FAILED, 4
    await sync_to_async(job.save)()
    communicator = _communicator(
        "/ws/v1/jobs/job_wsalpha00000000000000000", headers=_bearer(ws_setup["alpha"])
    )
    connected, _ = await communicator.connect(TIMEOUT_S)
    assert connected
    assert (await communicator.receive_json_from(TIMEOUT_S))["job"]["status"] == "failed"
    assert await _close_code(communicator) == CLOSE_NORMAL
