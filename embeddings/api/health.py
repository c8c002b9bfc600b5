"""Liveness (/health) and readiness (/ready) for load balancers and orchestrators; no API key.

/health says the process answers. /ready says this process can serve embeddings now: Triton is
live, the default model is ready in Triton, the database answers, and both Redis roles answer:
the critical Redis and the job store (unless READY_CHECK_REDIS is off). Every check runs
concurrently under READY_CHECK_TIMEOUT_S, so /ready answers within about that long whatever is
down. A process shutting down (SIGTERM, embedsite/server.py) answers 503 at once, while it still
serves everything else for SHUTDOWN_DRAIN_S.

"embedding_cache" reports the embedding cache (services/inference/vector_cache.py): off, or on with
its Redis's state and the process's local entries. It never makes the process unready: without the
cache every row is computed.

It also reports, under "models", what Triton says of every enabled catalog model (its Triton
model, pinned version, dtype, the engine answering it, state and reason); only the default model
counts for readiness.

With several Triton replicas (TRITON_SERVER_URL a list or a `dns:///` name) each replica is asked
on its own, and "replicas" says per replica whether it is live, serves the default model, and its
inference and execution counts: the process is ready while at least one replica serves the model.
Replicas that serve the model differently (another version, other inputs or outputs) make it not
ready, and the model is refused with that reason until they agree again.
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
from embeddings.errors import EmbedsiteError
from embeddings.redis.connections import redis_async, redis_job_store
from embeddings.services.inference import catalog
from embeddings.services.inference.clients import triton_async_client
from embeddings.services.inference.serving import embedding_model_engine, models_serving_states
from embeddings.services.inference.vector_cache import vector_cache_state
from embeddings.triton import TritonError, TritonModelNotLoaded

logger = logging.getLogger(__name__)


class NotReady(EmbedsiteError):
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


class ReplicasCheck:
    """The "triton" and "model" checks of a replicated Triton: each replica asked once, concurrently."""

    def __init__(self) -> None:
        self.detail: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    async def triton(self) -> None:
        await self._asked()
        if not any(replica.get("live") for replica in self.detail.values()):
            raise NotReady("no Triton replica is live")

    async def model(self) -> None:
        name, reason = await self._asked()
        if reason:
            raise NotReady(reason)
        if not any(replica.get("model_ready") for replica in self.detail.values()):
            raise NotReady(f"Triton model {name!r} is ready on no replica")

    def _asked(self) -> Awaitable[tuple[str, str | None]]:
        # Shielded: one check's timeout must not cancel what the other check awaits too.
        if self._task is None:
            self._task = asyncio.ensure_future(self._ask())
        return asyncio.shield(self._task)

    async def _ask(self) -> tuple[str, str | None]:
        client = triton_async_client()
        name, version = await _default_triton_model()
        endpoints = await asyncio.to_thread(client.replica_endpoints)
        answers = await asyncio.gather(
            *(self._ask_one(client, endpoint, name, version) for endpoint in endpoints)
        )
        specs = {
            endpoint: spec for endpoint, spec in zip(endpoints, answers, strict=True) if spec is not None
        }
        reason = None
        if len(set(specs.values())) > 1:
            served = "; ".join(
                f"{endpoint} version {', '.join(spec.served_versions) or '?'}, "
                f"inputs {[t.name for t in spec.inputs]}, "
                f"outputs {[(t.name, list(t.shape)) for t in spec.outputs]}, max batch {spec.max_batch_size}"
                for endpoint, spec in sorted(specs.items())
            )
            reason = f"Triton's replicas serve model {name!r} differently, so it is not served: {served}"
        client.refuse_model(name, reason)
        return name, reason

    async def _ask_one(self, client, endpoint: str, name: str, version: str):
        # Half the check's time: a replica that answers nothing is reported, not the check timed out.
        replica = client.replica(endpoint, timeout_s=settings.READY_CHECK_TIMEOUT_S / 2)
        detail = self.detail[endpoint] = {"live": False, "model_ready": False}
        try:
            detail["live"] = await replica.server_live()
            detail["model_ready"] = await replica.model_ready(name, version)
            replica.forget_model(name)  # read afresh each time: a replica may change what it serves
            # Whatever versions it serves, pinned or not: a replica serving only another version is
            # a disagreement, not merely a replica that is not ready.
            spec, statistics = await asyncio.gather(
                replica.model_metadata(name), replica.model_statistics(name)
            )
        except TritonModelNotLoaded:
            return None  # loading, or not loaded yet: not ready there, nothing to compare
        except TritonError as error:
            detail["error"] = type(error).__name__
            return None
        detail |= {
            "versions": list(spec.served_versions),
            "inference_count": statistics.inference_count,
            "execution_count": statistics.execution_count,
        }
        return spec


def readiness_checks(replicas: ReplicasCheck | None = None) -> dict[str, Callable[[], Awaitable[None]]]:
    checks = {"triton": check_triton, "model": check_model, "database": check_database}
    if replicas is not None:
        checks |= {"triton": replicas.triton, "model": replicas.model}
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
    """Catalog name -> {triton_model, version, dtype, engine, state, reason} for each enabled model,
    from one repository index (engine: what runs a READY model and in what precision, null when
    Triton cannot say); {} when the catalog or Triton cannot be read (the checks say which)."""
    try:
        async with asyncio.timeout(settings.READY_CHECK_TIMEOUT_S):
            models = await catalog.embedding_models_enabled_cached()
            states = await models_serving_states(models=models)
    except Exception as error:
        logger.warning("readiness: the models' states could not be read: %s", error)
        return {}
    by_name = {model.name: model for model in models}

    async def engine(state) -> dict | None:
        model = by_name.get(state.name)
        return await embedding_model_engine(model=model) if model is not None and state.ready else None

    engines = await asyncio.gather(*(engine(state) for state in states))
    return {
        state.name: {
            "triton_model": state.triton_model,
            "version": state.version,
            "dtype": catalog.embedding_model_dtype(model=by_name[state.name])["dtype"]
            if state.name in by_name
            else None,
            "engine": engine,
            "state": state.state,
            "reason": state.reason,
        }
        for state, engine in zip(states, engines, strict=True)
    }


async def ready(request: HttpRequest) -> JsonResponse:
    """200 {"status": "ready", "checks": {...}, "models": {...}}, or 503 with the failed checks named."""
    if lifecycle.shutting_down():
        # No check run: whatever they say, load balancers must stop sending here.
        return _readiness_response(
            "shutting down", {"shutdown": "this process is shutting down (SIGTERM)"}, ["shutdown"]
        )
    replicas = ReplicasCheck() if triton_async_client().replicas.replicated else None
    checks = readiness_checks(replicas)
    *outcomes, models, cache = await asyncio.gather(
        *(_run_check(name, check) for name, check in checks.items()), models_report(), vector_cache_state()
    )
    results = dict(zip(checks, outcomes, strict=True))
    failed = [name for name, outcome in results.items() if outcome != "ok"]
    detail = None if replicas is None else replicas.detail
    return _readiness_response("unavailable" if failed else "ready", results, failed, models, detail, cache)


def _readiness_response(
    status: str,
    checks: dict[str, str],
    failed: list[str],
    models: dict | None = None,
    replicas: dict | None = None,
    embedding_cache: dict | None = None,
) -> JsonResponse:
    body: dict[str, object] = {"status": status, "checks": checks}
    if models is not None:
        body["models"] = models
    if replicas is not None:
        body["replicas"] = replicas
    if embedding_cache is not None:
        body["embedding_cache"] = embedding_cache
    if failed:
        body["failed"] = failed
    response = JsonResponse(body, status=503 if failed else 200)
    response["Cache-Control"] = "no-store"
    return response
