"""/health (liveness) and /ready (readiness): no key, each dependency named when it fails, never a hang."""

from __future__ import annotations

import time

from embeddings.redis.connections import reset_redis_clients
from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.inference.clients import reset_clients
from embeddings.tooling.triton_server import free_port
from tests.processes import process_group_paused


async def test_health_needs_no_key(client):
    response = await client.get("/health")
    assert response.status_code == 200 and response.text == "ok"


async def test_ready_when_everything_answers(client):
    response = await client.get("/ready")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "status": "ready",
        "checks": {"triton": "ok", "model": "ok", "database": "ok", "redis": "ok", "job_store": "ok"},
        "models": {
            "all-MiniLM-L6-v2": {
                "triton_model": "minilm",
                "version": "1",
                "dtype": "float32",
                "engine": {"name": "onnxruntime-cpu", "precision": "float32"},
                "state": "READY",
                "reason": "",
            }
        },
        "embedding_cache": {"enabled": False},
    }
    assert response.headers["cache-control"] == "no-store"


async def test_not_ready_when_triton_is_down(client, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.READY_CHECK_TIMEOUT_S = 1.0
    reset_clients()
    started = time.monotonic()
    response = await client.get("/ready")
    assert time.monotonic() - started < 3
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable" and body["failed"] == ["triton", "model"]
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["triton"] != "ok" and "127.0.0.1" not in response.text  # hosts stay in the log
    assert body["models"] == {}  # Triton cannot say


async def test_not_ready_when_the_default_model_is_missing(client, model, settings):
    settings.DEFAULT_EMBEDDING_MODEL = "not-registered"
    embedding_model_cache_clear()
    response = await client.get("/ready")
    assert response.status_code == 503
    body = response.json()
    assert body["failed"] == ["model"]
    assert "not-registered" in body["checks"]["model"]


async def test_not_ready_when_the_database_fails(client, monkeypatch):
    from embeddings.api import health

    def broken() -> None:
        raise ConnectionError("database down")

    monkeypatch.setattr(health, "_database_ping", broken)
    response = await client.get("/ready")
    assert response.status_code == 503
    assert response.json()["failed"] == ["database"]
    assert response.json()["checks"]["database"] == "failed: ConnectionError"


async def test_a_hanging_check_times_out(client, settings, monkeypatch):
    from embeddings.api import health

    def hangs() -> None:
        time.sleep(3)

    monkeypatch.setattr(health, "_database_ping", hangs)
    settings.READY_CHECK_TIMEOUT_S = 0.3
    started = time.monotonic()
    response = await client.get("/ready")
    assert time.monotonic() - started < 2
    assert response.status_code == 503
    assert response.json()["checks"]["database"] == "timed out after 0.3 s"


async def test_redis_is_checked_unless_disabled(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_URL = ""  # the default: the job store on REDIS_URL's server
    reset_redis_clients()
    settings.READY_CHECK_REDIS = False
    assert {"redis", "job_store"}.isdisjoint((await client.get("/ready")).json()["checks"])
    settings.READY_CHECK_REDIS = True
    settings.READY_CHECK_TIMEOUT_S = 1.0
    started = time.monotonic()
    response = await client.get("/ready")
    assert time.monotonic() - started < 3
    assert response.status_code == 503
    # Both roles on the one server that is down: both named.
    assert response.json()["failed"] == ["redis", "job_store"]


async def test_the_job_store_is_checked_apart_from_the_critical_redis(client, settings):
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    reset_redis_clients()
    response = await client.get("/ready")
    assert response.status_code == 503
    body = response.json()
    assert body["failed"] == ["job_store"] and body["checks"]["redis"] == "ok"
    assert body["checks"]["job_store"] == "failed: ConnectionError"


# --- Several Triton replicas -----------------------------------------------------------------------


def replicas_target(*servers) -> str:
    return "ipv4:" + ",".join(server.grpc_target for server in servers)


async def test_ready_names_each_replica_and_stays_ready_while_one_serves(
    client, settings, triton_server, second_triton_server
):
    settings.TRITON_GRPC_TARGET = replicas_target(triton_server, second_triton_server)
    settings.READY_CHECK_TIMEOUT_S = 2.0
    reset_clients()
    body = (await client.get("/ready")).json()
    assert body["status"] == "ready", body
    first, second = triton_server.grpc_target, second_triton_server.grpc_target
    assert set(body["replicas"]) == {first, second}
    for replica in body["replicas"].values():
        assert replica["live"] and replica["model_ready"] and replica["versions"] == ["1"]
        assert replica["inference_count"] >= 0 and replica["execution_count"] >= 0
    with process_group_paused(second_triton_server.process):
        response = await client.get("/ready")
        embedded = await client.post("/v1/embeddings", json={"model": "minilm", "input": "hi"}, headers={})
    body = response.json()
    assert response.status_code == 200 and body["checks"]["triton"] == "ok", body
    assert body["replicas"][first]["model_ready"] is True
    assert body["replicas"][second] == {"live": False, "model_ready": False, "error": "TritonTimeout"}
    assert embedded.status_code == 401  # the route answers while a replica is stopped (no key sent)


async def test_replicas_serving_the_model_differently_are_refused_not_mixed(
    client, settings, triton_server, explicit_triton, alpha
):
    # The explicit Triton's minilm has versions 1 and 2: loaded, it serves version 2; the other
    # replica serves version 1.
    from embeddings.services.inference.clients import triton_sync_client

    triton_sync_client().model_load("minilm")
    settings.TRITON_GRPC_TARGET = replicas_target(triton_server, explicit_triton.server)
    settings.READY_CHECK_TIMEOUT_S = 5.0
    reset_clients()
    response = await client.get("/ready")
    body = response.json()
    assert response.status_code == 503 and body["failed"] == ["model"], body
    assert "serve model 'minilm' differently" in body["checks"]["model"]
    assert "version 1" in body["checks"]["model"] and "version 2" in body["checks"]["model"]
    refused = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "hi"}, headers=alpha.headers
    )
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_replicas_disagree" and "version 2" in error["message"]
    # The second replica stops serving the model (as while it is reloaded): nothing disagrees,
    # the process is ready on the first, and a call round-robin sends to the second is tried again
    # on the first.
    explicit_triton.unload_all()
    body = (await client.get("/ready")).json()
    assert (
        body["status"] == "ready"
        and body["replicas"][explicit_triton.server.grpc_target]["model_ready"] is False
    )
    for _ in range(4):
        served = await client.post(
            "/v1/embeddings", json={"model": "minilm", "input": "hi"}, headers=alpha.headers
        )
        assert served.status_code == 200, served.text
