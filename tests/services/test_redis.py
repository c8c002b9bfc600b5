"""The local Redis launcher and the service's Redis clients: real redis-server, timeouts when it is gone."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from embeddings.redis.connections import redis_async, redis_job_store, redis_sync, reset_redis_clients
from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port


def test_sync_client_talks_to_the_test_redis(service_redis):
    client = redis_sync()
    client.set("greeting", "hello")
    assert client.get("greeting") == b"hello"
    assert client is redis_sync()


async def test_async_client_is_per_event_loop(service_redis):
    client = redis_async()
    await client.set("answer", 42)
    assert await client.get("answer") == b"42"
    assert redis_async() is client


def test_the_job_store_client_follows_job_store_url_else_redis_url(service_redis, job_store_server, settings):
    redis_job_store().set("where", "job store")
    assert redis.Redis.from_url(job_store_server.url).get("where") == b"job store"
    assert redis_sync().get("where") is None
    options = redis_job_store().connection_pool.connection_kwargs
    assert options["socket_timeout"] == options["socket_connect_timeout"] == settings.JOB_STORE_TIMEOUT_S
    settings.JOB_STORE_URL = ""
    reset_redis_clients()
    redis_job_store().set("where", "shared")
    assert redis_sync().get("where") == b"shared"
    assert redis_job_store() is not redis_sync()  # its own pool and timeouts all the same


def test_a_stopped_redis_fails_fast(tmp_path, settings):
    with RedisServer(port=free_port(), data_dir=tmp_path, persistent=False) as server:
        settings.REDIS_URL = server.url
        settings.REDIS_TIMEOUT_S = 0.5
        reset_redis_clients()
        assert redis_sync().ping()
    assert not server.is_ready()
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis_sync().ping()

    async def ping_async() -> None:
        await redis_async().ping()

    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(ping_async())
    assert time.monotonic() - started < 5
    reset_redis_clients()


def test_persistent_server_keeps_data_across_restarts(tmp_path):
    port = free_port()
    with RedisServer(port=port, data_dir=tmp_path) as server:
        redis.Redis.from_url(server.url).set("kept", "yes")
    with RedisServer(port=port, data_dir=tmp_path) as server:
        assert redis.Redis.from_url(server.url).get("kept") == b"yes"
