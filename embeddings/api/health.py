"""Liveness (/health) and readiness (/ready) for load balancers and orchestrators; no API key.

/health says the process answers. /ready says this process can serve embeddings now: Triton is
live, the default model is ready in Triton, the database answers, and both Redis roles answer:
the critical Redis and the job store (unless READY_CHECK_REDIS is off). Every check runs
concurrently under READY_CHECK_TIMEOUT_S, so /ready answers within about that long whatever is
down. A process shutting down (SIGTERM, embedsite/server.py) answers 503 at once, while it still
serves everything else for SHUTDOWN_DRAIN_S.

It also reports, under "models", what Triton says of every enabled catalog model (its Triton
model, pinned version, state and reason); only the default model counts for readiness.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse

from embeddings import lifecycle
from embeddings.redis.connections import redis_async, redis_job_store
from embeddings.services import catalog
from embeddings.services.inference import triton_async_client
from embeddings.services.model_serving import models_serving_states_async

logger = logging.getLogger(__name__)


class NotReady(Exception):
    """A dependency answered, but is not ready (the message says how)."""


async def health(request: HttpRequest) -> HttpResponse:
    """Liveness: the process answers. Readiness (Triton, database) is /ready."""
    return HttpResponse("ok", content_type="text/plain")


async def _default_triton_model() -> tuple[str, str]:
    """The Triton model (name, version) behind DEFAULT_EMBEDDING_MODEL."""
    try:
        model = await catalog.embedding_model_resolve(name=settings.DEFAULT_EMBEDDING_MODEL)
    except Exception:
        # The database check reports the database; still check the model the settings name.
        return settings.MODEL_NAME, settings.MODEL_VERSION
    if model is None:
        raise NotReady(f"the default model {settings.DEFAULT_EMBEDDING_MODEL!r} is not registered")
    return model.triton_model, model.triton_version


async def check_triton() -> None:
    # Live, not ServerReady: with explicit model control Triton calls itself unready while any
    # model is loading, unloading or failed to load, and only the default model counts here.
    if not await triton_async_client().server_live():
        raise NotReady("Triton is up but not live")


async def check_model() -> None:
    name, version = await _default_triton_model()
    if not await triton_async_client().model_ready(name, version):
        raise NotReady(f"Triton model {name!r} is not ready")


def _database_ping() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        # This runs on a pool thread, outside the request's connection handling: close what it opened.
        connection.close()


async def check_database() -> None:
    # Not thread_sensitive: a ping stuck in the driver must not hold the request's own thread,
    # which Django waits for before it finishes the response.
    await sync_to_async(_database_ping, thread_sensitive=False)()


async def check_redis() -> None:
    await redis_async().ping()


async def check_job_store() -> None:
    # The blocking client on a pool thread (its PING bounded by JOB_STORE_TIMEOUT_S): not the
    # request's thread, which a stuck job store must not hold.
    await sync_to_async(redis_job_store().ping, thread_sensitive=False)()


def readiness_checks() -> dict[str, Callable[[], Awaitable[None]]]:
    checks = {"triton": check_triton, "model": check_model, "database": check_database}
    if settings.REDIS_URL and settings.READY_CHECK_REDIS:
        checks["redis"] = check_redis
        checks["job_store"] = check_job_store
    return checks


async def _run_check(name: str, check: Callable[[], Awaitable[None]]) -> str:
    """ "ok", or what went wrong: our own message, or the error's class (hosts stay in the log)."""
    timeout = settings.READY_CHECK_TIMEOUT_S
    try:
        await asyncio.wait_for(check(), timeout)
    except NotReady as error:
        return str(error)
    except TimeoutError:
        logger.warning("readiness check %s timed out after %s s", name, timeout)
        return f"timed out after {timeout:g} s"
    except Exception as error:
        logger.warning("readiness check %s failed: %s", name, error)
        return f"failed: {type(error).__name__}"
    return "ok"


async def models_report() -> dict[str, dict[str, str]]:
    """Catalog name -> {triton_model, version, state, reason} for each enabled model, from one
    repository index; {} when the catalog or Triton cannot be read (the checks say which)."""
    try:
        async with asyncio.timeout(settings.READY_CHECK_TIMEOUT_S):
            models = await catalog.embedding_models_enabled_cached()
            states = await models_serving_states_async(models=models)
    except Exception as error:
        logger.warning("readiness: the models' states could not be read: %s", error)
        return {}
    return {
        state.name: {
            "triton_model": state.triton_model,
            "version": state.version,
            "state": state.state,
            "reason": state.reason,
        }
        for state in states
    }


async def ready(request: HttpRequest) -> JsonResponse:
    """200 {"status": "ready", "checks": {...}, "models": {...}}, or 503 with the failed checks named."""
    if lifecycle.shutting_down():
        # No check run: whatever they say, load balancers must stop sending here.
        return _readiness_response(
            "shutting down", {"shutdown": "this process is shutting down (SIGTERM)"}, ["shutdown"]
        )
    checks = readiness_checks()
    *outcomes, models = await asyncio.gather(
        *(_run_check(name, check) for name, check in checks.items()), models_report()
    )
    results = dict(zip(checks, outcomes, strict=True))
    failed = [name for name, outcome in results.items() if outcome != "ok"]
    return _readiness_response("unavailable" if failed else "ready", results, failed, models)


def _readiness_response(
    status: str, checks: dict[str, str], failed: list[str], models: dict | None = None
) -> JsonResponse:
    body: dict[str, object] = {"status": status, "checks": checks}
    if models is not None:
        body["models"] = models
    if failed:
        body["failed"] = failed
    response = JsonResponse(body, status=503 if failed else 200)
    response["Cache-Control"] = "no-store"
    return response
